"""Fuzz the KV-event edge: whatever a publisher sends, the event path never raises and counts every skip by reason.

The pipeline under test is the one a router runs per ZMQ message: `ZmqEventSource.handle` (frame split, seq
decode, `WireDecoder`, restart and gap handling) feeding `IndexIngest.apply` on a real `PrefixIndex`. Inputs:
random msgpack values, valid vLLM payloads (map and array events) with one field given a wrong type or an
out-of-range value, truncated encodings of valid payloads, random bytes, wrong frame counts and seq frames of
every width. Properties: nothing raises; no message ends as `internal_error` (a bug caught by the source's last
guard); every message ends in at least one count (an event status or a frame problem), except a valid batch
with no events; skip reasons come from the documented set.

CI runs 10,000 cases in all (half end to end, a quarter for each decoding property); KVROUTER_FUZZ_EXAMPLES
sets that total for longer runs.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrouter.config import KvEventsConfig
from kvrouter.events.ingest import IndexIngest
from kvrouter.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, WireDecoder, encode_seq
from kvrouter.events.zmq_source import ZmqEventSource
from kvrouter.index import PrefixIndex
from kvrouter.typedefs import ReplicaName

EXAMPLES = int(os.environ.get("KVROUTER_FUZZ_EXAMPLES", "10000"))


def fuzz(share: float) -> Any:
    examples = max(1, int(EXAMPLES * share))
    return settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)


BLOCK = 4
FRAME_REASONS = {"bad_frame_count", "bad_seq", "bad_payload", "lost", "bad_rank"}
EVENT_STATUSES = {
    "ok", "restart", "bad_event", "unknown_type", "unknown_parent", "unknown_block", "block_size_mismatch",
    "unsupported_extra_keys", "ignored_group",
}  # fmt: skip

u64 = st.integers(min_value=0, max_value=2**64 - 1)
any_int = st.integers(min_value=-(2**63), max_value=2**64 - 1)
scalars = st.none() | st.booleans() | any_int | st.floats() | st.text(max_size=20) | st.binary(max_size=40)
msgpack_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=8,
)


def stored_map(hashes: list[int], parent: int | None, tokens: list[int]) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "BlockStored", "block_hashes": hashes, "token_ids": tokens, "block_size": BLOCK}
    if parent is not None:
        event["parent_block_hash"] = parent
    return event


@st.composite
def valid_events(draw: st.DrawFn) -> Any:
    kind = draw(st.sampled_from(["stored", "stored_array", "removed", "removed_array", "cleared"]))
    hashes = draw(st.lists(u64, min_size=1, max_size=4))
    if kind.startswith("stored"):
        tokens = draw(st.lists(st.integers(0, 2**31), min_size=BLOCK * len(hashes), max_size=BLOCK * len(hashes)))
        parent = draw(st.none() | u64)
        if kind == "stored":
            return stored_map(hashes, parent, tokens)
        return ["BlockStored", hashes, parent, tokens, BLOCK, None, draw(st.none() | st.sampled_from(["GPU", "CPU"]))]
    if kind == "removed":
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": draw(st.none() | st.text(max_size=8))}
    if kind == "removed_array":
        return ["BlockRemoved", hashes]
    return {"type": "AllBlocksCleared"}


@st.composite
def broken_events(draw: st.DrawFn) -> Any:
    """A valid event with one field (or element) replaced by a value of any type, or a field added or dropped."""
    event = draw(valid_events())
    if isinstance(event, dict):
        keys = sorted(event)
        action = draw(st.sampled_from(["replace", "drop", "add"]))
        if action == "replace":
            event[draw(st.sampled_from(keys))] = draw(msgpack_values)
        elif action == "drop":
            event.pop(draw(st.sampled_from(keys)))
        else:
            event[draw(st.text(max_size=10))] = draw(msgpack_values)
        return event
    position = draw(st.integers(0, len(event)))
    if position == len(event):
        return [*event, draw(msgpack_values)]
    event[position] = draw(msgpack_values)
    return event


events_lists = st.lists(valid_events() | broken_events() | msgpack_values, max_size=5)
payload_values = st.one_of(
    st.tuples(st.floats() | any_int | msgpack_values, events_lists).map(list),
    st.tuples(st.floats(allow_nan=False), events_lists, st.none() | any_int | msgpack_values).map(list),
    msgpack_values,
)


def encode(value: Any) -> bytes:
    return msgspec.msgpack.encode(value)


@st.composite
def payloads(draw: st.DrawFn) -> bytes:
    choice = draw(st.integers(0, 3))
    if choice == 0:
        return draw(st.binary(max_size=200))
    encoded = encode(draw(payload_values))
    if choice == 1 and encoded:
        return encoded[: draw(st.integers(0, len(encoded) - 1))]  # truncated
    return encoded


seq_frames = st.one_of(
    u64.map(encode_seq),
    st.integers(0, 50).map(encode_seq),
    st.binary(max_size=16),
)
frames_lists = st.one_of(
    st.tuples(st.just(b"kv-events"), seq_frames, payloads()).map(list),
    st.tuples(seq_frames, payloads()).map(list),
    st.lists(st.binary(max_size=20), max_size=5),
)


class Harness:
    """One event source feeding one ingest and index, as a router runs them; problems and counts recorded."""

    def __init__(self, context: zmq.asyncio.Context) -> None:
        self.index = PrefixIndex(provisional_ttl_s=0, max_blocks=64)
        self.ingest = IndexIngest(self.index, block_sizes={ReplicaName("r"): BLOCK})
        self.problems: list[tuple[str, str, str]] = []
        config = KvEventsConfig(endpoint="tcp://127.0.0.1:1")
        self.source = ZmqEventSource(
            "r", config, self.ingest.apply, context=context, on_problem=lambda *p: self.problems.append(p)
        )

    def counted(self) -> int:
        return sum(self.ingest.counts.values()) + len(self.problems)


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    event_loop = asyncio.new_event_loop()
    yield event_loop
    event_loop.close()


@pytest.fixture(scope="module")
def harness(loop: asyncio.AbstractEventLoop) -> Iterator[Harness]:
    context = zmq.asyncio.Context()
    context.setsockopt(zmq.LINGER, 0)  # a socket left open must never block term()
    yield Harness(context)
    context.destroy(linger=0)


def _empty_valid_batch(frames: list[bytes]) -> bool:
    """A readable message whose payload holds no events at all: nothing to count."""
    if len(frames) not in (2, 3) or len(frames[-2]) != 8:
        return False
    batch, problems = WireDecoder().decode_payload("r", 0, frames[-1])
    return batch is not None and not batch.events and not problems


@fuzz(0.5)
@given(frames=frames_lists)
def test_any_message_is_applied_or_counted_never_raised(
    frames: list[bytes], harness: Harness, loop: asyncio.AbstractEventLoop
) -> None:
    before = harness.counted()
    loop.run_until_complete(harness.source.handle(frames))
    assert all(reason in FRAME_REASONS or reason in EVENT_STATUSES for _, _, reason in harness.problems), (
        harness.problems[-3:]
    )
    assert all(status in EVENT_STATUSES for (_, _, status) in harness.ingest.counts)
    assert harness.counted() > before or _empty_valid_batch(frames)


@fuzz(0.25)
@given(value=payload_values)
def test_decoding_any_msgpack_value_gives_typed_events_or_named_problems(value: Any) -> None:
    decoder = WireDecoder()
    batch, problems = decoder.decode_payload("r", 7, encode(value))
    if batch is None:
        assert [(p.kind, p.reason) for p in problems] == [("frame", "bad_payload")]
        return
    assert batch.seq == 7 and isinstance(batch.dp_rank, int)
    for event in batch.events:
        assert isinstance(event, BlockStored | BlockRemoved | AllBlocksCleared)
        if not isinstance(event, AllBlocksCleared):
            assert all(isinstance(h, int) and 0 <= h < 2**64 for h in event.engine_hashes)
    for problem in problems:
        assert problem.kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared", "unknown")
        assert problem.reason in ("bad_event", "unknown_type")
    if isinstance(value, list) and len(value) >= 2 and isinstance(value[1], list):
        assert len(batch.events) + len(problems) == len(value[1])


@fuzz(0.25)
@given(events=st.lists(broken_events() | valid_events(), min_size=1, max_size=4))
def test_every_event_of_a_readable_batch_ends_in_exactly_one_count(events: list[Any]) -> None:
    index = PrefixIndex(provisional_ttl_s=0)
    ingest = IndexIngest(index, block_sizes={ReplicaName("r"): BLOCK})
    batch, problems = WireDecoder().decode_payload("r", 0, encode([1.0, events, 0]))
    assert batch is not None
    ingest.apply(batch)
    assert sum(ingest.counts.values()) + len(problems) == len(events)


def test_huge_arrays_and_length_bombs_are_bounded() -> None:
    decoder = WireDecoder()
    # Length headers that promise 4 billion elements but carry none: refused at once, nothing allocated.
    for bomb in (b"\xdd\xff\xff\xff\xff", b"\x93\xcb" + b"\x00" * 8 + b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff"):
        started = time.perf_counter()
        batch, problems = decoder.decode_payload("r", 0, bomb)
        assert batch is None and problems[0].reason == "bad_payload"
        assert time.perf_counter() - started < 0.5
    # Real huge arrays: 200k hashes in one removal, 100k events in one batch. Decoded and applied, in bounded time.
    index = PrefixIndex(provisional_ttl_s=0, max_blocks=10_000)
    ingest = IndexIngest(index, block_sizes={ReplicaName("r"): BLOCK})
    big_removal = {"type": "BlockRemoved", "block_hashes": list(range(200_000))}
    many = [stored_map([n], None, [n, n, n, n]) for n in range(100_000)]
    started = time.perf_counter()
    for events in ([big_removal], many):
        batch, problems = decoder.decode_payload("r", 0, encode([1.0, events, 0]))
        assert batch is not None and problems == []
        ingest.apply(batch)
    assert time.perf_counter() - started < 20
    assert ingest.counts[("r", "BlockRemoved", "unknown_block")] == 1
    assert ingest.counts[("r", "BlockStored", "ok")] == 100_000
    assert len(index) <= 10_000  # the budget held


def test_out_of_range_values_in_valid_shapes_are_counted() -> None:
    """Values msgpack carries but the engine never sends: negative or huge token ids, zero or huge block sizes."""
    index = PrefixIndex(provisional_ttl_s=0)
    ingest = IndexIngest(index, block_sizes={ReplicaName("r"): BLOCK})
    cases = [
        stored_map([1], None, [-1, 0, 0, 0]),
        stored_map([2], None, [2**40, 0, 0, 0]),
        stored_map([3], None, [2**64 - 1, 0, 0, 0]),
        {**stored_map([4], None, []), "block_size": 0},
        {**stored_map([5], None, [1] * 8), "block_size": -4},
        stored_map([6], 2**64 - 1, [1, 2, 3, 4]),
        {"type": "BlockRemoved", "block_hashes": [-(2**63)]},
    ]
    batch, problems = WireDecoder().decode_payload("r", 0, encode([1.0, cases, 0]))
    assert batch is not None
    ingest.apply(batch)
    assert sum(ingest.counts.values()) + len(problems) == len(cases)
    assert ingest.counts[("r", "BlockStored", "ok")] == 0
