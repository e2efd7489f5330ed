"""Hostile KV-event publishers on real ZMQ sockets (127.0.0.0/8 only): made-up DP ranks, oversized messages, and
strangers connecting to a bound socket, against the real `ZmqEventSource` + `IndexIngest` + `PrefixIndex`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvrouter.blocks import chain_keys
from kvrouter.config import KvEventsConfig
from kvrouter.events.ingest import IndexIngest
from kvrouter.events.wire import WireDecoder, encode_seq
from kvrouter.events.zap import PeerAllowList, allowed, parse_networks
from kvrouter.events.zmq_source import ZmqEventSource
from kvrouter.index import PrefixIndex
from kvrouter.typedefs import BlockKey, ReplicaName
from tests.test_events_zmq import TOPIC, free_port

BLOCK = 4
R = ReplicaName("r")


def stored(hashes: list[int], tokens: list[int], rank: int = 0, parent: int | None = None) -> bytes:
    event: dict[str, object] = {"type": "BlockStored", "block_hashes": hashes, "token_ids": tokens, "block_size": BLOCK}
    if parent is not None:
        event["parent_block_hash"] = parent
    return msgspec.msgpack.encode([time.time(), [event], rank])


def keys_of(tokens: list[int]) -> list[BlockKey]:
    return chain_keys(tokens, BLOCK, seed=0)


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    ctx.setsockopt(zmq.LINGER, 0)
    yield ctx
    ctx.destroy(linger=0)


class Pipeline:
    """The router's embedded event path for one replica, counting like the app does."""

    def __init__(self, context: zmq.asyncio.Context, config: KvEventsConfig) -> None:
        self.index = PrefixIndex()
        self.problems: list[tuple[str, str]] = []
        self.ingest = IndexIngest(self.index, block_sizes={R: BLOCK})
        self.source = ZmqEventSource(
            R,
            config,
            self.ingest.apply,
            context=context,
            on_problem=lambda _r, kind, reason: self.problems.append((kind, reason)),
            data_parallel_size=config.data_parallel_size,
            replay_timeout_s=0.3,
        )

    def prefix(self, tokens: list[int]) -> int:
        match = self.index.longest_prefixes(keys_of(tokens), time.monotonic()).get(R)
        return 0 if match is None else match.blocks


# ---- ranks outside the configured DP size -------------------------------------------------------------------


async def test_ranks_outside_the_dp_size_are_refused_and_counted_not_indexed(context: zmq.asyncio.Context) -> None:
    """Finding: rank -1 landed in the provisional slot and thousands of ranks widened the table (every completion
    a 500, memory 10x). Now a rank outside [0, data_parallel_size) is skipped as `bad_rank` before any table sees
    it, and the honest rank's blocks still count."""
    config = KvEventsConfig(endpoint="tcp://127.0.0.1:1", data_parallel_size=2)
    pipeline = Pipeline(context, config)
    honest = list(range(100, 108))
    await pipeline.source.handle([TOPIC, encode_seq(0), stored([1, 2], honest, rank=1)])
    before = pipeline.index.table_bytes()
    bad_ranks = [-1, 2, 3, 2**31, -(2**40), *range(10, 3010)]
    for seq, rank in enumerate(bad_ranks, start=1):
        tokens = [seq % 1000 + 7, 1, 2, 3]
        await pipeline.source.handle([TOPIC, encode_seq(seq), stored([10_000 + seq], tokens, rank=rank)])
    assert pipeline.problems.count(("frame", "bad_rank")) == len(bad_ranks)
    assert pipeline.prefix(honest) == 2
    assert pipeline.index.replicas() == {R}
    assert len(pipeline.index._sources) == 1  # one honest source, no table widened
    assert pipeline.index.table_bytes() == before
    assert set(pipeline.source.tracker.last) == {1}  # no seq history kept per made-up rank


# ---- oversized messages -------------------------------------------------------------------------------------


