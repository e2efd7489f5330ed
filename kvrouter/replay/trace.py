"""Request traces: Mooncake JSONL (FAST'25) and the LMBench "GMI" variant, read into `TraceRequest`s.

Mooncake rows: `timestamp` (ms from the trace start), `input_length`, `output_length`, `hash_ids` (ids of
512-token prefix blocks, already prefix-chained). GMI rows: `timestamp` is absolute Unix nanoseconds (a string),
blocks are 32 tokens, and ids are *not* chained (the same id shows up at different positions), so both formats
are chained here the same way: a block's chain id names the whole prefix up to and including it. The format is
told apart by the timestamp's type and size; `block_tokens` overrides the block size. `speedup` divides the
arrival times.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512
GMI_BLOCK_TOKENS = 32
_NS_THRESHOLD = 10**15
"""A timestamp this large is Unix nanoseconds, not milliseconds from the trace start."""


class TraceError(Exception):
    """A trace line cannot be read; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int
    """Line number from 0."""
    arrival: float
    """Seconds from the trace start, speedup applied."""
    input_length: int
    output_length: int
    chain: tuple[int, ...]
    """Chain id per trace block: equal ids mean equal prefixes up to and including that block."""


@dataclass(frozen=True, slots=True)
class Trace:
    requests: tuple[TraceRequest, ...]
    block_tokens: int
    """Tokens per trace block (512 Mooncake, 32 GMI)."""
    source: str


def _rows(path: Path) -> Iterator[tuple[int, dict[str, object]]]:
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise TraceError(f"{path}:{number + 1}: not JSON: {error.msg}") from None
            if not isinstance(row, dict):
                raise TraceError(f"{path}:{number + 1}: expected a JSON object")
            yield number, row


def _int_field(path: Path, number: int, row: dict[str, object], name: str) -> int:
    value = row.get(name)
    if isinstance(value, str) and value.isdigit():
        return int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TraceError(f"{path}:{number + 1}: field {name!r} must be a non-negative integer")
    return value


def load_trace(
    path: str | Path, *, speedup: float = 1.0, block_tokens: int | None = None, limit: int | None = None
) -> Trace:
    """Read a trace file; `limit` keeps the first N requests."""
    if speedup <= 0:
        raise ValueError("speedup must be positive")
    source = Path(path)
    chain_ids: dict[tuple[int, int], int] = {}
    requests: list[TraceRequest] = []
    first_stamp: int | None = None
    nanoseconds = False
    for number, row in _rows(source):
        if limit is not None and len(requests) >= limit:
            break
        stamp = _int_field(source, number, row, "timestamp")
        if first_stamp is None:
            first_stamp = stamp
            nanoseconds = isinstance(row.get("timestamp"), str) or stamp >= _NS_THRESHOLD
        ids = row.get("hash_ids")
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise TraceError(f"{source}:{number + 1}: field 'hash_ids' must be a list of integers")
        parent = -1
        chain = []
        for block_id in ids:
            link = (parent, block_id)
            chained = chain_ids.get(link)
            if chained is None:
                chained = len(chain_ids)
                chain_ids[link] = chained
            chain.append(chained)
            parent = chained
        seconds = (stamp - first_stamp) / 1e9 if nanoseconds else stamp / 1000.0
        requests.append(
            TraceRequest(
                index=len(requests),
                arrival=seconds / speedup,
                input_length=_int_field(source, number, row, "input_length"),
                output_length=max(1, _int_field(source, number, row, "output_length")),
                chain=tuple(chain),
            )
        )
    if block_tokens is None:
        block_tokens = GMI_BLOCK_TOKENS if nanoseconds else MOONCAKE_BLOCK_TOKENS
    requests.sort(key=lambda request: request.arrival)
    return Trace(tuple(requests), block_tokens, str(source))
