"""Dataset rows from local .jsonl / .parquet files and from the hub, with bounded memory (no row over
MAX_ROW_BYTES is held) and errors naming the file, the line (or row) and the fix.
"""
from __future__ import annotations

import json
from pathlib import Path

MAX_ROW_BYTES = 1 << 20   # 1 MiB per row: GSM8K rows are < 2 KB; a 50 MB row must not reach the tokenizer
FIELDS = ("question", "answer")
HUB_DATASET = ("openai/gsm8k", "main")


class DataError(ValueError):
    """A dataset file or row is unusable; the message names the file, row and field."""


def read_rows(source: str, split: str) -> list[tuple[str, dict]]:
    """(location, row) pairs: 'FILE line 7' / 'FILE row 7' / 'openai/gsm8k[test] row 7'."""
    if source == "hub":
        return hub_rows(split)
    path = Path(source)
    if not path.is_file():
        raise DataError(f"dataset file {path} does not exist; pass a .jsonl or .parquet file with "
                        f"question/answer fields, 'hub' or 'synthetic'")
    if path.suffix not in (".jsonl", ".parquet"):
        raise DataError(f"dataset file {path}: unsupported suffix {path.suffix!r}; use .jsonl or .parquet")
    _refuse_too_large(path, path.stat().st_size, "is")
    if path.suffix == ".parquet":
        return parquet_rows(path)
    with open(path, "rb") as fh:
        return _kept(str(path), "line", jsonl_rows(path, fh))


def over_half_memory(nbytes: int) -> str | None:
    """'more than half <the machine's memory> (N bytes)' when `nbytes` is (a file read whole is refused), else None."""
    from .machine import machine_memory
    memory, where = machine_memory("cpu")
    return f"more than half {where} ({memory:,} bytes)" if nbytes > memory // 2 else None


def _refuse_too_large(path: Path, nbytes: int, what: str) -> None:
    if over := over_half_memory(nbytes):   # parquet: its text uncompressed
        raise DataError(f"dataset file {path} {what} {nbytes:,} bytes, {over}, and its rows are held in memory for "
                        f"the whole run; use a smaller file (GSM8K's training split is 4 MB)")


def _kept(where: str, unit: str, items) -> list[tuple[str, dict]]:
    """(location, row) for each (number, row) of `items`; rows given as an int (a byte length over MAX_ROW_BYTES)
    are refused together."""
    rows, too_long = [], []
    for number, row in items:
        if isinstance(row, int):
            too_long.append((number, row))
        else:
            rows.append((f"{where} {unit} {number}", row))
    if too_long:
        number, nbytes = too_long[0]
        raise DataError(f"{where}: {len(too_long)} {unit}(s) longer than {MAX_ROW_BYTES:,} bytes (1 MiB), the first "
                        f"is {unit} {number} ({nbytes:,} bytes); GSM8K rows are under 2 KB: remove or shorten those "
                        f"rows")
    return rows


def bounded_lines(fh, limit: int):
    """(line number, bytes), or (line number, length) for a line over `limit` bytes, skipped in pieces."""
    number = 0
    while line := fh.readline(limit + 1):
        number += 1
        if len(line) <= limit or line.endswith(b"\n"):
            yield number, line
            continue
        length = len(line)
        while not line.endswith(b"\n") and (line := fh.readline(limit)):
            length += len(line)
        yield number, length


def jsonl_rows(path: Path, fh):
    """(line number, row object), or (line number, length) for a line over MAX_ROW_BYTES; blank lines skipped."""
    for number, line in bounded_lines(fh, MAX_ROW_BYTES):
        if isinstance(line, int):
            yield number, line
            continue
        if number == 1:
            line = line.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 BOM, as some editors write
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DataError(f"{path} line {number}: not UTF-8 (byte {line[err.start]:#04x} at column "
                            f"{err.start + 1}); save the file as UTF-8") from err
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{path} line {number}: not valid JSON ({err}); fix or remove that line (one "
                            f"JSON object per line)") from err
        if not isinstance(row, dict):
            raise DataError(f"{path} line {number}: a {type(row).__name__}, not a JSON object; write one "
                            f'{{"question": ..., "answer": ...}} object per line')
        yield number, row


def parquet_rows(path: Path) -> list[tuple[str, dict]]:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise DataError(f"{path} is not a readable parquet file ({err}); write it with pandas.DataFrame.to_parquet "
                        f"or use .jsonl") from err
    if missing := [f for f in FIELDS if f not in pf.schema_arrow.names]:
        raise DataError(f"{path}: no column {missing[0]!r}; the columns are {pf.schema_arrow.names}, each row needs "
                        f"'question' and 'answer'")
    for name in FIELDS:
        typ = pf.schema_arrow.field(name).type
        if not (pa.types.is_string(typ) or pa.types.is_large_string(typ)):
            raise DataError(f"{path}: column {name!r} holds {typ}, not text; write it as strings")
    columns = [pf.schema_arrow.get_field_index(name) for name in FIELDS]
    text = sum(pf.metadata.row_group(g).column(c).total_uncompressed_size
               for g in range(pf.metadata.num_row_groups) for c in columns)
    _refuse_too_large(path, text, "holds question and answer columns of")

    def values():   # byte lengths first: a huge value is counted, never turned into a Python string
        for batch in pf.iter_batches(batch_size=1024, columns=list(FIELDS)):
            lengths = pc.add(*(pc.fill_null(pc.binary_length(batch.column(f)), 0) for f in FIELDS))
            for i, nbytes in enumerate(lengths.to_pylist()):
                yield nbytes if nbytes > MAX_ROW_BYTES else {f: batch.column(f)[i].as_py() for f in FIELDS}
    return _kept(str(path), "row", enumerate(values(), 1))


def hub_rows(split: str) -> list[tuple[str, dict]]:
    from .hub import dataset_unavailable
    name, config = HUB_DATASET
    if reason := dataset_unavailable(name):
        raise DataError(f"data.source='hub': {reason}")
    import datasets  # imported here: only the hub path needs it
    try:
        table = datasets.load_dataset(name, config, split=split)
    except ConnectionError as err:  # HF_HUB_OFFLINE=1 and not in the datasets cache
        raise DataError(f"data.source='hub': {name} is not in the datasets cache ({err}); run once with network "
                        f"access (without HF_HUB_OFFLINE) or use a local file such as data/gsm8k_sample.jsonl") from err
    sized = ((row, sum(len(str(row.get(f, "")).encode()) for f in FIELDS)) for row in table)
    return _kept(f"{name}[{split}]", "row", enumerate((row if n <= MAX_ROW_BYTES else n for row, n in sized), 1))
