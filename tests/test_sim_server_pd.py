"""Simulated replicas speaking vLLM's KV-transfer protocol (NixlConnector's `kv_transfer_params`) over real
sockets: a prefill replica's answer, a decode replica taking it (its events storing the transferred blocks), the
400s for legs a replica cannot take, and the faults tests inject."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio
from aiohttp import web
from aiohttp.test_utils import TestClient

from kvrouter.config import parse_fleet
from kvrouter.events import wire
from kvrouter.sim.cli import fleet_document, layouts, replica_faults
from kvrouter.sim.kv_transfer import KvPeers, fleet_roles, parse_kv_transfer_params
from kvrouter.sim.profiles import KvTransfer, build_engine, get_profile
from kvrouter.sim.publisher import KvEventPublisher
from kvrouter.sim.server import PdFaults, ReplicaSettings, build_replica_app
from kvrouter.sim.textio import SimTokenizer
from kvrouter.tinymodel import ensure_tokenizer
from kvrouter.typedefs import ReplicaRole

Client = TestClient[web.Request, web.Application]
MakeClient = Callable[[web.Application], Awaitable[Client]]
BLOCK = 32
PROMPT = " ".join(f"clause {i} of a long shared system prompt says something quite specific." for i in range(12))
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@pytest.fixture(scope="module")
def tokenizer() -> SimTokenizer:
    return SimTokenizer(ensure_tokenizer())


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    ctx.setsockopt(zmq.LINGER, 0)
    yield ctx
    ctx.destroy(linger=0)


class Fleet:
    """Replicas of one process: one transfer plane, each on its own real port."""

    def __init__(self, make: MakeClient, tokenizer: SimTokenizer) -> None:
        self.make = make
        self.tokenizer = tokenizer
        self.peers = KvPeers()

    async def replica(
        self,
        name: str,
        role: ReplicaRole,
        *,
        faults: PdFaults | None = None,
        transfer: KvTransfer | None = None,
        publisher: KvEventPublisher | None = None,
    ) -> Client:
        settings = ReplicaSettings(
            name=name, model_name="tiny", max_model_len=4096, time_scale=20.0, role=role, kv_transfer=transfer
        )
        engine = build_engine(get_profile("cpu-tiny"), block_size=BLOCK)
        app = build_replica_app(settings, engine, self.tokenizer, peers=self.peers, faults=faults, publisher=publisher)
        return await self.make(app)


@pytest.fixture
def fleet(aiohttp_client: MakeClient, tokenizer: SimTokenizer) -> Fleet:
    return Fleet(aiohttp_client, tokenizer)


async def prefill(client: Client) -> tuple[int, dict[str, Any]]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS}
    response = await client.post("/v1/completions", json=body)
    return response.status, await response.json()


async def decode(client: Client, params: object, *, stream: bool = True) -> tuple[int, str]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "stream": stream, "kv_transfer_params": params}
    response = await client.post("/v1/completions", json=body)
    return response.status, await response.text()


async def test_a_prefill_replica_answers_with_nixl_params_pointing_at_itself(fleet: Fleet) -> None:
    producer = await fleet.replica("p0", "prefill")
    status, body = await prefill(producer)
    assert status == 200 and body["usage"]["completion_tokens"] == 1
    params = body["kv_transfer_params"]
    prompt = body["usage"]["prompt_tokens"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "p0-engine" and params["tp_size"] == 1
    assert params["remote_host"] == "127.0.0.1" and params["remote_port"] == producer.port
    assert params["remote_block_ids"] == list(range(-(-prompt // BLOCK)))
    assert isinstance(params["remote_request_id"], str)
    # A plain request to a prefill replica is served whole, without params (vLLM's prefill instances do so).
    plain = await producer.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 3})
    assert plain.status == 200 and "kv_transfer_params" not in await plain.json()


async def test_a_decode_replica_streams_with_the_prompt_transferred_and_stores_its_blocks(
    fleet: Fleet, context: zmq.asyncio.Context
) -> None:
    publisher = KvEventPublisher(context, endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    producer = await fleet.replica("p0", "prefill")
    consumer = await fleet.replica("d0", "decode", publisher=publisher)
    assert publisher.bound_endpoint is not None
    sub.connect(publisher.bound_endpoint)
    await asyncio.sleep(0.3)  # PUB/SUB join
    try:
        _, answer = await prefill(producer)
        prompt = answer["usage"]["prompt_tokens"]
        status, text = await decode(consumer, answer["kv_transfer_params"])
        assert status == 200
        chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        assert sum(1 for chunk in chunks if chunk["choices"] and chunk["choices"][0]["text"]) == 6
        assert text.rstrip().endswith("data: [DONE]")
        stored = 0
        while stored < prompt // BLOCK:
            frames = await asyncio.wait_for(sub.recv_multipart(), 5)
            batch, problems = wire.WireDecoder().decode_payload("d0", 0, frames[2])
            assert batch is not None and not problems
            stored += sum(len(e.engine_hashes) for e in batch.events if isinstance(e, wire.BlockStored))
        assert stored == prompt // BLOCK  # every full prompt block, stored at admission: the pulled KV
    finally:
        sub.close(linger=0)


async def test_the_decode_leg_waits_for_the_transfer(fleet: Fleet) -> None:
    producer = await fleet.replica("p0", "prefill")
    slow = await fleet.replica("d0", "decode", transfer=KvTransfer(bytes_per_token=0, latency_s=4.0))
    _, answer = await prefill(producer)
    started = time.monotonic()
    status, _ = await decode(slow, answer["kv_transfer_params"], stream=False)
    assert status == 200
    assert time.monotonic() - started >= 4.0 / 20.0  # the transfer's latency, on the replica's time scale


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ("yes", "must be an object"),
        ({"do_remote_prefill": "true", "remote_engine_id": "p0-engine"}, "must be a boolean"),
        ({"do_remote_prefill": True, "remote_block_ids": [0]}, "remote_engine_id"),
        ({"do_remote_prefill": True, "remote_engine_id": "p0-engine", "remote_block_ids": "0"}, "remote_block_ids"),
        ({"do_remote_prefill": True, "remote_engine_id": "p0-engine", "remote_block_ids": [0], "remote_port": 0},
         "remote_port"),
        ({"do_remote_prefill": True, "remote_engine_id": "elsewhere", "remote_block_ids": [0]}, "not a known"),
        ({"do_remote_prefill": True, "remote_engine_id": "d1-engine", "remote_block_ids": [0]}, "not a known"),
        ({"do_remote_prefill": True, "remote_engine_id": "p0-engine", "remote_block_ids": list(range(999))},
         "blocks, the prompt"),
        ({"do_remote_prefill": True, "do_remote_decode": True}, "both"),
        (PREFILL_PARAMS, "decode worker"),
    ],
)  # fmt: skip
async def test_legs_a_decode_replica_cannot_take_get_a_400(fleet: Fleet, params: object, message: str) -> None:
    await fleet.replica("p0", "prefill")
    await fleet.replica("d1", "decode")
    consumer = await fleet.replica("d0", "decode")
    status, text = await decode(consumer, params)
    assert status == 400
    error = json.loads(text)["error"]
    assert message in error["message"] and error["type"] == "BadRequestError" and error["code"] == 400


async def test_a_prefill_replica_refuses_a_decode_leg(fleet: Fleet) -> None:
    producer = await fleet.replica("p0", "prefill")
    _, answer = await prefill(producer)
    status, text = await decode(producer, answer["kv_transfer_params"])
    assert status == 400 and "prefill worker" in json.loads(text)["error"]["message"]


async def test_injected_faults(fleet: Fleet) -> None:
    failing = await fleet.replica("p0", "prefill", faults=PdFaults(prefill_status=500))
    status, body = await prefill(failing)
    assert status == 500 and body["error"]["type"] == "InternalServerError"
    dying = await fleet.replica("p1", "prefill", faults=PdFaults(die_after_prefill=True))
    status, answer = await prefill(dying)
    assert status == 200 and answer["kv_transfer_params"]["remote_engine_id"] == "p1-engine"
    with pytest.raises(aiohttp.ClientConnectionError):
        await dying.get("/health")  # dead: every later connection closes unanswered
    consumer = await fleet.replica("d1", "decode")
    status, text = await decode(consumer, answer["kv_transfer_params"])  # its KV died with it
    assert status == 500 and "the prefill worker is gone" in json.loads(text)["error"]["message"]
    rejecting = await fleet.replica("d0", "decode", faults=PdFaults(reject_transfers=True))
    _, healthy = await prefill(await fleet.replica("p2", "prefill"))
    status, text = await decode(rejecting, healthy["kv_transfer_params"])
    assert status == 500 and "injected fault" in json.loads(text)["error"]["message"]
    # The plain path of a faulty replica is untouched.
    plain = await rejecting.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2})
    assert plain.status == 200


def test_roles_faults_and_the_fleet_file() -> None:
    assert fleet_roles("2P2D", 4) == ["prefill", "prefill", "decode", "decode"]
    assert fleet_roles("prefill, both", 2) == ["prefill", "both"]
    assert fleet_roles(None, 2) == ["both", "both"]
    for bad, count in (("2P2D", 3), ("prefill,prefill", 2), ("prefill,gpu", 2)):
        with pytest.raises(ValueError, match="roles"):
            fleet_roles(bad, count)
    faults = replica_faults(
        ["sim-0:prefill-503", "sim-0:die-after-prefill", "sim-1:reject-transfers"], ["sim-0", "sim-1"]
    )
    assert faults["sim-0"] == PdFaults(prefill_status=503, die_after_prefill=True)
    assert faults["sim-1"].reject_transfers
    for bad in ("sim-9:reject-transfers", "sim-0:explode", "sim-0:prefill-200"):
        with pytest.raises(ValueError, match="--fault"):
            replica_faults([bad], ["sim-0", "sim-1"])
    from pathlib import Path

    document = fleet_document(
        layouts(2, 9000, None), host="127.0.0.1", block_size=32, tokenizer=Path("."), model="m", topic="t",
        roles=["prefill", "decode"],
    )  # fmt: skip
    replicas = document["replicas"]
    assert isinstance(replicas, list) and [r["role"] for r in replicas] == ["prefill", "decode"]
    assert "disaggregation" not in document
    always = fleet_document(
        layouts(2, 9000, None), host="127.0.0.1", block_size=32, tokenizer=Path("."), model="m", topic="t",
        roles=["prefill", "decode"], disaggregation="always",
    )  # fmt: skip
    assert always["disaggregation"] == {"mode": "always"}
    assert parse_fleet(always, Path("replicas.yaml")).disaggregation.mode == "always"
    assert parse_kv_transfer_params(None) is None and parse_kv_transfer_params({"do_remote_decode": False}) is None