async def test_an_oversized_message_is_skipped_counted_and_shows_as_a_loss(
    context: zmq.asyncio.Context,
) -> None:
    """Finding: one 64 MB event message blocked the event loop for 2.9 s. Now a message over `max_message_bytes`
    is skipped undecoded and counted (`oversized`); the seq gap it leaves is asked from the replay socket, whose
    copy is refused too, so it is counted lost and the rank cleared; the loop never stalls and the events after it
    are indexed."""
    pub_port, replay_port = free_port(), free_port()
    config = KvEventsConfig(
        endpoint=f"tcp://127.0.0.1:{pub_port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        max_message_bytes=64 * 1024,
    )
    pipeline = Pipeline(context, config)
    pub = context.socket(zmq.PUB)
    pub.bind(config.endpoint)
    router = context.socket(zmq.ROUTER)
    router.bind(config.replay_endpoint or "")
    buffer: dict[int, bytes] = {}

    async def serve_replay() -> None:
        while True:
            identity, _empty, start = await router.recv_multipart()
            for seq in sorted(s for s in buffer if s >= int.from_bytes(start, "big")):
                await router.send_multipart([identity, b"", TOPIC, encode_seq(seq), buffer[seq]])
            await router.send_multipart([identity, b"", b"", encode_seq(-1), b""])

    replay_task = asyncio.create_task(serve_replay())
    task = asyncio.create_task(pipeline.source.run())
    stalls: list[float] = []

    async def watch_loop() -> None:
        while True:
            started = time.perf_counter()
            await asyncio.sleep(0.005)
            stalls.append(time.perf_counter() - started - 0.005)

    watcher = asyncio.create_task(watch_loop())
    try:
        first = [1, 2, 3, 4]
        huge_tokens = list(range(300_000))  # ~1 MB of msgpack: 16x the cap
        last = [9, 8, 7, 6]

        async def publish(seq: int, data: bytes) -> None:
            buffer[seq] = data
            await pub.send_multipart([TOPIC, encode_seq(seq), data])

        seq = 0
        for seq in range(100):  # a SUB misses what is published before its subscription arrives
            await publish(seq, stored([1], first))
            await asyncio.sleep(0.05)
            if pipeline.prefix(first) == 1:
                break
        assert pipeline.prefix(first) == 1
        huge = seq + 1
        await publish(huge, stored(list(range(1000, 1000 + 75_000)), huge_tokens))
        for seq in range(huge + 1, huge + 100):  # the next seq shows the gap; the replay cannot give it either
            await publish(seq, stored([seq], last))
            if pipeline.prefix(last) == 1:
                break
            await asyncio.sleep(0.05)
        assert pipeline.prefix(last) == 1
        assert ("frame", "oversized") in pipeline.problems  # the replayed copy: the DEALER's MAXMSGSIZE drops it
        assert ("frame", "lost") in pipeline.problems
        assert pipeline.prefix(first) == 0  # the rank was cleared: what the lost message did is unknown
        print(f"\nlongest event-loop stall while refusing a 1 MB message: {max(stalls) * 1000:.1f} ms")
        assert max(stalls) < 0.5
    finally:
        for t in (watcher, task, replay_task):
            t.cancel()
        await asyncio.gather(watcher, task, replay_task, return_exceptions=True)
        pub.close(linger=0)
        router.close(linger=0)


def test_ingest_stall_at_the_default_cap_is_bounded() -> None:
    """The cap bounds the stall: the worst message the default lets through (real-shaped stores of 16-token
    blocks filling the cap), decoded and indexed in one go, measured here."""
    block = 16
    cap = KvEventsConfig(endpoint="tcp://127.0.0.1:1").max_message_bytes
    events: list[dict[str, object]] = []
    hash_ = 1
    size = 0
    parent: int | None = None
    while True:
        hashes = list(range(hash_, hash_ + 256))
        hash_ += 256
        tokens = [(h * 7919 + i) % 150_000 + 30_000 for h in hashes for i in range(block)]
        event: dict[str, object] = {"type": "BlockStored", "block_hashes": hashes, "token_ids": tokens}
        event["block_size"] = block
        if parent is not None:
            event["parent_block_hash"] = parent
        parent = hashes[-1]
        size += len(msgspec.msgpack.encode(event))
        if size > cap:
            break
        events.append(event)
    data = msgspec.msgpack.encode([1.0, events, 0])
    assert len(data) <= cap
    index = PrefixIndex()
    ingest = IndexIngest(index, block_sizes={R: block})
    started = time.perf_counter()
    batch, problems = WireDecoder().decode_payload(R, 0, data)
    assert batch is not None and not problems
    ingest.apply(batch)
    elapsed = time.perf_counter() - started
    print(f"\n{len(data) / 1e6:.2f} MB message, {index.blocks_of(R)} blocks: decode + ingest {elapsed * 1000:.0f} ms")
    assert index.blocks_of(R) == (hash_ - 257)
    assert elapsed < 2.0  # ~50-60 ms on an idle core; generous for a shared machine


