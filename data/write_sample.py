"""Write data/gsm8k_sample.jsonl: GSM8K-format rows from lorabench's seeded synthetic generator.

    python data/write_sample.py data/gsm8k_sample.jsonl          # --rows N --seed S for other samples

tests/test_data.py checks that the committed file is what this writes, byte for byte."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the checkout, without pip install -e

from lorabench.data import synthetic_problems  # noqa: E402
from lorabench.safedir import SafeDir  # noqa: E402

SAMPLE_ROWS, SAMPLE_SEED = 48, "sample-0"


def sample_jsonl(rows: int = SAMPLE_ROWS, seed: str = SAMPLE_SEED) -> bytes:
    return "".join(json.dumps({"question": p.question, "answer": p.answer}) + "\n"
                   for p in synthetic_problems(rows, seed)).encode()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="e.g. data/gsm8k_sample.jsonl")
    parser.add_argument("--rows", type=int, default=SAMPLE_ROWS)
    parser.add_argument("--seed", default=SAMPLE_SEED)
    args = parser.parse_args(argv)
    path = Path(args.path)
    with SafeDir.open(path.parent) as folder:   # a fsynced temp renamed onto the file
        folder.write_atomic(path.name, sample_jsonl(args.rows, args.seed), mode=0o644)
    print(f"wrote {args.rows} rows to {args.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
