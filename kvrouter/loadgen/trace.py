"""Mooncake trace replay: trace rows -> token-id prompts at the trace's arrival times.

The Mooncake traces (FAST'25) give, per request, an arrival `timestamp` (ms), `input_length`, `output_length`
and `hash_ids`: one id per 512-token block, prefix-chained (equal ids mean an equal prefix). Replay gives each
hash id a fixed block of token ids, drawn deterministically from (seed, hash id) in [vocab_low, vocab_high) so
no special token appears, and builds each prompt from its blocks, the last one cut to the input length. Prompts
go to /v1/completions as token ids with `max_tokens = output_length` and `ignore_eos`, so the engine prefills
and decodes exactly what the trace says.

The replayed slice starts `trace_start_s` into the trace and lasts `duration_s` wall-clock seconds, during which
the trace plays `trace_speedup` times faster than it was recorded; arrivals stay open-loop. The rows are read by
`kvrouter.traces.read_rows`, the one trace reader (the replay's too).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvrouter.loadgen.plan import Body, PlannedRequest, Session, WorkloadParams
from kvrouter.traces import TraceRow, read_rows


@dataclass(slots=True)
class BlockTokens:
    """Hash id -> its fixed block of token ids; a bounded cache, since a slice reuses ids heavily."""

    seed: int
    block_tokens: int
    vocab_low: int
    vocab_high: int
    capacity: int = 65536
    cache: OrderedDict[int, tuple[int, ...]] = field(default_factory=OrderedDict)

    def block(self, hash_id: int) -> tuple[int, ...]:
        cached = self.cache.get(hash_id)
        if cached is not None:
            self.cache.move_to_end(hash_id)
            return cached
        rng = random.Random(f"mooncake:{self.seed}:{hash_id}")
        block = tuple(rng.choices(range(self.vocab_low, self.vocab_high), k=self.block_tokens))
        self.cache[hash_id] = block
        if len(self.cache) > self.capacity:
            self.cache.popitem(last=False)
        return block

    def prompt(self, hash_ids: Sequence[int], input_length: int) -> list[int]:
        tokens: list[int] = []
        for hash_id in hash_ids:
            tokens.extend(self.block(hash_id))
        if input_length > len(tokens):
            # A row longer than its blocks (not seen in the published traces): pad with a row-unique tail.
            tokens.extend(self.block(-len(tokens) - 1)[: input_length - len(tokens)])
        return tokens[:input_length]


def trace_sessions(params: WorkloadParams) -> list[Session]:
    if params.trace is None:
        raise ValueError("no trace file given")
    if params.trace_speedup <= 0:
        raise ValueError("trace_speedup must be positive")
    blocks = BlockTokens(params.seed, params.trace_block_tokens, params.vocab_low, params.vocab_high)
    start_ms = params.trace_start_s * 1000.0
    end_ms = start_ms + params.duration_s * params.trace_speedup * 1000.0
    sessions: list[Session] = []
    for number, row in enumerate(read_rows(params.trace)):
        if row.timestamp < start_ms:
            continue
        if row.timestamp >= end_ms:
            break
        at = (row.timestamp - start_ms) / 1000.0 / params.trace_speedup
        max_tokens = max(1, row.output_length)

        def make(row: TraceRow = row, max_tokens: int = max_tokens) -> Body:
            return {
                "prompt": blocks.prompt(row.hash_ids, row.input_length),
                "max_tokens": max_tokens,
                "ignore_eos": True,
            }

        request = PlannedRequest("completion", make, "mooncake", max_tokens)
        sessions.append(Session(at, (request,), f"row-{number}"))
    return sessions


def trace_summary(path: Path) -> dict[str, float]:
    """Rows, span and mean lengths of a trace, for choosing a speed-up."""
    rows = 0
    first = last = 0
    tokens_in = tokens_out = 0
    for row in read_rows(path):
        if rows == 0:
            first = row.timestamp
        last = row.timestamp
        rows += 1
        tokens_in += row.input_length
        tokens_out += row.output_length
    span = max(1e-3, (last - first) / 1000.0)
    return {
        "rows": rows,
        "span_s": span,
        "requests_per_s": rows / span,
        "mean_input": tokens_in / max(1, rows),
        "mean_output": tokens_out / max(1, rows),
    }