# ---- the allow-list of a bound socket -----------------------------------------------------------------------


def test_allow_list_matching() -> None:
    networks = parse_networks(["127.0.0.2", "10.0.0.0/8", "fd00::/8"])
    assert allowed(networks, "127.0.0.2")
    assert not allowed(networks, "127.0.0.1")
    assert allowed(networks, "10.1.2.3")
    assert allowed(networks, "::ffff:10.1.2.3")
    assert allowed(networks, "fd00::1")
    assert not allowed(networks, "not an address")
    refusals: list[str] = []
    context = zmq.asyncio.Context()  # its own, terminated here (not the process-wide Context.instance())
    try:
        guard = PeerAllowList(context, ["127.0.0.2"], on_refused=refusals.append)
        assert guard.answer([b"1.0", b"7", b"d", b"127.0.0.2", b"", b"NULL"])[2] == b"200"
        assert guard.answer([b"1.0", b"8", b"d", b"127.0.0.1", b"", b"NULL"])[2] == b"400"
        assert guard.answer([b"1.0"])[2] == b"500"
        assert refusals == ["127.0.0.1"]
    finally:
        context.term()


async def test_a_bound_socket_with_an_allow_list_hears_only_allowed_peers(context: zmq.asyncio.Context) -> None:
    """Finding: with `bind: true` any process that connects could publish. With `allow_from: [127.0.0.2]`, a
    publisher connecting from 127.0.0.1 is refused at the ZAP handshake (counted as `peer_refused`) and never
    heard, while one connecting from 127.0.0.2 is."""
    port = free_port()
    config = KvEventsConfig(endpoint=f"tcp://127.0.0.1:{port}", bind=True, allow_from=["127.0.0.2"])
    pipeline = Pipeline(context, config)
    task = asyncio.create_task(pipeline.source.run())
    stranger = context.socket(zmq.PUB)
    friend = context.socket(zmq.PUB)
    try:
        await asyncio.wait_for(pipeline.source.connected.wait(), 5)
        stranger.connect(f"tcp://127.0.0.1:0;127.0.0.1:{port}")  # source address: the stranger's side
        friend.connect(f"tcp://127.0.0.2:0;127.0.0.1:{port}")
        bad, good = [50, 51, 52, 53], [60, 61, 62, 63]
        for seq in range(200):
            await stranger.send_multipart([TOPIC, encode_seq(seq), stored([1000 + seq], bad)])
            await friend.send_multipart([TOPIC, encode_seq(seq), stored([2000 + seq], good)])
            if pipeline.prefix(good) and ("frame", "peer_refused") in pipeline.problems:
                break
            await asyncio.sleep(0.02)
        assert pipeline.prefix(good) == 1
        await asyncio.sleep(0.2)
        assert pipeline.prefix(bad) == 0
        assert ("frame", "peer_refused") in pipeline.problems
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        stranger.close(linger=0)
        friend.close(linger=0)


async def test_without_an_allow_list_a_bound_socket_trusts_its_network(context: zmq.asyncio.Context) -> None:
    """The documented default: bind without `allow_from` hears any peer (here, 127.0.0.1)."""
    port = free_port()
    config = KvEventsConfig(endpoint=f"tcp://127.0.0.1:{port}", bind=True)
    pipeline = Pipeline(context, config)
    task = asyncio.create_task(pipeline.source.run())
    peer = context.socket(zmq.PUB)
    try:
        await asyncio.wait_for(pipeline.source.connected.wait(), 5)
        peer.connect(f"tcp://127.0.0.1:{port}")
        tokens = [5, 6, 7, 8]
        for seq in range(200):
            await peer.send_multipart([TOPIC, encode_seq(seq), stored([3000 + seq], tokens)])
            if pipeline.prefix(tokens):
                break
            await asyncio.sleep(0.02)
        assert pipeline.prefix(tokens) == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        peer.close(linger=0)
