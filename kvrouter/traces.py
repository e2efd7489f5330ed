"""The one reader of Mooncake-style JSONL request traces, for the replay (`kvrouter/replay/trace.py`) and the load
generator's trace workload (`kvrouter/loadgen/trace.py`) alike.

A row is a JSON object with `timestamp`, `input_length`, `output_length` (non-negative integers; the timestamp may
be a string of digits, as in the LMBench "GMI" variant, which gives Unix nanoseconds) and `hash_ids` (a list of
integers, one per prefix block). Blank lines are skipped. Any other line stops the read with a `TraceError`
naming the file and line (1-based) and the field. What the numbers mean (milliseconds or nanoseconds, block size,
chaining) is the caller's business; this module only reads them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


class TraceError(ValueError):
    """A trace line cannot be read; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceRow:
    line: int
    """Line number in the file, from 1."""
    timestamp: int
    timestamp_is_text: bool
    """The timestamp was written as a string of digits (GMI's Unix nanoseconds)."""
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_rows(path: str | Path) -> Iterator[TraceRow]:
    """The rows of a trace file, in file order; lazily, so a caller may stop early."""
    source = Path(path)
    with source.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                yield _row(source, number, line)


def _row(path: Path, number: int, line: str) -> TraceRow:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise TraceError(f"{path}:{number}: not JSON: {error.msg}") from None
    except RecursionError:
        raise TraceError(f"{path}:{number}: not JSON: nested too deeply") from None
    if not isinstance(row, dict):
        raise TraceError(f"{path}:{number}: expected a JSON object")
    ids = row.get("hash_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TraceError(f"{path}:{number}: field 'hash_ids' must be a list of integers")
    return TraceRow(
        line=number,
        timestamp=_int_field(path, number, row, "timestamp"),
        timestamp_is_text=isinstance(row.get("timestamp"), str),
        input_length=_int_field(path, number, row, "input_length"),
        output_length=_int_field(path, number, row, "output_length"),
        hash_ids=tuple(ids),
    )


def _int_field(path: Path, number: int, row: dict[str, object], name: str) -> int:
    value = row.get(name)
    if isinstance(value, str) and value.isdigit():
        return int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TraceError(f"{path}:{number}: field {name!r} must be a non-negative integer")
    return value
