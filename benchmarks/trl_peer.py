"""The peer, side by side (issue 36): TRL's GRPOTrainer + a PEFT LoRA adapter at our GPU setting.

Random-init Qwen3-0.6B shape in bf16 ($LORABENCH_CACHE/qwen3-0.6b-random, built like step_gpu.py), LoRA r=32
alpha=64 on q,k,v,o,gate,up,down; 64 prompts x 8 completions x 256 new tokens per optimizer step, temperature 1.0,
use_vllm=False (TRL's own transformers generate), bf16, gradient checkpointing on (set explicitly), beta as
TRL's default. Micro-batch 8 completions x gradient_accumulation 64 = 512 completions per optimizer step, and
steps_per_generation = gradient_accumulation_steps, so one generation of 64x8 feeds exactly one optimizer step.
A TrainerCallback times each optimizer step by wall clock, prints a line per step, writes --out after each, and
stops at --steps or before a step that would pass --time-limit; a heartbeat prints every 30 s and, past the
limit mid-step, writes what it has (with the step it stopped in) and exits 3.
GPU (offline): bash .trl-site/with-trl.sh python benchmarks/trl_peer.py --out $OUT/trl_peer.json
CPU smoke: --tiny (lorabench's tiny model, 2 prompts x 2 x 8 tokens, 2 steps).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lorabench.data import parse_ground_truth, synthetic_problems  # noqa: E402
from lorabench.rewards import gsm8k_reward  # noqa: E402
from lorabench.tiny import build_tiny_tokenizer  # noqa: E402

T0 = time.perf_counter()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--time-limit", type=float, default=420.0)
    ap.add_argument("--cache", default=os.environ.get("LORABENCH_CACHE", "/tmp/lorabench-cache"))
    a = ap.parse_args()
    import accelerate
    import datasets
    import peft
    import transformers
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    prompts, gens, new = (2, 2, 8) if a.tiny else (64, 8, 256)
    micro = 2 if a.tiny else 8
    if a.tiny:
        a.steps = min(a.steps, 2)
    root = Path(tempfile.mkdtemp(prefix="trl-peer-"))
    build_tiny_tokenizer(root / "tok")
    if a.tiny:
        from lorabench.tiny import build_tiny_model
        tok = AutoTokenizer.from_pretrained(root / "tok")
        model_dir = root / "tiny"
        build_tiny_model(tok).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    else:
        from synthetic import random_qwen3_dir
        model_dir = random_qwen3_dir("0.6B", str(root / "tok"), Path(a.cache) / "qwen3-0.6b-random")
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    dtype = torch.float32 if a.tiny else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    probs = synthetic_problems(prompts * (a.steps + 2), "trl-peer")
    ds = Dataset.from_list([
        {"prompt": [{"role": "user", "content": p.question}], "answer": parse_ground_truth(p.answer)}
        for p in probs])

    def strict_reward(completions, answer, **kw):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [gsm8k_reward(t, y, mode="strict") for t, y in zip(texts, answer)]

    lora = LoraConfig(r=32, lora_alpha=64, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    accum = prompts * gens // micro
    settings = dict(per_device_train_batch_size=micro, gradient_accumulation_steps=accum, steps_per_generation=accum,
                    num_generations=gens, max_completion_length=new, temperature=1.0, use_vllm=False,
                    bf16=not a.tiny, gradient_checkpointing=True, learning_rate=1e-5, max_steps=a.steps,
                    num_iterations=1, logging_steps=1, save_strategy="no", report_to=[], seed=0,
                    dataloader_num_workers=0, use_cpu=a.tiny)
    cfg = GRPOConfig(output_dir=str(root / "out"), **settings)
    assert cfg.generation_batch_size == prompts * gens, (cfg.generation_batch_size, prompts * gens)

    steps: list[float] = []
    marks = {"last": None}

    def write(**extra) -> dict:
        out = {"what": "TRL GRPOTrainer + PEFT LoRA, the peer (issue 36)",
               "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
               "versions": {m.__name__: m.__version__ for m in (trl, transformers, peft, torch, accelerate, datasets)},
               "settings": {**settings, "prompts": prompts, "lora": "r=32 alpha=64 7 projections",
                            "model": "tiny" if a.tiny else "qwen3-0.6b-random", "beta": cfg.beta,
                            "loss_type": cfg.loss_type, "generation_batch_size": cfg.generation_batch_size},
               "open_s": round(marks["opened"], 2), "first_step_s": round(steps[0], 2) if steps else None,
               "steps_s": [round(s, 2) for s in steps],
               "step_p50_s": round(statistics.median(steps[1:]), 2) if len(steps) > 1 else None,
               "tokens_per_step_max": prompts * gens * new,
               "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2) if torch.cuda.is_available() else None,
               **extra}
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(a.out).with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(a.out)
        return out

    def heartbeat() -> None:
        while True:
            time.sleep(30)
            now = time.perf_counter()
            since = now - (marks["last"] or now)
            print(f"[{now - T0:7.1f}s] step {len(steps) + 1} running for {since:.0f} s", flush=True)
            if now - T0 > a.time_limit:
                print(f"[{now - T0:7.1f}s] past --time-limit {a.time_limit:.0f} s in step {len(steps) + 1}: "
                      f"stopping; the steps so far are in {a.out}", flush=True)
                write(stopped_in_step=len(steps) + 1, stopped_after_s=round(now - T0, 1))
                os._exit(3)

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            marks["begin"] = marks["last"] = time.perf_counter()
            print(f"[{marks['begin'] - T0:7.1f}s] train begin", flush=True)

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            steps.append(now - marks["last"])
            marks["last"] = now
            print(f"[{now - T0:7.1f}s] step {state.global_step}: {steps[-1]:.2f} s", flush=True)
            write()
            if len(steps) >= a.steps or now - T0 + steps[-1] > a.time_limit:  # the next would pass the limit
                control.should_training_stop = True
            return control

    trainer = GRPOTrainer(model=model, reward_funcs=strict_reward, args=cfg, train_dataset=ds,
                          processing_class=tok, peft_config=lora, callbacks=[Clock()])
    marks["opened"] = time.perf_counter() - T0
    print(f"[{marks['opened']:7.1f}s] trainer built", flush=True)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    threading.Thread(target=heartbeat, daemon=True).start()
    trainer.train()
    print(json.dumps(write()), flush=True)


if __name__ == "__main__":
    main()
