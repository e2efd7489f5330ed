"""A decode leg whose connection fails before anything is sent (refused, or timed out connecting) is sent once more
to the same decode worker, so the split and the prefill already done are kept; over real sockets on 127.0.0.1, with
the P/D fleet of tests/test_pd_live.py. The decode worker's port is held by the test: refusing (bound, not
listening) or timing out (listening with a full accept queue, so the kernel drops the router's SYN) until the test
opens it from inside the router's failure accounting, between the first connect and the retry."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from kvrouter.server.app import LOAD, REPLICAS
from kvrouter.server.disagg_legs import REMOTE_DECODE
from tests.conftest import eventually
from tests.fake_replica import FakeReplica
from tests.test_pd_live import CHAT, PdFleet, pd_fleet, tokenizer_dir  # noqa: F401  (fixtures)
from tests.test_proxy import metric_value

FAILURES = ["refused", "connect_timeout"]
CONNECT_TIMEOUT_S = 0.5


class HeldPort:
    """A stopped fake replica's port, held so that connecting to it fails — `refused`: bound, not listening;
    `connect_timeout`: listening with its accept queue full of the test's own connections — until `open()`, which
    serves the replica's app there from then on. `open` is synchronous: a connect made before the app runs waits in
    the accept queue, so a hook called between two of the router's connects decides which one fails."""

    def __init__(self, replica: FakeReplica, failure: str) -> None:
        self.replica = replica
        self.failure = failure
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", replica.port))
        self.fillers: list[socket.socket] = []
        if failure == "connect_timeout":
            self.sock.listen(0)  # Linux queues one connection at backlog 0 and drops SYNs past it
            for _ in range(3):
                filler = socket.socket()
                filler.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    filler.connect(("127.0.0.1", replica.port))
                self.fillers.append(filler)
        self.serving: asyncio.Task[None] | None = None
        self.runner: web.AppRunner | None = None

    def open(self) -> None:
        for filler in self.fillers:
            filler.close()
        self.fillers = []
        self.sock.setblocking(False)
        if self.failure == "connect_timeout":
            with contextlib.suppress(BlockingIOError):
                while True:
                    queued, _ = self.sock.accept()
                    queued.close()
        self.sock.listen(16)
        self.serving = asyncio.ensure_future(self._serve())

    async def _serve(self) -> None:
        self.runner = web.AppRunner(self.replica.build_app(), handler_cancellation=True, access_log=None)
        await self.runner.setup()
        await web.SockSite(self.runner, self.sock).start()

    async def close(self) -> None:
        if self.serving is not None:
            await self.serving
        if self.runner is not None:
            await self.runner.cleanup()
        for filler in self.fillers:
            filler.close()
        self.sock.close()


async def hold_decode_port(client: TestClient[Any, Any], replicas: dict[str, FakeReplica], failure: str) -> HeldPort:
    """d0's port held as `failure` says, once the router's first health probes are over (a probe of the held port
    would count as a failure of its own)."""
    replica_set = client.app[REPLICAS]
    await eventually(lambda: all(r.last_probe_ok for r in replica_set.replicas), what="the first probes")
    await replicas["d0"].stop()
    return HeldPort(replicas["d0"], failure)


def open_after_first_failure(monkeypatch: pytest.MonkeyPatch, client: TestClient[Any, Any], held: HeldPort) -> None:
    """Open `held` right after the router counts its first failure there: the decode leg's first connect fails and
    the next one (the retry) finds the decode worker."""
    replica_set = client.app[REPLICAS]
    record_failure = replica_set.record_failure

    def hooked(replica: Any, reason: str, error: BaseException | None = None, *, probe_blind: bool = False) -> None:
        record_failure(replica, reason, error, probe_blind=probe_blind)
        if replica.name == held.replica.name and held.serving is None:
            held.open()

    monkeypatch.setattr(replica_set, "record_failure", hooked)


async def assert_nothing_in_flight(client: TestClient[Any, Any]) -> None:
    load = client.app[LOAD]
    for name in ("p0", "d0"):
        snapshot = load.snapshot(name)  # type: ignore[arg-type]
        assert (snapshot.in_flight, snapshot.pending_prefill_tokens, snapshot.decode_requests) == (0, 0, 0), name
    assert load.in_flight_total() == 0


