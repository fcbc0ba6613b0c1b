"""Teaching helpers for the notebooks, one module per subject (step: notebook 01, refresh_costs: 02, hotswap
and staleness: 03, ranks: 04; lora and checks serve several), all re-exported here (explain.rank_verdict, ...).
Every number comes from the real trainer and engine; every sentence that states an order or a trend is
computed from the numbers it is about."""
from .checks import *  # noqa: F403
from .hotswap import *  # noqa: F403
from .lora import *  # noqa: F403
from .ranks import *  # noqa: F403
from .refresh_costs import *  # noqa: F403
from .staleness import *  # noqa: F403
from .step import *  # noqa: F403
