"""The live router in front of simulated replicas with roles, end to end over real sockets: a split request's
prefill leg on the prefill sim, its decode leg on the decode sim with the prompt's KV transferred, and the sims'
injected faults (a prefill worker that dies after answering, a decode worker that rejects the transfer) ending in
one clean answer."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from kvrouter.config import parse_fleet
from kvrouter.server.app import create_app
from kvrouter.sim.kv_transfer import KvPeers
from kvrouter.sim.profiles import build_engine, get_profile
from kvrouter.sim.server import PdFaults, ReplicaSettings, build_replica_app
from kvrouter.sim.textio import SimTokenizer
from kvrouter.tinymodel import ensure_tokenizer
from kvrouter.typedefs import ReplicaRole
from tests.conftest import router_settings
from tests.engine_recording import RecordingEngine

BLOCK = 32
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "a long question about routing, " * 40}]}


Fleet = Callable[..., Awaitable[tuple[TestClient[Any, Any], dict[str, RecordingEngine]]]]


@pytest.fixture
async def sim_fleet(aiohttp_client: Any) -> AsyncIterator[Fleet]:
    """`await sim_fleet(("p0", "prefill", PdFaults()), ("d0", "decode", None))`: sims behind a kvrouter."""
    servers: list[TestServer] = []
    tokenizer_dir = ensure_tokenizer()
    tokenizer = SimTokenizer(tokenizer_dir)
    peers = KvPeers()

    async def make(
        *specs: tuple[str, ReplicaRole, PdFaults | None],
    ) -> tuple[TestClient[Any, Any], dict[str, RecordingEngine]]:
        engines: dict[str, RecordingEngine] = {}
        entries = []
        for name, role, faults in specs:
            engine = RecordingEngine(build_engine(get_profile("cpu-tiny"), block_size=BLOCK))
            settings = ReplicaSettings(name=name, model_name="tiny", max_model_len=4096, time_scale=20.0, role=role)
            app: web.Application = build_replica_app(settings, engine, tokenizer, peers=peers, faults=faults)
            server = TestServer(app, host="127.0.0.1")
            await server.start_server()
            servers.append(server)
            engines[name] = engine
            entries.append({"name": name, "url": f"http://127.0.0.1:{server.port}", "role": role})
        fleet = parse_fleet(
            {"replicas": entries, "block_size": BLOCK, "tokenizer": str(tokenizer_dir),
             "disaggregation": {"mode": "always", "prefill_timeout_s": 5.0}},
            Path("replicas.yaml"),
        )  # fmt: skip
        router = create_app(router_settings(policy="kv_aware"), fleet, registry=CollectorRegistry())
        return await aiohttp_client(router), engines

    yield make
    for server in servers:
        await server.close()


async def test_a_split_request_prefills_on_the_prefill_sim_and_decodes_with_the_kv_transferred(
    sim_fleet: Fleet,
) -> None:
    client, engines = await sim_fleet(("p0", "prefill", None), ("d0", "decode", None))
    body = {**CHAT, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == 200 and response.headers["x-kvrouter-replica"] == "d0"
    text = await response.text()
    assert text.count("data: [DONE]") == 1
    (prefill,) = engines["p0"].added
    (decode,) = engines["d0"].added
    assert prefill.max_tokens == 1 and not prefill.kv_transferred
    assert decode.kv_transferred and decode.max_tokens == 8
    assert decode.token_ids == prefill.token_ids  # the same prompt, its KV pulled instead of computed


async def test_a_prefill_sim_that_dies_after_answering_ends_in_one_answer(sim_fleet: Fleet) -> None:
    client, engines = await sim_fleet(
        ("p0", "prefill", PdFaults(die_after_prefill=True)), ("d0", "decode", None), ("d1", "decode", None)
    )
    response = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5})
    body = await response.json()
    # The decode sim could not pull the KV (500 before its first byte): the router retries the request whole on
    # the other decode worker.
    assert response.status == 200 and body["usage"]["completion_tokens"] == 5
    # The refused decode leg never reached an engine: one whole run, one answer.
    assert [r.kv_transferred for name in ("d0", "d1") for r in engines[name].added] == [False]


async def test_with_no_other_decode_worker_the_refusing_one_serves_the_request_whole(sim_fleet: Fleet) -> None:
    client, engines = await sim_fleet(("p0", "prefill", PdFaults(die_after_prefill=True)), ("d0", "decode", None))
    response = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5})
    body = await response.json()
    # d0's KV pull failed (p0 died after answering): its refusal was about the transfer, so the retry runs the
    # request whole on d0 itself. One answer, one engine run.
    assert response.status == 200 and body["usage"]["completion_tokens"] == 5
    assert response.headers["x-kvrouter-replica"] == "d0"
    assert [r.kv_transferred for r in engines["d0"].added] == [False]


async def test_a_decode_sim_that_rejects_the_transfer_ends_in_one_answer(sim_fleet: Fleet) -> None:
    client, engines = await sim_fleet(
        ("p0", "prefill", None), ("d0", "decode", PdFaults(reject_transfers=True)), ("d1", "both", None)
    )
    for _ in range(3):
        response = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4, "stream": True})
        text = await response.text()
        assert response.status == 200 and text.count("data: [DONE]") == 1
    assert not any(r.kv_transferred for r in engines["d0"].added)
