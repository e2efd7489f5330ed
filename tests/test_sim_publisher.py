"""The simulator's KV events against real vLLM frames, over real ZMQ sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from kvrouter.events import wire
from kvrouter.sim.engine import SchedulerConfig, VllmEngine
from kvrouter.sim.hashing import prompt_hashes
from kvrouter.sim.model import EngineRequest, KvEvent, StoredBlocks
from kvrouter.sim.profiles import PROFILES
from kvrouter.sim.publisher import END_SEQ, KvEventPublisher, encode_payload
from tests.shared_data import VLLM_CAPTURES, shared

RUNS = VLLM_CAPTURES / "runs"


def real_payloads(run: str) -> list[bytes]:
    return [path.read_bytes() for path in sorted(shared(RUNS / run / "frames").glob("msg_*_f2.bin"))]


def engine_batches() -> list[list[KvEvent]]:
    """Every kind of event the simulator makes: stores (salted, chained, decode-filled), evictions, a reset."""
    engine = VllmEngine(SchedulerConfig(num_blocks=6, block_size=4), PROFILES["cpu-tiny"])
    batches: list[list[KvEvent]] = []

    def drain() -> None:
        while engine.has_work():
            events = engine.step(0.0).events
            if events:
                batches.append(events)

    for index, (salt, length) in enumerate([(None, 9), ("tenant-a", 9), (None, 13), (None, 14)]):
        tokens = [100 + index * 50 + t for t in range(length)]
        request = EngineRequest(
            f"r{index}", length, prompt_hashes(tokens, 4, cache_salt=salt), 4, 0.0,
            token_ids=tokens, cache_salt=salt, output_token_ids=[7, 8, 9, 10],
        )  # fmt: skip
        engine.add(request)
        drain()
    assert engine.reset_prefix_cache()
    batches.append(engine.take_events())
    return batches


def shape(value: Any) -> Any:
    """A value's structure: type names, with lists reduced to the set of their elements' shapes."""
    if isinstance(value, list):
        return ("list", tuple(sorted({repr(shape(v)) for v in value})))
    if isinstance(value, dict):
        return ("map", tuple((k, shape(v)) for k, v in value.items()))
    if value is None:
        return "nil"
    return type(value).__name__


def event_shapes(payloads: list[bytes]) -> dict[str, set[Any]]:
    shapes: dict[str, set[Any]] = {}
    for payload in payloads:
        ts, events, rank = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and isinstance(rank, int)
        for event in events:
            fields = tuple((key, shape(value)) for key, value in event.items())
            shapes.setdefault(event["type"], set()).add(fields)
    return shapes


def keys_only(shapes: set[Any]) -> set[tuple[str, ...]]:
    return {tuple(key for key, _ in fields) for fields in shapes}


def normalised(fields: Any) -> Any:
    """Shapes that real captures show in several variants (null or int parent, salt or not) folded together."""
    loose = {"parent_block_hash", "extra_keys"}
    return tuple((key, "*" if key in loose else value) for key, value in fields)


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    ctx.setsockopt(zmq.LINGER, 0)  # a socket left open must never block term()
    yield ctx
    ctx.destroy(linger=0)


async def published_frames(context: zmq.asyncio.Context, batches: list[list[KvEvent]]) -> list[list[bytes]]:
    publisher = KvEventPublisher(
        context, endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", wall_clock=lambda: 1.5
    )
    publisher.start()
    assert publisher.bound_endpoint is not None
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.bound_endpoint)
    await asyncio.sleep(0.3)  # PUB/SUB join
    try:
        for batch in batches:
            publisher.publish(batch)
        return [await asyncio.wait_for(sub.recv_multipart(), 5) for _ in batches]
    finally:
        sub.close(linger=0)
        await publisher.close()


async def test_sim_frames_have_real_vllm_structure_field_for_field(context: zmq.asyncio.Context) -> None:
    frames = await published_frames(context, engine_batches())
    for seq, (topic, seq_frame, _) in enumerate(frames):
        assert topic == b"kv-events"
        assert seq_frame == seq.to_bytes(8, "big")
    ours = event_shapes([payload for *_, payload in frames])
    real = event_shapes(real_payloads("s1_basic_bs32") + real_payloads("s2_evict_reset_bs128_ipc"))
    assert set(ours) == set(real) == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    for kind in real:
        assert keys_only(ours[kind]) == keys_only(real[kind]), kind
        assert {normalised(f) for f in ours[kind]} == {normalised(f) for f in real[kind]}, kind
    # the variants real vLLM shows are all made: first blocks and chained blocks, salted and not
    stored = [dict(fields) for fields in ours["BlockStored"]]
    assert {s["parent_block_hash"] for s in stored} == {"nil", "int"}
    assert {s["extra_keys"] for s in stored} >= {shape([None]), shape([["tenant-a"], None])}


async def test_the_routers_decoder_reads_sim_and_real_frames_alike(context: zmq.asyncio.Context) -> None:
    decoder = wire.WireDecoder()
    frames = await published_frames(context, engine_batches())
    sim = [decoder.decode_payload("sim", seq, payload) for seq, (_, _, payload) in enumerate(frames)]
    real = [decoder.decode_payload("real", seq, p) for seq, p in enumerate(real_payloads("s1_basic_bs32"))]
    for batch, problems in sim + real:
        assert batch is not None and problems == []
    stored = [e for batch, _ in sim for e in batch.events if isinstance(e, wire.BlockStored)]
    real_stored = [e for batch, _ in real for e in batch.events if isinstance(e, wire.BlockStored)]
    for event in stored + real_stored:
        assert len(event.token_ids) == len(event.engine_hashes) * event.block_size
        assert event.extra_keys is not None and len(event.extra_keys) == len(event.engine_hashes)
    salted = [e for e in stored if e.extra_keys and e.extra_keys[0] is not None]
    real_salted = [e for e in real_stored if e.extra_keys and e.extra_keys[0] is not None]
    assert [e.extra_keys[0] for e in salted] == [e.extra_keys[0] for e in real_salted] == [["tenant-a"]]
    kinds = {type(e).__name__ for batch, _ in sim for e in batch.events}
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}


async def test_replay_socket_answers_a_dealer_like_vllm(context: zmq.asyncio.Context) -> None:
    publisher = KvEventPublisher(context, endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    publisher.start()
    batch: list[KvEvent] = [StoredBlocks((1, 2), None, tuple(range(8)), 4)]
    for _ in range(5):
        publisher.publish(batch)
    assert publisher.bound_replay_endpoint is not None
    dealer = context.socket(zmq.DEALER)
    dealer.connect(publisher.bound_replay_endpoint)
    req = context.socket(zmq.REQ)
    req.connect(publisher.bound_replay_endpoint)
    try:
        await dealer.send_multipart([b"", (2).to_bytes(8, "big")])
        replies = [await asyncio.wait_for(dealer.recv_multipart(), 5) for _ in range(4)]
        await req.send((0).to_bytes(8, "big"))
        first = await asyncio.wait_for(req.recv_multipart(), 5)
    finally:
        dealer.close(linger=0)
        req.close(linger=0)
        await publisher.close()
    assert [r[:3] for r in replies[:3]] == [[b"", b"kv-events", s.to_bytes(8, "big")] for s in (2, 3, 4)]
    assert replies[3] == [b"", b"", END_SEQ.to_bytes(8, "big"), b""]
    _ts, events, rank = msgpack.unpackb(replies[0][3], raw=False)
    assert events[0]["block_hashes"] == [1, 2] and rank == 0
    assert first[:2] == [b"kv-events", (0).to_bytes(8, "big")] and len(first) == 3
    # the same frame layout as the captured real replies
    replay = shared(RUNS / "s1_basic_bs32" / "replay")
    real_end = [(replay / f"replay_dealer_0004_f{k}.bin").read_bytes() for k in range(4)]
    assert replies[3] == real_end
    real_first = [(replay / f"replay_dealer_0000_f{k}.bin").read_bytes() for k in range(3)]
    assert [len(f) for f in replies[0][:3]] == [len(f) for f in real_first]


def test_lora_requests_publish_the_adapter_on_every_block_like_vllm() -> None:
    engine = VllmEngine(SchedulerConfig(num_blocks=16, block_size=4), PROFILES["cpu-tiny"])
    tokens = list(range(50, 62))
    base = prompt_hashes(tokens, 4)
    adapted = prompt_hashes(tokens, 4, lora_name="jp-legal", cache_salt="t")
    assert not set(base) & set(adapted)
    engine.add(
        EngineRequest("l", 12, adapted, 1, 0.0, token_ids=tokens, cache_salt="t", lora_name="jp-legal", lora_id=1)
    )
    (stored,) = engine.step(0.0).events
    wire_event = encode_payload(0.0, [stored])
    (event,) = msgpack.unpackb(wire_event, raw=False)[1]
    assert event["lora_name"] == "jp-legal" and event["lora_id"] == 1
    assert event["extra_keys"] == [["jp-legal", "t"], ["jp-legal"], ["jp-legal"]]
    batch, problems = wire.WireDecoder().decode_payload("sim", 0, wire_event)
    assert problems == [] and batch is not None
    (decoded,) = batch.events
    assert decoded.lora_name == "jp-legal" and decoded.extra_keys == [["jp-legal", "t"], ["jp-legal"], ["jp-legal"]]
