"""Shared load between router instances: the pure core (reports, folding, hostile peers, expiry) and the Redis
load plane between two real routers on a real redis-server, fake replicas on 127.0.0.1."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import msgspec
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from kvrouter.config import load_fleet
from kvrouter.index import PrefixIndex
from kvrouter.policies.base import Candidate, ReplicaLoad, RouteRequest
from kvrouter.policies.kv_aware import KvAwarePolicy
from kvrouter.redisplane.loadplane import CHANNEL, load_plane_client
from kvrouter.routing.calibration import Observation, SharedObservation
from kvrouter.routing.lifecycle import Routed
from kvrouter.routing.load import LoadBook
from kvrouter.routing.sharing import (
    CostSample,
    LoadReport,
    LoadShare,
    PeerCalibrationSink,
    PeerPrefillSink,
    ReplicaCounts,
    RoutedPrefix,
    ShareLimits,
)
from kvrouter.server.app import LOAD, ROUTER, create_app
from kvrouter.tinymodel import ensure_tokenizer
from kvrouter.typedefs import BlockKey, ReplicaName
from tests.conftest import ReplicaFactory, eventually, router_settings
from tests.redis_fixtures import RedisServer, redis_server  # noqa: F401  (fixture)

A, B = ReplicaName("a"), ReplicaName("b")
FLEET = (A, B)


def share(name: str, book: LoadBook | None = None, index: PrefixIndex | None = None, **limits: Any) -> LoadShare:
    return LoadShare(name, book or LoadBook(), lambda: FLEET, lookup=index, limits=ShareLimits(**limits))


def raw(
    instance: str, seq: int, *counts: tuple[str, int, int, int], prefixes: list[RoutedPrefix] | None = None
) -> bytes:
    report = LoadReport(1, instance, seq, [ReplicaCounts(*entry) for entry in counts], prefixes or [])
    return msgspec.msgpack.encode(report)


def view(book: LoadBook, replica: ReplicaName) -> tuple[int, int, int]:
    load = book.snapshot(replica)
    return load.in_flight, load.pending_prefill_tokens, load.decode_requests


def test_a_report_carries_own_counts_and_routed_prefixes_to_the_peer() -> None:
    book_x = LoadBook()
    x = share("x", book_x)
    book_x.begin(A, 700)
    book_x.first_token(book_x.begin(A, 50))
    index_y = PrefixIndex()
    y = share("y", index=index_y)
    assert x.changed()
    assert y.receive(x.report(), now=0.0)
    assert view(y.load, A) == (2, 700, 1) and view(y.load, B) == (0, 0, 0)
    assert y.load.snapshot(A).peer_pending_prefill_tokens == 700
    assert not x.changed()  # nothing moved since
    # Prefixes routed by x are provisional on the same replica at y.
    keys = [BlockKey(11), BlockKey(12), BlockKey(13)]
    y.receive(
        raw("x", 9, ("a", 1, 0, 1), prefixes=[RoutedPrefix("b", b"".join(k.to_bytes(8, "little") for k in keys))]), 1.0
    )
    assert index_y.longest_prefixes(keys, 1.0)[B].blocks == 3
    assert view(y.load, A) == (1, 0, 1)


def test_routed_prefixes_travel_as_little_endian_u64_words() -> None:
    """The wire format older peers read: each key 8 bytes, little-endian, the full unsigned range."""
    x = share("x")
    keys = [BlockKey(1), BlockKey(2**63 + 5), BlockKey(2**64 - 1), BlockKey(0x0102030405060708)]
    x.on_commit(cast(Routed, SimpleNamespace(replica=B, keys=keys)))
    payload = x.report()
    sent = msgspec.msgpack.decode(payload, type=LoadReport).prefixes
    assert [(p.replica, p.keys) for p in sent] == [("b", b"".join(k.to_bytes(8, "little") for k in keys))]
    assert sent[0].keys[24:32] == bytes([8, 7, 6, 5, 4, 3, 2, 1])
    index_y = PrefixIndex()
    assert share("y", index=index_y).receive(payload, now=0.0)
    assert index_y.longest_prefixes(keys, 0.0)[B].blocks == 4


class Progress:
    """A `PeerPrefillSink` that writes down what it hears."""

    def __init__(self) -> None:
        self.heard: list[tuple[str, int, int]] = []

    def peer_prefill(self, replica: ReplicaName, tokens: int, pending: int, now: float) -> None:
        self.heard.append((replica, tokens, pending))


def test_a_peers_dispatches_reach_the_policy_and_garbage_never_does() -> None:
    progress = Progress()
    book = LoadBook()
    book.begin(A, 100)
    y = LoadShare("y", book, lambda: FLEET, progress=progress)
    assert isinstance(progress, PeerPrefillSink)
    assert y.receive(raw("x", 1, ("a", 2, 700, 0), ("b", 1, 50, 0)), 0.0)
    assert progress.heard == [("a", 700, 800), ("b", 50, 50)]  # the rise, then the fleet's pending there
    assert y.receive(raw("x", 2, ("a", 3, 900, 0)), 0.1)  # b missing: x has nothing there now (a fall)
    assert progress.heard[2:] == [("a", 200, 1_000)]
    for payload in (b"\xffgarbage", raw("x", 3, ("a", 1, 10**12, 0)), raw("x", 4, ("a", -1, 5, 0))):
        assert not y.receive(payload, 0.2)
    assert not y.receive(raw("x", 2, ("a", 9, 9_000, 0)), 0.3)  # stale
    assert progress.heard[3:] == []
    assert y.problems == {"undecodable": 1, "absurd_tokens": 1, "negative": 1, "stale": 1}
    assert y.expire(10.0) == ["x"] and book.snapshot(A).pending_prefill_tokens == 100


def test_own_echo_stale_and_unknown_replicas_are_skipped() -> None:
    y = share("y")
    assert not y.receive(raw("y", 1, ("a", 5, 0, 0)), 0.0)  # its own echo
    assert y.receive(raw("x", 5, ("a", 3, 0, 0), ("zz", 1, 0, 0)), 0.0)
    assert not y.receive(raw("x", 4, ("a", 9, 0, 0)), 0.0)  # older than what was folded
    assert view(y.load, A) == (3, 0, 0)
    assert y.problems == {"unknown_replica": 1, "stale": 1}


@pytest.mark.parametrize(
    ("counts", "reason"),
    [
        (("a", -1, 0, 0), "negative"),
        (("a", 1, -5, 0), "negative"),
        (("a", 1, 10**12, 0), "absurd_tokens"),
        (("a", 10**9, 10**12, 0), "absurd_requests"),
        (("a", 2, 0, 3), "absurd_requests"),
        (("a", 1, 100, 1), "absurd_tokens"),  # a decoding request has no prefill left
    ],
)
def test_absurd_reports_are_ignored_whole_and_counted(counts: tuple[str, int, int, int], reason: str) -> None:
    y = share("y")
    assert y.receive(raw("x", 1, ("a", 2, 300, 0)), 0.0)
    assert not y.receive(raw("x", 2, counts), 0.1)
    assert y.problems == {reason: 1}
    assert view(y.load, A) == (2, 300, 0)  # the last sane report still stands, until it expires
    assert y.expire(3.05) == ["x"]
    assert view(y.load, A) == (0, 0, 0)


def test_garbage_and_malformed_reports_never_raise() -> None:
    y = share("y")
    for payload in (b"", b"\xff\x00garbage", msgspec.msgpack.encode({"instance": "x"}), msgspec.msgpack.encode([1])):
        assert not y.receive(payload, 0.0)
    assert not y.receive(raw("", 1), 0.0)
    assert not y.receive(msgspec.msgpack.encode([2, "x", 1, []]), 0.0)
    bad_prefix = [RoutedPrefix("a", b"123")]
    assert not y.receive(raw("x", 1, ("a", 1, 1, 0), prefixes=bad_prefix), 0.0)
    assert y.problems == {"undecodable": 4, "bad_instance": 1, "version": 1, "bad_prefix": 1}
    assert y.peers() == [] and view(y.load, A) == (0, 0, 0)


@settings(max_examples=300, deadline=None)
@given(
    st.binary(max_size=200)
    | st.builds(msgspec.msgpack.encode, st.recursive(st.integers(-(2**63), 2**63 - 1) | st.text(), st.lists))
)
def test_any_bytes_are_survived(payload: bytes) -> None:
    y = share("y")
    y.receive(payload, 0.0)
    load = y.load.snapshot(A)
    assert load.in_flight >= 0 and 0 <= load.pending_prefill_tokens <= 100_000 * 4_194_304


def test_a_silent_peer_expires_and_a_live_one_stays() -> None:
    y = share("y", expiry_s=2.0)
    y.receive(raw("x", 1, ("a", 4, 0, 4)), 0.0)
    y.receive(raw("w", 1, ("b", 1, 10, 0)), 0.0)
    y.receive(raw("w", 2, ("b", 1, 10, 0)), 1.5)
    assert y.expire(2.1) == ["x"]
    assert view(y.load, A) == (0, 0, 0) and view(y.load, B) == (1, 10, 0)
    assert y.peers() == ["w"] and y.expired == 1


def calibrating(name: str) -> tuple[LoadShare, KvAwarePolicy]:
    policy = KvAwarePolicy()
    return LoadShare(name, LoadBook(), lambda: FLEET, calibration=policy), policy


def routed_and_answered(policy: KvAwarePolicy, replica: ReplicaName, prompt: int, ttft_s: float) -> None:
    """kv_aware routes one request of `prompt` uncached tokens to `replica` and hears its first token."""
    load = ReplicaLoad()
    decision = policy.select(RouteRequest(prompt_tokens=prompt), [Candidate(replica, 0, load)])
    policy.first_token(decision, ttft_s, prompt)


def test_calibration_samples_travel_with_the_reports_and_leave_with_the_peer() -> None:
    """Each instance fits the fleet's observations: what x measured reaches y's calibrator with the next report,
    and leaves it when x's reports stop."""
    x, policy_x = calibrating("x")
    y, policy_y = calibrating("y")
    assert isinstance(policy_x, PeerCalibrationSink)
    for number in range(30):  # 30 requests on a: 20k tokens/s plus a 10 ms pass
        prompt = 2_000 + 400 * number
        routed_and_answered(policy_x, A, prompt, prompt / 20_000 + 0.01)
    assert policy_x.calibration is not None and policy_y.calibration is not None
    own = policy_x.calibration.costs(A)
    assert own.source == "fit" and own.prefill_tokens_per_s == pytest.approx(20_000, rel=0.1)
    assert y.receive(x.report(), 0.0)
    heard = policy_y.calibration.costs(A)
    assert heard.source == "fit" and heard.prefill_tokens_per_s == pytest.approx(own.prefill_tokens_per_s, rel=1e-9)
    assert policy_y.calibration.costs(B).source == "peers"  # b borrows a's fit, as for y's own
    assert decode_report(x.report()).samples == []  # each observation travels once
    assert y.expire(10.0) == ["x"]
    assert policy_y.calibration.costs(A).source == "start"  # nothing of x's is left


