"""Bounded ingest under an event flood, over real sockets on 127.0.0.1: a PUB socket publishing faster than a
slow sink applies. The SUB socket queues at most `rcv_hwm` messages, the publisher's own bound drops the excess,
and the drop shows up as a seq gap: counted as lost, the rank cleared and rebuilt, never silent. Also the
`kvrouter_index_blocks` gauge, which reports what the index holds at scrape time."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import AsyncIterator

import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from kvrouter.config import KvEventsConfig, Settings
from kvrouter.events.ingest import IndexIngest
from kvrouter.events.metrics import EventMetrics
from kvrouter.events.wire import AllBlocksCleared, BlockStored, EventBatch, encode_seq
from kvrouter.events.zmq_source import ZmqEventSource
from kvrouter.index import PrefixIndex
from kvrouter.typedefs import BlockKey, EngineBlockHash, ReplicaName, Tier
from tests.test_events_zmq import free_port, wait_for

TOPIC = b"kv-events"
BLOCK = 16
BLOCKS_PER_MESSAGE = 256
R = ReplicaName("r")


def message(seq: int) -> bytes:
    """One engine step: a new chain of BLOCKS_PER_MESSAGE blocks (~14 KB), engine hashes unique to the seq."""
    hashes = [seq * 1000 + n for n in range(BLOCKS_PER_MESSAGE)]
    tokens = [(seq * 7919 + n) % 60_000 + 1000 for n in range(BLOCKS_PER_MESSAGE * BLOCK)]
    event = {"type": "BlockStored", "block_hashes": hashes, "token_ids": tokens, "block_size": BLOCK}
    return msgspec.msgpack.encode([1.0, [event], 0])


class Publisher:
    """An engine's publisher in a thread: an XPUB socket (a PUB that sees subscriptions, so nothing is sent before
    the source subscribed) with a small send queue; what the queue cannot take is dropped, as vLLM's PUB does."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.commands: queue.Queue[list[int] | None] = queue.Queue()
        self.sent = threading.Event()
        self.subscribed = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        context = zmq.Context()
        context.setsockopt(zmq.LINGER, 0)  # a socket left open must never block term()
        pub = context.socket(zmq.XPUB)
        pub.setsockopt(zmq.SNDHWM, 16)
        pub.setsockopt(zmq.SNDBUF, 64 * 1024)
        pub.connect(self.endpoint)
        if pub.poll(5000):
            pub.recv()
            self.subscribed.set()
        while (seqs := self.commands.get()) is not None:
            frames = [[TOPIC, encode_seq(seq), message(seq)] for seq in seqs]  # encoded first: a burst
            for parts in frames:
                pub.send_multipart(parts)
            self.sent.set()
        pub.close(linger=0)
        context.term()

    async def publish(self, seqs: list[int]) -> None:
        self.sent.clear()
        self.commands.put(seqs)
        assert await asyncio.get_running_loop().run_in_executor(None, self.sent.wait, 30)

    def close(self) -> None:
        self.commands.put(None)
        self.thread.join(10)


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    ctx.setsockopt(zmq.LINGER, 0)  # a socket left open must never block term()
    yield ctx
    ctx.destroy(linger=0)


