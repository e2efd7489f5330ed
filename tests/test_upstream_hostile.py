"""Hostile requests and hostile replicas (issue 15, upstream side), over real sockets on 127.0.0.1.

One client request or one replica answer must never take the fleet down: request targets that are not paths stop
at the edge, only allow-listed paths pass through, a poison request fails alone without opening any breaker,
redirects are never followed, a replica that takes requests and never answers is found out within the first-byte
window while its /health still says 200, and no upstream body is held past its byte bound.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

from aiohttp.test_utils import TestClient

from kvrouter.server.app import METRICS, REPLICAS
from kvrouter.server.replicas import BreakerState
from kvrouter.server.streaming import UsageScanner
from tests.conftest import ReplicaFactory, RouterFactory, eventually
from tests.test_proxy import CHAT, metric_value

POISON = {"model": "fake-model", "messages": [{"role": "user", "content": "POISON: crashes the engine"}]}


def sample(client: TestClient[Any, Any], name: str, **labels: str) -> float:
    value = client.app[METRICS].registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def breaker_opens(client: TestClient[Any, Any]) -> float:
    return sum(sample(client, "kvrouter_breaker_opens_total", replica=r.name) for r in client.app[REPLICAS])


async def raw_exchange(client: TestClient[Any, Any], request_line: str) -> tuple[int, bytes]:
    """Send one request with a hand-written request line; the status and body of the answer."""
    assert client.server.host == "127.0.0.1"
    reader, writer = await asyncio.open_connection("127.0.0.1", client.server.port)
    try:
        writer.write(f"{request_line}\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        answer = await reader.read()
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


# -- 1. request targets that are not origin-form ---------------------------------------------------------------


async def test_asterisk_and_absolute_targets_are_refused_and_charge_no_replica(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    replicas = await fake_replicas(2)
    client = await make_router(replicas)
    targets = ["OPTIONS * HTTP/1.1", "GET http://evil.example/v1/models HTTP/1.1", "POST http://evil/tokenize HTTP/1.1"]
    for line in targets * 10:
        status, body = await raw_exchange(client, line)
        assert status == 400, line
        assert json.loads(body)["error"]["code"] == "invalid_request_target"
    # aiohttp's own parser already refuses an asterisk with any other method.
    assert (await raw_exchange(client, "GET * HTTP/1.1"))[0] == 400
    # The flood that used to open every breaker: now every legitimate request still succeeds.
    answers = [await client.post("/v1/chat/completions", json=CHAT) for _ in range(38)]
    assert [a.status for a in answers] == [200] * 38
    assert breaker_opens(client) == 0
    assert all(r.state is BreakerState.CLOSED and r.consecutive_failures == 0 for r in client.app[REPLICAS])
    assert all(not r.path.startswith("*") and "evil" not in r.path for rep in replicas for r in rep.seen)
    assert sample(client, "kvrouter_client_rejections_total", reason="request_target") == 30


# -- 2. the pass-through allow-list and the concurrency limit ------------------------------------------------


async def test_only_allow_listed_paths_pass_through(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    replicas = await fake_replicas(2)
    client = await make_router(replicas)
    tokenized = await client.post("/tokenize", json={"prompt": "ab"})
    assert tokenized.status == 200 and (await tokenized.json())["tokens"] == [97, 98]
    refused = [
        "/reset_prefix_cache",
        "/sleep",
        "/wake_up",
        "/collective_rpc",
        "/start_profile",
        "/v1/load_lora_adapter",
    ]
    refused += ["/tokenize/../reset_prefix_cache", "/v1/responses/%2e%2e/x", "/v1/responses/../../sleep", "/tokenize/"]
    for path in refused:
        answer = await client.post(path, json={})
        assert answer.status == 404, path
        assert (await answer.json())["error"]["code"] == "not_found"
    # A /prefix/* entry admits plain sub-paths: it reaches a replica (the fake has no such route: its 404).
    sub = await client.get("/v1/responses/resp_123")
    assert sub.status == 404 and sub.headers["x-kvrouter-replica"] in ("r0", "r1")
    seen = [r.path for rep in replicas for r in rep.seen]
    assert seen == ["/tokenize"]  # (the fake records the routes it has; the refused paths never arrived)
    assert sample(client, "kvrouter_client_rejections_total", reason="path_not_allowed") == len(refused)


async def test_the_allow_list_is_a_setting(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    replicas = await fake_replicas(1)
    client = await make_router(replicas, passthrough_paths=["/detokenize"])
    assert (await client.post("/tokenize", json={"prompt": "a"})).status == 404
    assert (await client.post("/detokenize", json={"tokens": [104]})).status == 200


async def test_passthrough_counts_against_max_concurrency(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    hold = asyncio.Event()
    replicas = await fake_replicas(1, hold=hold)
    client = await make_router(replicas, max_concurrency=1)
    stream = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    await stream.content.readany()  # the stream holds the one slot
    busy = await client.post("/tokenize", json={"prompt": "a"})
    assert busy.status == 429 and (await busy.json())["error"]["code"] == "overloaded"
    hold.set()
    await stream.read()
    assert (await client.post("/tokenize", json={"prompt": "a"})).status == 200


# -- 3. whose 5xx is it ------------------------------------------------------------------------------------


async def test_a_poison_request_fails_alone_and_opens_no_breaker(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    replicas = await fake_replicas(3, poison_marker=b"POISON")
    client = await make_router(replicas, health_interval_s=0.2)

    async def send(body: dict[str, Any]) -> int:
        async with client.post("/v1/chat/completions", json=body) as answer:
            await answer.read()
            return answer.status

    count = int(os.environ.get("KVROUTER_TEST_POISON_REQUESTS", "150"))  # a third of them poison
    bodies = [POISON if i % 3 == 0 else CHAT for i in range(count)]
    started = time.perf_counter()
    statuses = await asyncio.gather(*(send(body) for body in bodies))
    honest = [s for s, b in zip(statuses, bodies, strict=True) if b is CHAT]
    poisoned = [s for s, b in zip(statuses, bodies, strict=True) if b is POISON]
    print(f"{len(poisoned)} poison + {len(honest)} honest requests in {time.perf_counter() - started:.2f} s")
    assert honest == [200] * len(honest)
    assert poisoned == [500] * len(poisoned)  # the replicas' own answer, relayed
    assert breaker_opens(client) == 0
    assert all(r.state is BreakerState.CLOSED for r in client.app[REPLICAS])
    attributed = sum(
        sample(client, "kvrouter_upstream_rejections_total", replica=r.name, reason="request_5xx") for r in replicas
    )
    assert attributed == 3 * len(poisoned)  # each poison request was tried on all three replicas


async def test_a_replica_that_fails_everything_still_opens_its_breaker(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    replicas = await fake_replicas(3)
    replicas[0].behaviour.status = 500  # health still 200: only the request path can tell
    client = await make_router(replicas, health_interval_s=0.05)
    statuses = [(await client.post("/v1/chat/completions", json=CHAT)).status for _ in range(30)]
    assert statuses == [200] * 30
    state = client.app[REPLICAS].by_name["r0"]
    assert state.state is BreakerState.OPEN
    await asyncio.sleep(0.3)  # passing probes do not close a breaker that real requests opened
    assert state.state is not BreakerState.CLOSED and state.last_probe_ok is True
    assert sample(client, "kvrouter_breaker_opens_total", replica="r0") >= 1
    assert sample(client, "kvrouter_breaker_opens_total", replica="r1") == 0


async def test_a_replica_refusing_connections_still_opens_its_breaker(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    replicas = await fake_replicas(2)
    client = await make_router(replicas)
    await replicas[0].stop()
    statuses = [(await client.post("/v1/chat/completions", json=CHAT)).status for _ in range(8)]
    assert statuses == [200] * 8
    assert client.app[REPLICAS].by_name["r0"].state is BreakerState.OPEN


# -- 4. redirects are never followed ------------------------------------------------------------------------


async def test_redirects_from_replicas_are_never_followed(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    target, honest, redirecting = await fake_replicas(3)
    redirecting.behaviour.redirect_to = target.url + "/v1/chat/completions"
    client = await make_router([redirecting, honest], health_interval_s=0.1, metrics_interval_s=0.1)
    for stream in (False, True):
        for _ in range(4):
            answer = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
            assert answer.status == 200 and answer.headers["x-kvrouter-replica"] == honest.name
            await answer.read()
    for _ in range(4):
        assert (await client.post("/tokenize", json={"prompt": "a"})).status == 200
    await eventually(lambda: redirecting.scrapes >= 2, what="scrapes of the redirecting replica")
    assert target.seen == [] and target.scrapes == 0
    assert sample(client, "kvrouter_upstream_rejections_total", replica=redirecting.name, reason="redirect") >= 1
    # Alone, the redirecting replica earns the client a 502 in OpenAI's shape, never its Location.
    alone = await make_router([redirecting], health_interval_s=30.0)
    answer = await alone.post("/v1/chat/completions", json=CHAT)
    assert answer.status == 502 and "location" not in answer.headers
    assert (await answer.json())["error"]["code"] == "bad_upstream_response"
    assert target.seen == []


# -- 5. a replica that takes requests and never answers ----------------------------------------------------


async def test_a_hung_replica_is_found_out_within_the_first_byte_window(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    replicas = await fake_replicas(2)
    hung = replicas[0]
    hung.behaviour.hang = True  # /health keeps answering 200
    client = await make_router(replicas, first_byte_timeout_s=0.5, health_interval_s=0.05, read_timeout_s=600.0)
    started = time.perf_counter()
    for stream in (False, True, False, True):
        answer = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        assert answer.status == 200 and answer.headers["x-kvrouter-replica"] == "r1"
        await answer.read()
    elapsed = time.perf_counter() - started
    print(f"4 requests with a hung replica (first_byte_timeout_s=0.5): all 200 in {elapsed:.2f} s")
    state = client.app[REPLICAS].by_name["r0"]
    assert state.stalled and state.state is not BreakerState.CLOSED
    # Probes keep passing, and still do not put the hung replica back: only a real request could.
    await eventually(
        lambda: (
            sample(client, "kvrouter_health_probe_failures_total", replica="r0") == 0 and state.last_probe_ok is True
        ),
        what="a passing probe",
    )
    await asyncio.sleep(0.3)
    assert state.stalled and state.last_probe_ok is True
    assert sample(client, "kvrouter_upstream_rejections_total", replica="r0", reason="stalled") >= 1
    assert elapsed < 30.0  # not the 600 s read timeout
    # The replica comes back: the half-open trial (a real request) closes the breaker.
    hung.behaviour.hang = False
    await eventually(lambda: state.routable, within_s=15.0, what="half-open")
    for _ in range(6):
        assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200
    await eventually(lambda: state.state is BreakerState.CLOSED and not state.stalled, what="the breaker closing")


async def test_a_slow_but_working_replica_is_waited_for(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    # One long non-streaming generation on an otherwise idle replica: no answer moves for longer than the window,
    # but the engine's token counters rise in every scrape, so the replica is not called stalled.
    replicas = await fake_replicas(1, first_delay=1.5, busy_engine=True)
    client = await make_router(replicas, first_byte_timeout_s=0.5, metrics_interval_s=0.05)
    answer = await client.post("/v1/chat/completions", json=CHAT)
    assert answer.status == 200
    state = client.app[REPLICAS].by_name["r0"]
    assert not state.stalled and state.state is BreakerState.CLOSED
    assert len(replicas[0].completions_seen()) == 1


# -- 6. byte bounds on everything read from a replica -------------------------------------------------------


async def test_upstream_bodies_and_scrapes_are_bounded(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    replicas = await fake_replicas(1, body_bytes=3 << 20, metrics_bytes=3 << 20)
    client = await make_router(
        replicas, max_upstream_body_bytes=1 << 20, max_scrape_bytes=1 << 20, metrics_interval_s=0.05
    )
    answer = await client.post("/v1/chat/completions", json=CHAT)
    assert answer.status == 502
    assert (await answer.json())["error"]["code"] == "upstream_body_too_large"
    assert client.app[REPLICAS].by_name["r0"].consecutive_failures == 0  # the request asked for it
    await eventually(
        lambda: sample(client, "kvrouter_upstream_rejections_total", replica="r0", reason="scrape_too_large") >= 2,
        what="oversized scrapes refused",
    )
    assert sample(client, "kvrouter_engine_scrape_errors_total", replica="r0") >= 2
    # An oversized error answer is replaced by a short one of our own.
    replicas[0].behaviour.status = 500
    answer = await client.post("/v1/chat/completions", json=CHAT)
    assert answer.status == 500 and len(await answer.read()) < 1000
    assert (await answer.json())["error"]["code"] == "upstream_error"
    assert await metric_value(client, "kvrouter_upstream_rejections_total", reason="error_body_too_large") == 1


def test_the_usage_scanner_holds_a_bounded_amount_of_an_endless_event() -> None:
    scanner = UsageScanner()
    piece = b"x" * 65536
    held = 0
    for _ in range(200):  # 12.5 MiB without an event boundary
        scanner.feed(piece)
        held = max(held, len(scanner._pending))
    assert held <= (1 << 20) + len(piece)
    scanner.feed(b'\n\ndata: {"usage": {"prompt_tokens_details": {"cached_tokens": 7}}}\n\n')
    assert scanner.cached_tokens == 7


async def test_odd_methods_on_passthrough_paths_are_never_charged(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    replicas = await fake_replicas(2)
    client = await make_router(replicas)
    for _ in range(10):
        async with client.session.request("OPTIONS", client.make_url("/tokenize")) as answer:
            assert answer.status < 500
    assert breaker_opens(client) == 0
    assert all(r.consecutive_failures == 0 for r in client.app[REPLICAS])


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def test_huge_answers_do_not_grow_the_router(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    # Four concurrent answers of KVROUTER_TEST_ANSWER_MB each, capped at KVROUTER_TEST_ANSWER_CAP_MB (the issue's
    # case: 4 x 300 MB answers, no cap, 3.2 GB RSS).
    # The fake replica runs in this process too, but it writes 64 KiB at a time: what grows is what the router holds.
    answer_mb = int(os.environ.get("KVROUTER_TEST_ANSWER_MB", "96"))
    cap_mb = int(os.environ.get("KVROUTER_TEST_ANSWER_CAP_MB", "8"))
    replicas = await fake_replicas(1, body_bytes=answer_mb << 20)
    client = await make_router(replicas, max_upstream_body_bytes=cap_mb << 20)
    peak = before = rss_mb()

    async def sample_rss() -> None:
        nonlocal peak
        while True:
            peak = max(peak, rss_mb())
            await asyncio.sleep(0.005)

    sampler = asyncio.create_task(sample_rss())
    started = time.perf_counter()
    try:
        answers = await asyncio.gather(*(client.post("/v1/completions", json={"prompt": "x"}) for _ in range(4)))
    finally:
        sampler.cancel()
    elapsed = time.perf_counter() - started
    assert [a.status for a in answers] == [502] * 4
    growth = peak - before
    print(f"4 x {answer_mb} MB answers, cap {cap_mb} MiB: RSS growth {growth:.0f} MB, {elapsed:.2f} s")
    assert growth < 4 * cap_mb * 3 + 40  # four capped reads (parts + join) and slack; never the answers themselves


async def test_a_hung_replica_on_a_passthrough_path_is_found_out_too(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    replicas = await fake_replicas(2)
    replicas[0].behaviour.hang = True
    client = await make_router(replicas, first_byte_timeout_s=0.3, read_timeout_s=600.0)
    started = time.perf_counter()
    for _ in range(4):
        answer = await client.post("/tokenize", json={"prompt": "a"})
        assert answer.status == 200 and answer.headers["x-kvrouter-replica"] == "r1"
    assert time.perf_counter() - started < 10.0
    assert client.app[REPLICAS].by_name["r0"].stalled