def test_without_shared_calibration_reports_carry_no_samples_and_peers_are_not_fitted() -> None:
    """`load_share_calibration` off (the default): the load share has no calibration sink."""
    policy = KvAwarePolicy()
    x = LoadShare("x", LoadBook(), lambda: FLEET)
    for number in range(30):
        routed_and_answered(policy, A, 2_000 + 400 * number, 0.2)
    assert policy.shared_observations is None and policy.take_observations() == []
    assert decode_report(x.report()).samples == []
    y, policy_y = LoadShare("y", LoadBook(), lambda: FLEET), KvAwarePolicy()
    assert y.receive(msgspec.msgpack.encode(LoadReport(1, "x", 1, [], [], [sample()] * 30)), 0.0)
    assert policy_y.calibration is not None and policy_y.calibration.replicas() == []


def decode_report(payload: bytes) -> LoadReport:
    return msgspec.msgpack.decode(payload, type=LoadReport)


def sample(**values: float) -> CostSample:
    fields = {"work_tokens": 4_000.0, "short": 0.5, "passes": 1.0, "decoding": 2.0, "ttft_s": 0.2, "weight": 1.0}
    return CostSample("a", **{**fields, **values})


@pytest.mark.parametrize(
    "bad",
    [
        sample(ttft_s=float("nan")),
        sample(work_tokens=float("inf")),
        sample(ttft_s=-0.1),
        sample(ttft_s=1e9),
        sample(short=1.5),
        sample(passes=0.0),
        sample(decoding=-1.0),
        sample(weight=0.0),
        sample(work_tokens=-5.0),
    ],
)
def test_bad_calibration_samples_refuse_the_whole_report(bad: CostSample) -> None:
    y, policy = calibrating("y")
    report = LoadReport(1, "x", 1, [ReplicaCounts("a", 1, 100, 0)], [], [sample()] * 30 + [bad])
    assert not y.receive(msgspec.msgpack.encode(report), 0.0)
    assert y.problems == {"bad_sample": 1}
    assert view(y.load, A) == (0, 0, 0)
    assert policy.calibration is not None and policy.calibration.costs(A).source == "start"


