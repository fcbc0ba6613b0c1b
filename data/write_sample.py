"""Write data/gsm8k_sample.jsonl: GSM8K-format rows from lorabench's seeded synthetic generator.

    python data/write_sample.py data/gsm8k_sample.jsonl          # --rows N --seed S for other samples

tests/test_data.py checks that the committed file is what this writes, byte for byte."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the checkout, without pip install -e

from lorabench.data import synthetic_problems  # noqa: E402
from lorabench.safedir import write_new_file  # noqa: E402

SAMPLE_ROWS, SAMPLE_SEED = 48, "sample-0"


def sample_jsonl(rows: int = SAMPLE_ROWS, seed: str = SAMPLE_SEED) -> bytes:
    return "".join(json.dumps({"question": p.question, "answer": p.answer}) + "\n"
                   for p in synthetic_problems(rows, seed)).encode()


def write_whole(path: Path, data: bytes) -> None:
    """The whole file or none: a fsynced temp beside `path`, renamed onto it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write_new_file(tmp, data, mode=0o644)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="e.g. data/gsm8k_sample.jsonl")
    parser.add_argument("--rows", type=int, default=SAMPLE_ROWS)
    parser.add_argument("--seed", default=SAMPLE_SEED)
    args = parser.parse_args(argv)
    write_whole(Path(args.path), sample_jsonl(args.rows, args.seed))
    print(f"wrote {args.rows} rows to {args.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