async def test_a_flood_past_the_receive_bound_is_lost_counted_and_the_index_rebuilt(
    context: zmq.asyncio.Context,
) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    index = PrefixIndex()
    ingest = IndexIngest(index, block_sizes={R: BLOCK})
    delivered: list[EventBatch] = []
    problems: list[tuple[str, str, str]] = []

    async def slow_sink(batch: EventBatch) -> None:
        await asyncio.sleep(0.003)  # a router busy elsewhere: a few hundred messages/s at best
        ingest.apply(batch)
        delivered.append(batch)

    # The source binds and the engine connects (vLLM's `bind` mode).
    config = KvEventsConfig(endpoint=endpoint, topic="kv-events", bind=True)
    source = ZmqEventSource(
        "r", config, slow_sink, context=context, on_problem=lambda *p: problems.append(p), rcv_hwm=8
    )
    task = asyncio.create_task(source.run())
    await asyncio.wait_for(source.connected.wait(), 5)
    publisher = Publisher(endpoint)
    count = 2000
    try:
        assert await asyncio.get_running_loop().run_in_executor(None, publisher.subscribed.wait, 5)
        await publisher.publish([0])
        await wait_for(lambda: len(delivered) == 1)
        await publisher.publish(list(range(1, count + 1)))  # ~28 MB at once
        # Drained when nothing more arrives; then one more message accounts for the flood's tail.
        settled = -1
        while settled != len(delivered):
            settled = len(delivered)
            await asyncio.sleep(0.3)
        tail = count + 5
        await publisher.publish([tail])
        await wait_for(lambda: source.tracker.last.get(0) == tail)
    finally:
        publisher.close()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    stored = {b.seq for b in delivered if isinstance(b.events[0], BlockStored)}
    assert len(stored & set(range(1, count + 1))) < count, "the sink kept up: the flood never overflowed the queues"
    # Every seq is accounted for: delivered, or counted as lost (no replay socket here); never silent.
    assert source.lost == tail + 1 - len(stored)
    assert ("r", "frame", "lost") in problems
    assert source.lost_clears >= 1 and ingest.counts[("r", "AllBlocksCleared", "ok")] == source.lost_clears

    # The index is what the engine's messages after the last clear say, nothing older.
    last_clear = max(i for i, b in enumerate(delivered) if isinstance(b.events[0], AllBlocksCleared))
    expected: set[int] = set()
    for batch in delivered[last_clear + 1 :]:
        event = batch.events[0]
        assert isinstance(event, BlockStored)
        expected.update(event.engine_hashes)
    assert index.held_counts() == {R: len(expected)} == index.block_counts()
    assert all(index.key_of(R, EngineBlockHash(h)) is not None for h in expected)
    assert all(index.key_of(R, EngineBlockHash(h)) is None for h in range(BLOCKS_PER_MESSAGE))  # seq 0, cleared


def test_the_receive_bound_is_a_setting() -> None:
    assert Settings().events_rcv_hwm == 1000
    assert Settings(events_rcv_hwm=50).events_rcv_hwm == 50
    with pytest.raises(ValueError):
        Settings(events_rcv_hwm=0)


def test_index_blocks_reports_what_the_index_holds_not_stale_mappings() -> None:
    budget = 1000
    index = PrefixIndex(max_blocks=budget)
    for n in range(300):  # 3,000 one-chain stores of 10 blocks over a 1,000-key budget
        keys = [BlockKey(n * 10 + k) for k in range(10)]
        index.store_keys(R, [EngineBlockHash(k) for k in keys], keys)
    # Evicted keys' engine-hash mappings wait for the sweep: the old count overstates the index.
    assert index.blocks_of(R) > budget
    assert index.held_counts() == {R: budget}
    # A second rank's copy of a block is its own (as `block_counts` has it); a block in two tiers is one block.
    index.store_keys(R, [EngineBlockHash(2999)], [BlockKey(2999)], dp_rank=1)
    assert index.held_counts()[R] == budget + 1
    tiers = PrefixIndex()
    tiers.store_keys(R, [EngineBlockHash(1), EngineBlockHash(2)], [BlockKey(1), BlockKey(2)])
    tiers.store_keys(R, [EngineBlockHash(2), EngineBlockHash(3)], [BlockKey(2), BlockKey(3)], Tier.CPU)
    tiers.add_provisional(R, [BlockKey(9)], now=0.0)
    assert tiers.held_counts() == {R: 3} == tiers.block_counts()
    registry = CollectorRegistry(auto_describe=True)
    metrics = EventMetrics(registry)
    followed = {R, ReplicaName("quiet")}
    metrics.read_index_blocks(lambda: {name: index.held_counts().get(name, 0) for name in followed})
    assert registry.get_sample_value("kvrouter_index_blocks", {"replica": "r"}) == budget + 1
    assert registry.get_sample_value("kvrouter_index_blocks", {"replica": "quiet"}) == 0
    index.clear(R)
    followed.discard(ReplicaName("quiet"))
    assert registry.get_sample_value("kvrouter_index_blocks", {"replica": "r"}) == 0
    assert registry.get_sample_value("kvrouter_index_blocks", {"replica": "quiet"}) is None


def test_index_blocks_without_a_reader_is_a_plain_gauge() -> None:
    """The relay sets the gauge from its book per batch."""
    registry = CollectorRegistry(auto_describe=True)
    metrics = EventMetrics(registry)
    metrics.index_blocks.labels("r").set(7)
    assert registry.get_sample_value("kvrouter_index_blocks", {"replica": "r"}) == 7
    metrics.forget("r")
    assert registry.get_sample_value("kvrouter_index_blocks", {"replica": "r"}) is None
