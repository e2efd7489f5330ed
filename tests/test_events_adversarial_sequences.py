"""Fuzz event SEQUENCES (not single frames) through the real `ZmqEventSource.handle` + `IndexIngest` +
`PrefixIndex`, on the compiled and the pure tables side by side.

Each case is a short run of messages a hostile or broken publisher could send: seqs that repeat, jump and go
back, ranks inside and outside the configured DP size (negative, huge), stores that reuse engine hashes with
other tokens, parents never stored or removed, removals of unknown blocks and of a chain's middle, clears in
mid-chain, stores after clears, oversized payloads, provisional marks and lookups in between. Properties after
every message: nothing raises; nothing ends as `internal_error`; every status and reason is a documented one; no
table bit is left without a source (an orphaned bit); the two backends answer every lookup and count alike; the
sources never outnumber the configured ranks; the tables stay under a byte bound for the bounded input.

Cases come from a seeded `random.Random` (cheap: ~1 ms each); CI runs 10,000, KVROUTER_FUZZ_SEQUENCES sets the
count and KVROUTER_FUZZ_SEED the seed for longer runs.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Iterator

import msgspec
import pytest
import zmq.asyncio

from kvrouter.blocks import chain_keys
from kvrouter.blocktable import pure_backend
from kvrouter.config import KvEventsConfig
from kvrouter.events.ingest import IndexIngest
from kvrouter.events.wire import encode_seq
from kvrouter.events.zmq_source import ZmqEventSource
from kvrouter.index import PrefixIndex
from kvrouter.typedefs import ReplicaName

CASES = int(os.environ.get("KVROUTER_FUZZ_SEQUENCES", "10000"))
SEED = int(os.environ.get("KVROUTER_FUZZ_SEED", "15"))
BLOCK = 4
DP = 2
R = ReplicaName("r")
REASONS = {"bad_frame_count", "bad_seq", "bad_payload", "lost", "bad_rank", "oversized"}
STATUSES = {
    "ok", "restart", "bad_event", "unknown_type", "unknown_parent", "unknown_block", "block_size_mismatch",
    "unsupported_extra_keys", "ignored_group",
}  # fmt: skip
PROMPTS = [[p, p + 1, p + 2, p + 3, 9, 9, 9, 9, p, 0, 0, 0] for p in range(4)]
BYTE_BOUND = 256 * 1024


class Pipeline:
    def __init__(self, context: zmq.asyncio.Context, *, pure: bool) -> None:
        self.index = PrefixIndex(provisional_ttl_s=5.0, backend=pure_backend() if pure else None)
        self.ingest = IndexIngest(self.index, block_sizes={R: BLOCK})
        self.problems: list[str] = []
        config = KvEventsConfig(endpoint="tcp://127.0.0.1:1", data_parallel_size=DP, max_message_bytes=2048)
        self.source = ZmqEventSource(
            R, config, self.ingest.apply, context=context, data_parallel_size=DP,
            on_problem=lambda _r, _k, reason: self.problems.append(reason),
        )  # fmt: skip


def event(rng: random.Random) -> object:
    kind = rng.random()
    hashes = [rng.randrange(8) for _ in range(rng.randrange(1, 4))]
    if kind < 0.6:
        prompt = rng.choice(PROMPTS)
        start = rng.randrange(3) * BLOCK
        tokens = (prompt * 2)[start : start + BLOCK * len(hashes)]
        if rng.random() < 0.1:
            tokens = tokens[:-1]  # a short store
        stored: dict[str, object] = {"type": "BlockStored", "block_hashes": hashes, "token_ids": tokens}
        stored["block_size"] = BLOCK
        if rng.random() < 0.5:
            stored["parent_block_hash"] = rng.randrange(10)  # stored, removed, or never seen
        if rng.random() < 0.2:
            stored["medium"] = "CPU"
        return stored
    if kind < 0.9:
        removed: dict[str, object] = {"type": "BlockRemoved", "block_hashes": hashes}
        if rng.random() < 0.2:
            removed["medium"] = "CPU"
        return removed
    return {"type": "AllBlocksCleared"}


def message(rng: random.Random, seq: int) -> list[bytes]:
    rank = rng.choice([0, 0, 1, 1, -1, 2, 7, 2**31, -(2**40)])
    events = [event(rng) for _ in range(rng.randrange(1, 4))]
    payload = msgspec.msgpack.encode([1.0, events, rank])
    if rng.random() < 0.03:
        payload += msgspec.msgpack.encode(list(range(1000)))  # trailing bulk: past the 2 KB cap
    return [b"kv-events", encode_seq(seq), payload]


def next_seq(rng: random.Random, seq: int) -> int:
    roll = rng.random()
    if roll < 0.7:
        return seq + 1
    if roll < 0.8:
        return seq + rng.randrange(2, 5)  # a gap
    if roll < 0.9:
        return max(0, seq - rng.randrange(0, 3))  # a repeat or a restart
    return rng.randrange(0, 2**64)


def check(pipelines: list[Pipeline], now: float) -> None:
    answers = []
    for p in pipelines:
        assert "internal_error" not in p.problems
        assert set(p.problems) <= REASONS, p.problems
        assert {status for (_, _, status) in p.ingest.counts} <= STATUSES
        index = p.index
        per_bit, _ = index.backend.held_counts(index._tiers, ())
        assert set(per_bit) <= set(index._by_bit), "a table bit no source owns"
        assert all(0 <= rank < DP or rank == -1 for (_, rank) in index._sources)
        assert index.table_bytes() < BYTE_BOUND
        lookups = [
            {r: (m.blocks, m.gpu_blocks) for r, m in index.longest_prefixes(chain_keys(t, BLOCK, seed=0), now).items()}
            for t in PROMPTS
        ]
        assert index.orphaned_bits == 0
        answers.append((lookups, index.held_counts(), index.block_counts(), dict(p.ingest.counts)))
    assert answers[0] == answers[1], "the compiled and the pure tables disagree"


@pytest.fixture(scope="module")
def context() -> Iterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    ctx.setsockopt(zmq.LINGER, 0)
    yield ctx
    ctx.destroy(linger=0)


def test_hostile_event_sequences_never_corrupt_the_index(context: zmq.asyncio.Context) -> None:
    rng = random.Random(SEED)
    loop = asyncio.new_event_loop()
    messages = 0
    try:
        for _case in range(CASES):
            pipelines = [Pipeline(context, pure=False), Pipeline(context, pure=True)]
            seq = rng.randrange(3)
            now = 0.0
            for _step in range(rng.randrange(1, 7)):
                frames = message(rng, seq)
                if rng.random() < 0.2:
                    keys = chain_keys(rng.choice(PROMPTS), BLOCK, seed=0)[: rng.randrange(1, 4)]
                    for p in pipelines:
                        p.index.add_provisional(R, keys, now)
                for p in pipelines:
                    loop.run_until_complete(p.source.handle(list(frames)))
                messages += 1
                now += rng.choice([0.0, 1.0, 6.0])
                check(pipelines, now)
                seq = next_seq(rng, seq)
    finally:
        loop.close()
    print(f"\n{CASES} sequences, {messages} messages: no failure")
