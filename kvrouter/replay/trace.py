"""Request traces: Mooncake JSONL (FAST'25) and the LMBench "GMI" variant, read into `TraceRequest`s.

Mooncake rows: `timestamp` (ms from the trace start), `input_length`, `output_length`, `hash_ids` (ids of
512-token prefix blocks, already prefix-chained). GMI rows: `timestamp` is absolute Unix nanoseconds (a string),
blocks are 32 tokens, and ids are *not* chained (the same id shows up at different positions), so both formats
are chained here the same way: a block's chain id names the whole prefix up to and including it. The format is
told apart by the timestamp's type and size; `block_tokens` overrides the block size. `speedup` divides the
arrival times. The lines are read by `kvrouter.traces.read_rows`, the one trace reader (errors name file and line).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

from kvrouter.traces import TraceError, read_rows

MOONCAKE_BLOCK_TOKENS = 512
GMI_BLOCK_TOKENS = 32
_NS_THRESHOLD = 10**15
"""A timestamp this large is Unix nanoseconds, not milliseconds from the trace start."""


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
    for row in itertools.islice(read_rows(source), limit):
        stamp = row.timestamp
        if first_stamp is None:
            first_stamp = stamp
            nanoseconds = row.timestamp_is_text or stamp >= _NS_THRESHOLD
        parent = -1
        chain = []
        for block_id in row.hash_ids:
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
                input_length=row.input_length,
                output_length=max(1, row.output_length),
                chain=tuple(chain),
            )
        )
    if block_tokens is None:
        block_tokens = GMI_BLOCK_TOKENS if nanoseconds else MOONCAKE_BLOCK_TOKENS
    requests.sort(key=lambda request: request.arrival)
    return Trace(tuple(requests), block_tokens, str(source))


def unshared(trace: Trace) -> Trace:
    """The same arrivals and lengths with no prefix shared between requests (every chain id made unique), so
    that routing is decided by load alone."""
    requests = []
    next_id = 0
    for request in trace.requests:
        chain = tuple(range(next_id, next_id + len(request.chain)))
        next_id += len(chain)
        requests.append(
            TraceRequest(request.index, request.arrival, request.input_length, request.output_length, chain)
        )
    return Trace(tuple(requests), trace.block_tokens, trace.source)


def conversations(trace: Trace) -> dict[int, str]:
    """A session key per request, for session hints: requests whose first two chained blocks match belong to one
    conversation (in Mooncake's conversation trace a turn's prompt starts with the history before it, so the turns
    of one chat share their leading blocks; two blocks, not one, so a bare shared system prompt does not merge
    chats). A request of fewer than two blocks has none."""
    return {r.index: f"c{r.chain[0]}.{r.chain[1]}" for r in trace.requests if len(r.chain) >= 2}


__all__ = [
    "GMI_BLOCK_TOKENS",
    "MOONCAKE_BLOCK_TOKENS",
    "Trace",
    "TraceError",
    "TraceRequest",
    "conversations",
    "load_trace",
    "unshared",
]