def test_samples_on_unknown_replicas_are_skipped_and_old_reports_have_none() -> None:
    y, policy = calibrating("y")
    report = LoadReport(1, "x", 1, [ReplicaCounts("a", 0, 0, 0)], [], [sample(), CostSample("zz", *[1.0] * 6)])
    assert y.receive(msgspec.msgpack.encode(report), 0.0)
    assert y.problems == {"unknown_replica": 1}
    assert policy.calibration is not None and list(policy.calibration.replicas()) == [A]
    # A report from before the samples field (an older peer): decoded, folded, no samples.
    assert y.receive(msgspec.msgpack.encode([1, "w", 1, [["a", 2, 50, 0]], []]), 0.1)
    assert view(y.load, A) == (2, 50, 0)


def test_a_datagram_too_small_for_every_sample_keeps_the_counts_and_the_newest_samples() -> None:
    x, policy = calibrating("x")
    shared = [SharedObservation(A, Observation(float(n), 0.0, 1.0, 0.0, 0.1)) for n in range(1, 201)]
    assert policy.shared_observations is not None
    policy.shared_observations.extend(shared)
    x.load.begin(A, 5)
    payload = x.report(max_bytes=2_000)
    report = decode_report(payload)
    assert len(payload) <= 2_000 and report.replicas == [ReplicaCounts("a", 1, 5, 0)]
    assert 0 < len(report.samples) < 200 and report.samples[-1].work_tokens == 200.0


