"""SGLang's own calls on a running SGLangEngine, for benchmarks and GPU tests that time or poke
SGLang itself (not part of the product, which calls the Engine only through SGLangEngine)."""
from __future__ import annotations


def call_sglang(engine, fn):
    """fn(sglang_engine) on the SGLangEngine's own thread, where SGLang's sync methods must run (its
    loop lives there); an interrupted caller aborts the request, as the engine's own calls do."""
    from lorabench.engines.base import EngineError
    if engine._thread is None:
        raise EngineError("call_sglang: the engine is closed; open a new one")
    return engine._thread.call(lambda: fn(engine.engine), on_interrupt=engine._abort)


def gpu_header() -> dict:
    """What a GPU result records of its machine and versions (commit: $LORABENCH_COMMIT)."""
    import os
    import time

    import sglang
    import torch
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "sglang": sglang.__version__,
            "commit": os.environ.get("LORABENCH_COMMIT", ""), "date": time.strftime("%Y-%m-%d %H:%M")}


def timed_decode(engine, ids: list[list[int]], new_tokens: int, adapter, logprob: bool = False) -> float:
    """Seconds of SGLang's own generate of `new_tokens` per prompt (ignore_eos, temperature 1), GPU work included;
    `adapter`: one name (or None) for every prompt, or a list of one per prompt."""
    from lorabench.clock import synced_time
    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "top_p": 1.0, "ignore_eos": True}
    lora = adapter if isinstance(adapter, list) else [adapter] * len(ids)
    t0 = synced_time()
    call_sglang(engine, lambda e: e.generate(input_ids=ids, sampling_params=params, lora_path=lora,
                                             return_logprob=logprob))
    return synced_time() - t0
