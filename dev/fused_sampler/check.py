"""On the GPU: lorabench's one-pass sampler (engines/one_pass_sampler.py) against SGLang 0.5.17's sampling ops
for plain temperature sampling with log-probs (divide, softmax copied back, multinomial, log, clamp, gather): the
log-probs' gap to torch.log_softmax and the time of each at a group's batch sizes over Qwen3's vocabulary. The
draws' distribution is the GPU test's (`test_one_pass_sampler_draws_and_serves_as_sglangs_does`).
    python dev/fused_sampler/check.py --out check.json   (dev/gpu_session.sh's sampler part runs it)"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lorabench.engines.one_pass_sampler import gumbel_sample  # noqa: E402

VOCAB = 151936


def sglang_like(logits: torch.Tensor, temperatures: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What SGLang 0.5.17's Sampler.forward runs in this case (sampler.py, logprob_processor.py)."""
    logits.div_(temperatures)
    logits[:] = torch.softmax(logits, dim=-1)
    ids = torch.multinomial(logits, num_samples=1).view(-1).to(torch.int32)
    logprobs = torch.log(logits)
    logprobs.clamp_(min=torch.finfo(logprobs.dtype).min)
    return ids, logprobs[torch.arange(len(ids), device=ids.device), ids]


def timed(fn, repeats: int = 20) -> float:
    times = []
    for _ in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[3:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    t0 = time.time()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for rows in (128, 512, 2048):
        logits = torch.randn(rows, VOCAB, device="cuda") * 3
        temps = torch.ones(rows, 1, device="cuda")
        ids, lp = gumbel_sample(logits, temps)
        ref = torch.log_softmax(logits, -1)[torch.arange(rows, device="cuda"), ids.long()]
        work = logits.clone()
        fused_ms = timed(lambda x=logits, t=temps: gumbel_sample(x, t))
        sglang_ms = (timed(lambda w=work, x=logits, t=temps: sglang_like(w.copy_(x), t))
                     - timed(lambda w=work, x=logits: w.copy_(x)))
        row = {"rows": rows, "fused_ms": fused_ms, "sglang_ops_ms": sglang_ms,
               "logprob_max_abs_gap": float((lp - ref).abs().max())}
        result["rows"].append(row)
        print(f"[{time.time() - t0:6.1f} s] {json.dumps(row)}", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
