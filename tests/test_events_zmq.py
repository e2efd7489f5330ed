"""The ZMQ source against real sockets on 127.0.0.1: a PUB socket speaking vLLM's wire format, and a ROUTER
socket answering replay requests the way vLLM's replay socket does."""

from __future__ import annotations

import asyncio
import contextlib
import socket as pysocket
from collections.abc import AsyncIterator, Callable

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvrouter.config import KvEventsConfig
from kvrouter.events.wire import AllBlocksCleared, BlockStored, EventBatch, encode_seq
from kvrouter.events.zmq_source import SequenceTracker, ZmqEventSource, offset_endpoint

TOPIC = b"kv-events"


def free_port() -> int:
    with pysocket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def payload(hashes: list[int], rank: int = 0, *, old_format: bool = False) -> bytes:
    tokens = list(range(len(hashes) * 4))
    if old_format:
        event: object = ["BlockStored", hashes, None, tokens, 4, None, "GPU"]
    else:
        event = {"type": "BlockStored", "block_hashes": hashes, "token_ids": tokens, "block_size": 4}
    return msgspec.msgpack.encode([1.0, [event], rank])


class FakeEngine:
    """vLLM's publisher side: PUB for live batches, ROUTER for replay, with a buffer of what it sent."""

    def __init__(
        self, context: zmq.asyncio.Context, *, bind_pub: bool, pub: str, replay: str, topic_frame: bool = True
    ) -> None:
        self.pub = context.socket(zmq.PUB)
        self.router = context.socket(zmq.ROUTER)
        try:
            if bind_pub:
                self.pub.bind(pub)
            else:
                self.pub.connect(pub)
            self.router.bind(replay)
        except zmq.ZMQError:  # a port taken meanwhile: the caller may try others, these are closed now
            self.pub.close(linger=0)
            self.router.close(linger=0)
            raise
        self.buffer: dict[int, bytes] = {}
        self.topic_frame = topic_frame
        self.replay_requests: list[int] = []
        self._task = asyncio.create_task(self._serve_replay())

    async def publish(self, seq: int, data: bytes, *, send: bool = True) -> None:
        self.buffer[seq] = data
        if send:
            await self.pub.send_multipart([TOPIC, encode_seq(seq), data])

    async def _serve_replay(self) -> None:
        while True:
            identity, _empty, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replay_requests.append(first)
            for seq in sorted(s for s in self.buffer if s >= first):
                head = [identity, b""] + ([TOPIC] if self.topic_frame else [])
                await self.router.send_multipart([*head, encode_seq(seq), self.buffer[seq]])
            tail = [identity, b""] + ([b""] if self.topic_frame else [])
            await self.router.send_multipart([*tail, encode_seq(-1), b""])

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.pub.close(linger=0)
        self.router.close(linger=0)


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    ctx.setsockopt(zmq.LINGER, 0)  # a socket left open must never block term()
    yield ctx
    ctx.destroy(linger=0)


async def wait_for(predicate: Callable[[], bool], within_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)


async def start(source: ZmqEventSource) -> asyncio.Task[None]:
    task = asyncio.create_task(source.run())
    await asyncio.wait_for(source.connected.wait(), 5)
    return task


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def warm_up(engine: FakeEngine, source: ZmqEventSource, rank: int = 0) -> int:
    """PUB/SUB drops messages until the subscription has propagated: publish seq 0, 1, ... until the source has
    delivered one, then wait for the stragglers; returns the next seq to publish."""
    for seq in range(250):
        await engine.publish(seq, payload([1000 + seq], rank))
        await asyncio.sleep(0.02)
        if rank in source.tracker.last:
            await wait_for(lambda last=seq: source.tracker.last.get(rank) == last)  # type: ignore[misc]
            return seq + 1
    raise AssertionError("subscriber never received anything")


@pytest.mark.parametrize(("bind_source", "topic_frame"), [(False, True), (True, False)])
async def test_gap_replay_restart_and_malformed(
    context: zmq.asyncio.Context, bind_source: bool, topic_frame: bool
) -> None:
    pub = f"tcp://127.0.0.1:{free_port()}"
    replay = f"tcp://127.0.0.1:{free_port()}"
    seen: list[EventBatch] = []
    problems: list[tuple[str, str, str]] = []
    config = KvEventsConfig(endpoint=pub, replay_endpoint=replay, topic="kv-events", bind=bind_source)
    source = ZmqEventSource(
        "r1", config, seen.append, context=context, on_problem=lambda *p: problems.append(p), replay_timeout_s=2.0
    )
    if bind_source:
        task = await start(source)
        engine = FakeEngine(context, bind_pub=False, pub=pub, replay=replay, topic_frame=topic_frame)
    else:
        engine = FakeEngine(context, bind_pub=True, pub=pub, replay=replay, topic_frame=topic_frame)
        task = await start(source)
    try:
        n = await warm_up(engine, source)
        seen.clear()
        requests_before = len(engine.replay_requests)
        replayed_before = source.replayed
        # seq n and n+1 are "lost" on the way; n+2 reveals the gap and the source asks the replay socket.
        await engine.publish(n, payload([11], old_format=True), send=False)
        await engine.publish(n + 1, payload([12]), send=False)
        await engine.publish(n + 2, payload([13]))
        await wait_for(lambda: len(seen) >= 3)
        assert [b.seq for b in seen] == [n, n + 1, n + 2]
        assert [b.events[0].engine_hashes for b in seen if isinstance(b.events[0], BlockStored)] == [[11], [12], [13]]
        assert engine.replay_requests[requests_before:] == [n]
        assert source.replayed - replayed_before == 2 and source.lost == 0

        # Garbage is counted and skipped; the stream carries on.
        await engine.pub.send_multipart([TOPIC, b"short", b"x"])
        await engine.pub.send_multipart([TOPIC, encode_seq(4), b"\xc1not msgpack"])
        await engine.pub.send_multipart([TOPIC])
        await wait_for(lambda: len(problems) >= 3)
        assert ("r1", "frame", "bad_seq") in problems and ("r1", "frame", "bad_payload") in problems

        # The engine restarts: its seq starts over at 0, so the replica's blocks must go.
        seen.clear()
        engine.buffer.clear()
        await engine.publish(0, payload([20]))
        await wait_for(lambda: len(seen) >= 2)
        assert isinstance(seen[0].events[0], AllBlocksCleared) and seen[0].events[0].restart
        assert seen[1].seq == 0 and source.restarts == 1
    finally:
        await stop(task)
        await engine.close()