# -- the Redis load plane between two real routers ---------------------------------------------------------------


def write_fleet(path: Path, replicas: list[Any]) -> Path:
    path.write_text(yaml.safe_dump({"replicas": [{"name": r.name, "url": r.url} for r in replicas]}), "utf-8")
    return path


@pytest.mark.redis
async def test_two_routers_share_load_and_ignore_a_hostile_peer(
    aiohttp_client: Any,
    tmp_path: Path,
    fake_replicas: ReplicaFactory,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    hold = asyncio.Event()
    replicas = await fake_replicas(2, hold=hold, chunks=2)
    path = write_fleet(tmp_path / "replicas.yaml", replicas)
    clients = []
    for _ in range(2):
        settings_ = router_settings(replicas=path, redis_url=redis_server.url, load_share_expiry_s=1.0)
        clients.append(await aiohttp_client(create_app(settings_, load_fleet(path), registry=CollectorRegistry())))
    a, b = clients
    book_b = b.app[LOAD]
    body = {"model": "fake-model", "prompt": "hello", "stream": True, "max_tokens": 4}
    streams = [asyncio.create_task(a.post("/v1/completions", json=body)) for _ in range(3)]
    # b counts a's three requests in flight without routing any itself.
    took = await eventually(lambda: sum(book_b.snapshot(r.name).in_flight for r in replicas) == 3, what="shared")
    assert book_b.in_flight_total() == 0 and book_b.peer_in_flight() == 3
    assert took < 1.0
    # Both decide through a blind group (kvrouter/routing/herding.py), each ranked among the two instances.
    groups = [client.app[ROUTER].blind_group for client in clients]
    await eventually(lambda: all(g is not None and g.rank is not None for g in groups), what="ranked")
    assert sorted(g.rank for g in groups if g is not None) == [(0, 2), (1, 2)]  # type: ignore[type-var]

    # A hostile client on the same channel: absurd and garbage reports change nothing, and are counted.
    hostile = Redis.from_url(redis_server.url)
    try:
        await hostile.publish(CHANNEL, raw("evil", 1, ("r0", -7, 0, 0)))
        await hostile.publish(CHANNEL, raw("evil", 2, ("r0", 1, 10**12, 0)))
        await hostile.publish(CHANNEL, b"\x00not msgpack")
    finally:
        await hostile.aclose()
    metrics = ""

    async def scrape() -> str:
        return await (await b.get("/metrics")).text()

    for _ in range(200):
        metrics = await scrape()
        if 'kvrouter_load_share_problems_total{reason="undecodable"} 1.0' in metrics:
            break
        await asyncio.sleep(0.01)
    assert 'kvrouter_load_share_problems_total{reason="negative"} 1.0' in metrics
    assert 'kvrouter_load_share_problems_total{reason="absurd_tokens"} 1.0' in metrics
    assert 'kvrouter_load_share_problems_total{reason="undecodable"} 1.0' in metrics
    assert sum(book_b.snapshot(r.name).in_flight for r in replicas) == 3
    assert "kvrouter_load_share_peers 1.0" in metrics
    assert "kvrouter_load_share_blind_placeholders_total" in metrics

    hold.set()
    for stream in streams:
        response = await stream
        await response.read()
    await eventually(lambda: sum(book_b.snapshot(r.name).in_flight for r in replicas) == 0, what="released")

    # The instance ranked second waits its stagger (one horizon, capped at load_share_stagger_max_s) before each
    # decision, so a burst split between the two is decided in rank order; the first never waits.
    ranked = sorted((g.rank, g, client) for g, client in zip(groups, clients, strict=True) if g is not None)
    (_, first, first_client), (_, second, second_client) = ranked
    waited = (first.staggered, second.staggered, second.stagger_seconds)
    for client in (first_client, second_client):
        answer = await client.post("/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 2})
        assert answer.status == 200
    assert first.staggered == waited[0]
    assert second.staggered == waited[1] + 1
    assert 0 < second.stagger_seconds - waited[2] <= 0.05 + 1e-9
    text = await (await second_client.get("/metrics")).text()
    assert f"kvrouter_load_share_staggered_decisions_total {float(second.staggered)}" in text
    probe = {"model": "fake-model", "prompt": "hi", "max_tokens": 2}
    shown = [
        (await (await c.post("/debug/route", json=probe)).json())["blind_group"] for c in (first_client, second_client)
    ]
    assert [(view["rank"], view["instances"]) for view in shown] == [(0, 2), (1, 2)]
    assert shown[0]["stagger_s"] == 0.0 and 0 < shown[1]["stagger_s"] <= 0.05
    # a stops publishing (its plane is torn down with the app): b drops it within the expiry.
    await a.close()
    await eventually(lambda: book_b.peers() == [], within_s=5.0, what="expired")


@pytest.mark.redis
async def test_two_kv_aware_routers_fit_each_others_observations(
    aiohttp_client: Any,
    tmp_path: Path,
    fake_replicas: ReplicaFactory,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """Through real Redis: the first tokens one router hears are calibration observations the other fits too; they
    leave its fits when the first router's reports stop."""
    replicas = await fake_replicas(2)
    path = tmp_path / "replicas.yaml"
    fleet = {
        "tokenizer": str(ensure_tokenizer(tmp_path / "tok")),
        "replicas": [{"name": r.name, "url": r.url} for r in replicas],
    }
    path.write_text(yaml.safe_dump(fleet), "utf-8")
    clients = []
    for _ in range(2):
        settings_ = router_settings(
            replicas=path,
            redis_url=redis_server.url,
            load_share_expiry_s=1.0,
            policy="kv_aware",
            load_share_calibration=True,
        )
        clients.append(await aiohttp_client(create_app(settings_, load_fleet(path), registry=CollectorRegistry())))
    a, b = clients
    calibration_a = a.app[ROUTER].policy.calibration
    calibration_b = b.app[ROUTER].policy.calibration
    await eventually(lambda: b.app[LOAD].peers() != [], what="a heard")
    (peer_a,) = b.app[LOAD].peers()
    for number in range(3):
        body = {"model": "fake-model", "prompt": f"request {number}", "max_tokens": 2}
        assert (await a.post("/v1/completions", json=body)).status == 200
    assert calibration_a.held_from(None) == 3 and calibration_b.held_from(None) == 0
    await eventually(lambda: calibration_b.held_from(peer_a) == 3, what="observations shared")
    assert calibration_a.held_from(peer_a) == 0  # its own echo is not fitted twice
    await a.close()
    await eventually(lambda: b.app[LOAD].peers() == [], within_s=5.0, what="expired")
    assert calibration_b.held_from(peer_a) == 0  # a's observations left with it


@pytest.mark.parametrize(
    ("url", "host", "port", "tls"),
    [
        ("redis+cluster://user:pw@h1:7000,h2:7001", "h1", 7000, False),
        ("rediss+cluster://h1:7000,h2:7001?ssl_cert_reqs=none", "h1", 7000, True),
        ("redis://x:6379/2", "x", 6379, False),
    ],
)
def test_the_load_plane_publishes_through_one_node(url: str, host: str, port: int, tls: bool) -> None:
    """On a Cluster a PUBLISH reaches every node's subscribers: one plain connection to the first seed serves."""
    client = load_plane_client(url)
    settings = client.connection_pool.connection_kwargs
    assert (settings["host"], settings["port"]) == (host, port)
    assert (client.connection_pool.connection_class.__name__ == "SSLConnection") is tls
    if "user:pw" in url:
        assert (settings["username"], settings["password"]) == ("user", "pw")
