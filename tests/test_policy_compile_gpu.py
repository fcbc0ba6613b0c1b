"""grpo.compile on a CUDA GPU (marker `gpu`): one GRPO update of a compiled policy equals the eager
one in float32, with checkpointing inside the compiled layer and without it. The CPU test
(test_policy_compile.py) passed for a version that failed on the GPU (checkpointing around a
compiled layer: CheckpointError in backward), so the GPU gets its own. The batch's micro-batches
include single sequences and pairs (torch.compile specialises a batch of one), so both of the
layer's graph variants run. bf16's gap is benchmarks/train_gpu.py's figure, not a test's."""
import pytest
import torch
from test_policy_compile import assert_same_update, synthetic_batch, trained

from lorabench.loss import token_budget_batches
from lorabench.policy import COMPILED_WIDTH_MULTIPLE
from lorabench.rollout import round_up

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run on the GPU machine: bash dev/gpu_suite.sh)", allow_module_level=True)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_compiled_update_equals_eager_on_gpu(tiny_model_dir, checkpointing):
    from torch._dynamo.utils import counters
    setting = f"grpo.activation_checkpointing={str(checkpointing).lower()}"
    # a 40-token budget: compiled widths round up to 16 or 24 here, so the two 24-wide sequences get a
    # micro-batch each and the 16-wide ones go in pairs (a 30-token budget gave only batches of one
    # once widths rounded up, and the check on graphs below failed for it on the H200)
    widths = [round_up(n, COMPILED_WIDTH_MULTIPLE) for n in synthetic_batch().lengths]
    assert sorted(map(len, token_budget_batches(widths, 40))) == [1, 1, 2, 2], widths
    eager_stats, eager_grads = trained(tiny_model_dir, "off", "cuda", setting, "grpo.micro_batch_tokens=40")
    # a fresh compile: after the other case in the same process, dynamo reused a graph both share and counted 2
    torch._dynamo.reset()
    counters.clear()
    compiled_stats, compiled_grads = trained(tiny_model_dir, "all", "cuda", setting, "grpo.micro_batch_tokens=40")
    assert counters["stats"]["unique_graphs"] >= 3 and not counters["graph_break"], dict(counters)
    assert_same_update((eager_stats, eager_grads), (compiled_stats, compiled_grads), rel=1e-4, abs_stats=1e-6)


def test_an_update_waits_for_the_gpu_as_often_with_four_micro_batches_as_with_one(tiny_model_dir):
    """Policy.train waits for the device once per optimizer step and a fixed few times at its end (the
    statistics to the host), never per micro-batch, so a launch-bound update (small micro-batches, or kernels
    beside the engine's) launches ahead of the GPU. CUDA's sync debug mode reports each wait as a warning; the
    waits counted are those asked for under a lorabench frame. A wait with none is printed with its thread and
    stack, not counted: with torch 2.11 (H100 and H200) one comes from switching the mode on itself, inside
    `torch.cuda.set_sync_debug_mode("warn")`, in the first budget measured."""
    import threading
    import traceback
    import warnings
    from pathlib import Path

    import lorabench
    from lorabench.policy import Policy
    from lorabench.session.config import Config

    package = str(Path(lorabench.__file__).parent) + "/"

    def waits(budget: int) -> tuple[int, int]:
        cfg = Config.load(overrides=["lora.r=4", "lora.alpha=8", "grpo.compile=all",
                                     f"grpo.micro_batch_tokens={budget}"])
        torch.manual_seed(0)
        policy = Policy(str(tiny_model_dir), cfg.lora, cfg.grpo, "float32", "cuda")
        batch = synthetic_batch()
        policy.train(batch)   # compiles
        parts = len(token_budget_batches([round_up(n, COMPILED_WIDTH_MULTIPLE) for n in batch.lengths], budget))
        torch.cuda.synchronize()
        where: list[str] = []   # each wait: the innermost lorabench frames that asked for it
        outside: list[str] = []   # waits with no lorabench frame: the thread and the innermost frames

        def record(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                stack = traceback.extract_stack()
                frames = [f"{Path(f.filename).name}:{f.lineno} {f.name}"
                          for f in stack if f.filename.startswith(package)]
                if frames:
                    where.append(" < ".join(reversed(frames[-3:])))
                else:
                    outside.append(f"{threading.current_thread().name}: {filename}:{lineno} <- "
                                   + " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in stack[-6:-1]))

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                policy.train(batch)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        print(f"micro-batch budget {budget}: {len(where)} waits in train {where}; outside lorabench: {outside}")
        return where, parts

    (one, one_parts), (many, many_parts) = waits(4096), waits(40)
    assert one_parts == 1 and many_parts == 4, (one_parts, many_parts)
    assert len(many) == len(one) <= 4, ("one micro-batch:", one, "four:", many)