async def test_data_parallel_ranks_are_tracked_apart_and_async_sinks_are_awaited(
    context: zmq.asyncio.Context,
) -> None:
    base = free_port()
    engines: list[FakeEngine] = []
    while len(engines) < 2:
        r = len(engines)
        try:
            engines.append(
                FakeEngine(
                    context, bind_pub=True, pub=f"tcp://127.0.0.1:{base + r}", replay=f"tcp://127.0.0.1:{base + 10 + r}"
                )
            )
        except zmq.ZMQError:
            for engine in engines:  # rank 0's sockets and replay task, when rank 1's ports were taken
                await engine.close()
            engines, base = [], free_port()
    seen: list[EventBatch] = []

    async def sink(batch: EventBatch) -> None:
        await asyncio.sleep(0)
        seen.append(batch)

    config = KvEventsConfig(endpoint=f"tcp://127.0.0.1:{base}", replay_endpoint=f"tcp://127.0.0.1:{base + 10}")
    source = ZmqEventSource("dp", config, sink, context=context, data_parallel_size=2, replay_timeout_s=2.0)
    task = await start(source)
    try:
        n0 = await warm_up(engines[0], source, 0)
        n1 = await warm_up(engines[1], source, 1)
        requests = [list(e.replay_requests) for e in engines]
        # Rank 1 skips ahead: only rank 1's replay socket (port + 1) is asked.
        await engines[1].publish(n1, payload([3], rank=1), send=False)
        await engines[1].publish(n1 + 1, payload([4], rank=1))
        await wait_for(lambda: any(b.dp_rank == 1 and b.seq == n1 + 1 for b in seen))
        assert engines[1].replay_requests == [*requests[1], n1]
        assert engines[0].replay_requests == requests[0]
        assert source.tracker.last == {0: n0 - 1, 1: n1 + 1}
        assert {b.dp_rank for b in seen} == {0, 1}
        # The server restarts: rank 0 speaks first, and both ranks' blocks are dropped at once.
        seen.clear()
        await engines[0].publish(0, payload([7], rank=0))
        await wait_for(lambda: len(seen) >= 3)
        cleared = [b.dp_rank for b in seen if isinstance(b.events[0], AllBlocksCleared)]
        assert sorted(cleared) == [0, 1] and seen[-1].seq == 0 and source.tracker.last == {0: 0}
    finally:
        await stop(task)
        for engine in engines:
            await engine.close()


async def test_a_gap_the_engine_no_longer_buffers_is_counted_lost(context: zmq.asyncio.Context) -> None:
    pub = f"tcp://127.0.0.1:{free_port()}"
    seen: list[EventBatch] = []
    problems: list[tuple[str, str, str]] = []
    config = KvEventsConfig(endpoint=pub, replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
    engine = FakeEngine(context, bind_pub=True, pub=pub, replay=config.replay_endpoint or "")
    source = ZmqEventSource("r", config, seen.append, context=context, on_problem=lambda *p: problems.append(p))
    task = await start(source)
    try:
        n = await warm_up(engine, source)
        engine.buffer.clear()
        lost_before = source.lost
        await engine.publish(n + 4, payload([5]))
        await wait_for(lambda: any(b.seq == n + 4 for b in seen))
        assert source.lost - lost_before == 4 and ("r", "frame", "lost") in problems
    finally:
        await stop(task)
        await engine.close()


def test_sequence_tracker_and_dp_endpoints() -> None:
    tracker = SequenceTracker()
    assert tracker.classify(0, 7) == "first"
    tracker.delivered(0, 7)
    assert [tracker.classify(0, s) for s in (8, 10, 7, 3)] == ["next", "gap", "restart", "restart"]
    assert tracker.classify(1, 0) == "first"
    assert offset_endpoint("tcp://127.0.0.1:5590", 1) == "tcp://127.0.0.1:5591"
    assert offset_endpoint("tcp://[::1]:5590", 2) == "tcp://[::1]:5592"
    assert offset_endpoint("ipc:///tmp/kv.ipc", 1) == "ipc:///tmp/kv.ipc"