@pytest.mark.parametrize("failure", FAILURES)
async def test_a_decode_leg_whose_connect_failed_is_sent_again_and_the_request_stays_split(
    pd_fleet: PdFleet,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    failure: str,
) -> None:
    client, replicas = await pd_fleet("p0:prefill", "d0:decode", connect_timeout_s=CONNECT_TIMEOUT_S)
    held = await hold_decode_port(client, replicas, failure)
    try:
        open_after_first_failure(monkeypatch, client, held)
        replicas["d0"].behaviour.hold = hold = asyncio.Event()
        response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert response.status == 200 and response.headers["x-kvrouter-replica"] == "d0"
        # Mid-stream on the retry: the decode leg counts once in the load book (the failed attempt's commitment
        # released, the retry's taken), nothing else is in flight.
        load = client.app[LOAD]
        assert load.snapshot("d0").in_flight == 1 and load.in_flight_total() == 1  # type: ignore[arg-type]
        hold.set()
        assert (await response.text()).count("data: [DONE]") == 1
        assert held.serving is not None  # the first connect did fail
        # Split as ever: p0 ran the prefill leg only, d0 decoded with p0's transfer parameters.
        (prefill,) = replicas["p0"].completions_seen()
        assert prefill.json()["kv_transfer_params"] == REMOTE_DECODE
        (decode,) = replicas["d0"].completions_seen()
        assert decode.json()["kv_transfer_params"]["remote_engine_id"] == "engine-p0"
        assert await metric_value(client, "kvrouter_pd_decode_retries_total", outcome="ok") == 1
        assert await metric_value(client, "kvrouter_retries_total", replica="d0", reason="connect") == 1
        assert client.app[REPLICAS].by_name["d0"].consecutive_failures == 0  # the retry's success reset it
        await assert_nothing_in_flight(client)
    finally:
        await held.close()


@pytest.mark.parametrize("failure", FAILURES)
async def test_a_decode_worker_that_stays_unreachable_gets_one_retry_then_the_request_runs_whole(
    pd_fleet: PdFleet,  # noqa: F811
    failure: str,
) -> None:
    client, replicas = await pd_fleet("p0:prefill", "d0:decode", connect_timeout_s=CONNECT_TIMEOUT_S)
    held = await hold_decode_port(client, replicas, failure)
    try:
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status == 200 and response.headers["x-kvrouter-replica"] == "p0"
        assert (await response.json())["choices"][0]["message"]["content"]
        # As before the retry: the prefill leg, then the whole request on the only replica left.
        legs = [request.json() for request in replicas["p0"].completions_seen()]
        assert [("kv_transfer_params" in body) for body in legs] == [True, False]
        assert client.app[REPLICAS].by_name["d0"].consecutive_failures == 2  # two connects, each counted
        assert await metric_value(client, "kvrouter_retries_total", replica="d0", reason="connect") == 2
        assert await metric_value(client, "kvrouter_pd_decode_retries_total", outcome="failed") == 1
        assert await metric_value(client, "kvrouter_pd_decode_retries_total", outcome="ok") is None
        await assert_nothing_in_flight(client)
    finally:
        await held.close()


async def test_a_decode_leg_that_reached_its_worker_is_not_sent_again(pd_fleet: PdFleet) -> None:  # noqa: F811
    # The connection to the decode worker is made and the request written, then dropped without an answer: the
    # worker may have taken the request, so the request runs whole as before, with no second decode leg. (A guard:
    # the code before the retry behaved the same.)
    client, replicas = await pd_fleet("p0:prefill", "d0:decode", connect_timeout_s=CONNECT_TIMEOUT_S)
    replica_set = client.app[REPLICAS]
    await eventually(lambda: all(r.last_probe_ok for r in replica_set.replicas), what="the first probes")
    await replicas["d0"].stop()
    requests: list[bytes] = []

    async def take_and_drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests.append(await reader.readuntil(b"\r\n\r\n"))
        writer.close()

    server = await asyncio.start_server(take_and_drop, "127.0.0.1", replicas["d0"].port, reuse_address=True)
    try:
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status == 200 and response.headers["x-kvrouter-replica"] == "p0"
        assert len(requests) == 1 and requests[0].startswith(b"POST /v1/chat/completions")
        assert await metric_value(client, "kvrouter_pd_decode_retries_total") is None
        await assert_nothing_in_flight(client)
    finally:
        server.close()
        await server.wait_closed()
