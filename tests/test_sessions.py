"""Session affinity hints: the table (LRU, TTL, forget), soft and sticky routing, the edge's session keys, and the
live router (a malformed x-session-id is a 400; a session follows its replica; /debug/route and /metrics show it)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvrouter.cli import main
from kvrouter.config import Settings
from kvrouter.loadgen.client import Replay, send
from kvrouter.loadgen.plan import WorkloadParams
from kvrouter.loadgen.stream import Dispatcher
from kvrouter.loadgen.stream import RequestRecord as StreamRecord
from kvrouter.loadgen.workloads import build_schedule
from kvrouter.openai_request import RequestError, parse_request
from kvrouter.policies.base import Candidate, Decision, ReplicaLoad, RouteRequest
from kvrouter.policies.kv_aware import KvAwareConfig, KvAwarePolicy
from kvrouter.replay.cli import replay_policy_object
from kvrouter.replay.driver import ReplayOptions, ReplayResult, VirtualClock, replay_policy
from kvrouter.replay.prompts import PromptCatalog
from kvrouter.replay.trace import conversations, load_trace
from kvrouter.routing.load import LoadBook
from kvrouter.routing.router import Route, Router, RoutingFacts
from kvrouter.routing.sessions import SessionTable
from kvrouter.server.session_keys import MAX_SESSION_ID_CHARS, session_key
from kvrouter.sim.mocker import DynamoMockerEngine
from kvrouter.typedefs import ReplicaName, SessionMode
from tests.conftest import ReplicaFactory, RouterFactory
from tests.shared_data import MOONCAKE_CONVERSATION, shared

A, B, C = ReplicaName("a"), ReplicaName("b"), ReplicaName("c")


# ---- the table -----------------------------------------------------------------------------------------------


def test_table_remembers_the_last_replica_until_the_ttl() -> None:
    table = SessionTable(ttl_s=10.0)
    assert table.replica_of("s", 0.0) is None
    table.remember("s", A, 0.0)
    table.remember("s", B, 1.0)
    assert table.replica_of("s", 5.0) == B
    assert table.replica_of("s", 10.9) == B
    assert table.replica_of("s", 11.0) is None  # idle a whole TTL since its last request
    assert table.replica_of(None, 0.0) is None


def test_table_is_a_bounded_lru() -> None:
    table = SessionTable(max_sessions=2)
    table.remember("x", A, 0.0)
    table.remember("y", A, 1.0)
    table.remember("x", B, 2.0)  # x is now the most recent
    table.remember("z", C, 3.0)
    assert len(table) == 2 and table.evicted == 1
    assert table.replica_of("y", 3.0) is None
    assert (table.replica_of("x", 3.0), table.replica_of("z", 3.0)) == (B, C)


def test_expired_sessions_leave_the_table_as_new_ones_arrive() -> None:
    table = SessionTable(ttl_s=5.0)
    for n in range(10):
        table.remember(f"old{n}", A, float(n) / 10)
    table.remember("new", B, 100.0)
    assert len(table) == 1


def test_forget_drops_a_replicas_sessions_only() -> None:
    table = SessionTable()
    table.remember("x", A, 0.0)
    table.remember("y", B, 0.0)
    table.forget(A)
    assert table.replica_of("x", 0.0) is None and table.replica_of("y", 0.0) == B


def test_reading_is_side_effect_free() -> None:
    table = SessionTable(max_sessions=2)
    table.remember("x", A, 0.0)
    table.remember("y", A, 1.0)
    table.replica_of("x", 2.0)  # a read does not make x recent
    table.remember("z", A, 3.0)
    assert table.replica_of("x", 3.0) is None


def test_bad_table_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        SessionTable(mode="always")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        SessionTable(max_sessions=0)


# ---- soft hints in kv_aware ----------------------------------------------------------------------------------


def kv(**overrides: Any) -> KvAwarePolicy:
    values: dict[str, Any] = {
        "prefill_tokens_per_s": 10_000.0,
        "decode_pass_s": 0.0,
        "decode_s_per_request": 0.0,
        "cache_weight": 1.0,
        "calibrate": False,
    }
    values.update(overrides)
    return KvAwarePolicy(KvAwareConfig(**values), clock=lambda: 0.0)


def cand(name: ReplicaName, cached: int = 0, pending: int = 0, in_flight: int = 0) -> Candidate:
    return Candidate(name, cached, ReplicaLoad(in_flight=in_flight, pending_prefill_tokens=pending))


def test_the_hint_wins_an_exact_tie() -> None:
    policy = kv()
    request = RouteRequest(prompt_tokens=1_000, session_replica=B)
    decision = policy.select(request, [cand(A), cand(B)])
    assert decision.chosen == B
    assert decision.without_hint == A  # the rotation would have picked a
    # And with no prompt length at all (no tokenizer), it still wins the tie.
    assert policy.select(RouteRequest(None, session_replica=B), [cand(A), cand(B)]).chosen == B


def test_the_hint_wins_a_small_difference_and_loses_a_clear_one() -> None:
    policy = kv(session_bonus=0.1)  # 10% of a 10,000-token prefill: 0.1 s
    request = RouteRequest(prompt_tokens=10_000, session_replica=B)
    small = policy.select(request, [cand(A), cand(B, pending=900)])  # b is 0.09 s behind
    assert small.chosen == B and small.without_hint == A
    scores = {s.replica: s for s in small.candidates}
    assert scores[B].breakdown["session_bonus_s"] == pytest.approx(0.1)
    assert scores[A].breakdown["session_bonus_s"] == 0.0
    clear = policy.select(request, [cand(A), cand(B, pending=1_100)])  # 0.11 s behind: clearly worse
    assert clear.chosen == A and clear.without_hint is None


def test_the_hint_is_not_counted_when_the_policy_agrees() -> None:
    decision = kv().select(RouteRequest(1_000, session_replica=B), [cand(A, pending=5_000), cand(B)])
    assert decision.chosen == B and decision.without_hint is None


def test_a_hot_replica_gets_no_hint_bonus() -> None:
    policy = kv(hotspot_ratio=1.0, hotspot_slack=0.0)
    decision = policy.select(RouteRequest(1_000, session_replica=B), [cand(A), cand(B, in_flight=4)])
    assert {s.replica: s for s in decision.candidates}[B].breakdown["session_bonus_s"] == 0.0
    assert decision.chosen == A


def test_the_bonus_scales_with_the_setting() -> None:
    zero = kv(session_bonus=0.0)
    request = RouteRequest(prompt_tokens=10_000, session_replica=B)
    assert zero.select(request, [cand(A), cand(B, pending=10)]).chosen == A
    large = kv(session_bonus=1.0)
    assert large.select(request, [cand(A), cand(B, pending=9_000)]).chosen == B


# ---- the router: soft, sticky, commit ------------------------------------------------------------------------


def make_router(mode: SessionMode, policy: KvAwarePolicy | None = None) -> tuple[Router, SessionTable]:
    table = SessionTable(mode=mode)
    return Router(policy=policy or kv(), load=LoadBook(), sessions=table, clock=lambda: 0.0), table


ROUTES = [Route(A, 16), Route(B, 16)]


def route_once(router: Router, facts: RoutingFacts, routes: Sequence[Route] = ROUTES) -> Decision:
    decision = router.decide(facts, routes)
    chosen = next(r for r in routes if r.name == decision.chosen)
    router.commit(decision, facts, chosen).finish(0.0)
    return decision


def test_soft_mode_follows_the_session_on_a_tie_and_counts_it() -> None:
    router, table = make_router("soft")
    facts = RoutingFacts(None, session="h:s1")
    first = route_once(router, facts)
    for _ in range(5):
        assert route_once(router, facts).chosen == first.chosen
    assert table.hinted_decisions == 5
    assert 1 <= table.changed_decisions <= 5  # the rotation would have moved it at least once
    assert len(table) == 1


def test_sticky_mode_keeps_the_replica_whatever_the_cost() -> None:
    router, _ = make_router("sticky")
    facts = RoutingFacts(None, session="h:s1")
    first = route_once(router, facts).chosen
    other = B if first == A else A
    # Load the session's replica heavily: soft would leave it, sticky does not.
    for _ in range(20):
        router.commit(router.decide(RoutingFacts(None), [Route(first, 16)]), RoutingFacts(None), Route(first, 16))
    decision = router.decide(facts, ROUTES)
    assert decision.chosen == first and decision.without_hint == other
    assert {s.replica: s for s in decision.candidates}[first].breakdown["session_sticky"] == 1.0
    # Its replica not routable (unhealthy, drained, tried): the policy chooses.
    assert router.decide(facts, [Route(other, 16)]).chosen == other


def test_soft_mode_leaves_a_loaded_session_replica() -> None:
    router, _ = make_router("soft")
    facts = RoutingFacts([[1] * 1000], session="h:s1")
    first = route_once(router, facts).chosen
    for _ in range(20):
        router.commit(router.decide(RoutingFacts(None), [Route(first, 16)]), RoutingFacts(None), Route(first, 16))
    pending = RoutingFacts([[2] * 50_000])
    router.commit(router.decide(pending, [Route(first, 16)]), pending, Route(first, 16))
    assert router.decide(facts, ROUTES).chosen != first


def test_a_request_without_a_session_is_untouched() -> None:
    router, table = make_router("sticky")
    route_once(router, RoutingFacts(None))
    assert len(table) == 0 and table.hinted_decisions == 0


def test_decide_is_a_dry_run() -> None:
    router, table = make_router("soft")
    router.decide(RoutingFacts(None, session="h:s1"), ROUTES)
    assert len(table) == 0


# ---- session keys at the edge --------------------------------------------------------------------------------

CHAT = parse_request("chat", b'{"messages": [{"role": "user", "content": "hi"}], "user": "alice"}')
PLAIN = parse_request("chat", b'{"messages": [{"role": "user", "content": "hi"}]}')


def test_session_key_sources() -> None:
    assert session_key("abc", CHAT, "both") == "h:abc"
    assert session_key(None, CHAT, "both") == "u:alice"
    assert session_key("", CHAT, "both") == "u:alice"  # an empty header counts as absent
    assert session_key("abc", CHAT, "user") == "u:alice"
    assert session_key(None, CHAT, "header") is None
    assert session_key("abc", CHAT, "off") is None
    assert session_key(None, PLAIN, "both") is None


@pytest.mark.parametrize(
    "header", ["x" * (MAX_SESSION_ID_CHARS + 1), "a\x00b", "tab\there", "del\x7f", "c1\x85"], ids=repr
)
def test_malformed_session_header_is_a_client_error(header: str) -> None:
    with pytest.raises(RequestError) as raised:
        session_key(header, PLAIN, "both")
    assert raised.value.status == 400 and raised.value.code == "invalid_session_id"


def test_user_field_keys() -> None:
    long_user = parse_request("completion", json.dumps({"prompt": "x", "user": "u" * 1000}).encode())
    key = session_key(None, long_user, "user")
    assert key is not None and key.startswith("u#") and len(key) < 40
    not_a_string = parse_request("completion", b'{"prompt": "x", "user": 7}')
    with pytest.raises(RequestError) as raised:
        session_key(None, not_a_string, "user")
    assert raised.value.param == "user"
    assert session_key(None, not_a_string, "header") is None  # not read, not judged


# ---- live ----------------------------------------------------------------------------------------------------

BODY = {"model": "m", "prompt": "hello", "max_tokens": 2}


async def test_live_malformed_header_gets_openai_400(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    replicas = await fake_replicas(1)
    client = await make_router(replicas)
    response = await client.post("/v1/completions", json=BODY, headers={"x-session-id": "s" * 300})
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_session_id"
    assert "x-request-id" in response.headers
    assert replicas[0].seen == []
    ok = await client.post("/v1/completions", json=BODY)  # absent is fine
    assert ok.status == 200


async def test_live_sticky_session_stays_on_its_replica(
    fake_replicas: ReplicaFactory, make_router: RouterFactory
) -> None:
    replicas = await fake_replicas(3)
    client = await make_router(replicas, session_mode="sticky")  # round_robin underneath: it would rotate
    served = []
    for _ in range(4):
        response = await client.post("/v1/completions", json=BODY, headers={"x-session-id": "agent-7"})
        assert response.status == 200
        served.append(response.headers["x-kvrouter-replica"])
        await response.read()
    assert len(set(served)) == 1
    rotated = []
    for _ in range(3):
        response = await client.post("/v1/completions", json=BODY)
        rotated.append(response.headers["x-kvrouter-replica"])
        await response.read()
    assert len(set(rotated)) > 1  # without the header: the policy spreads them
    debug = await client.post("/debug/route", json=BODY, headers={"x-session-id": "agent-7"})
    shown = await debug.json()
    assert shown["session_mode"] == "sticky" and shown["session_replica"] == served[0]
    assert shown["chosen"] == served[0]
    row = next(c for c in shown["candidates"] if c["replica"] == served[0])
    assert row["session_sticky"] == 1.0
    text = await (await client.get("/metrics")).text()
    assert "kvrouter_sessions_tracked 1.0" in text
    assert "kvrouter_session_hinted_decisions_total 3.0" in text


async def test_live_soft_hint_shows_its_term(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    replicas = await fake_replicas(2)
    client = await make_router(replicas, policy="kv_aware")
    first = await client.post("/v1/completions", json=BODY, headers={"x-session-id": "chat-1"})
    replica = first.headers["x-kvrouter-replica"]
    await first.read()
    debug = await client.post("/debug/route", json=BODY, headers={"x-session-id": "chat-1"})
    shown = await debug.json()
    assert shown["session_mode"] == "soft" and shown["session_replica"] == replica
    terms = {c["replica"]: c["session_bonus_s"] for c in shown["candidates"]}
    assert terms[replica] > 0 and all(v == 0 for name, v in terms.items() if name != replica)
    assert shown["chosen"] == replica


async def test_sessions_off_reads_no_header(fake_replicas: ReplicaFactory, make_router: RouterFactory) -> None:
    replicas = await fake_replicas(1)
    client = await make_router(replicas, session_mode="off")
    response = await client.post("/v1/completions", json=BODY, headers={"x-session-id": "s" * 300})
    assert response.status == 200
    assert "kvrouter_sessions_tracked" not in await (await client.get("/metrics")).text()


# ---- replay --------------------------------------------------------------------------------------------------


def test_conversations_are_requests_sharing_their_first_two_blocks(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1500, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 10, "input_length": 2000, "output_length": 5, "hash_ids": [0, 1, 2, 3]},
        {"timestamp": 20, "input_length": 1500, "output_length": 5, "hash_ids": [0, 4, 5]},  # same system prompt
        {"timestamp": 30, "input_length": 300, "output_length": 5, "hash_ids": [0]},  # too short to tell
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    keys = conversations(load_trace(path))
    assert keys[0] == keys[1] != keys[2]
    assert 3 not in keys


def replay_sessions(mode: SessionMode, limit: int = 600) -> ReplayResult:
    trace = load_trace(shared(MOONCAKE_CONVERSATION), speedup=2.5, limit=limit)
    catalog = PromptCatalog(trace_block_tokens=trace.block_tokens, block_size=64)
    prompts = [catalog.prepare(request) for request in trace.requests]
    clock = VirtualClock()
    options = ReplayOptions(sessions=conversations(trace), session_mode=mode)
    return replay_policy(
        requests=trace.requests,
        prompts=prompts,
        catalog=catalog,
        policy=replay_policy_object("kv_aware", Settings(), clock),
        engine_factory=DynamoMockerEngine,
        options=options,
        clock=clock,
    )


def test_replay_sticky_keeps_each_conversation_on_one_engine() -> None:
    trace = load_trace(shared(MOONCAKE_CONVERSATION), speedup=2.5, limit=600)
    keys = conversations(trace)
    result = replay_sessions("sticky")
    engines: dict[str, set[str]] = {}
    for record in result.records:
        if record.index in keys:
            engines.setdefault(keys[record.index], set()).add(record.replica)
    assert all(len(used) == 1 for used in engines.values())
    assert result.sessions["hinted_decisions"] > 0 and result.sessions["tracked"] == len(engines)


def test_replay_soft_hints_change_some_decisions_and_off_none() -> None:
    soft = replay_sessions("soft")
    assert 0 < soft.sessions["changed_decisions"] <= soft.sessions["hinted_decisions"]
    assert replay_sessions("off").sessions == {}


def test_replay_cli_rows_per_session_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = str(shared(MOONCAKE_CONVERSATION))
    args = ["replay", trace, "--policies", "kv_aware", "--limit", "150", "--no-floor", "--jobs", "1"]
    assert main([*args, "--sessions", "off,soft,sticky", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [row["policy"] for row in printed["rows"]] == ["kv_aware", "kv_aware+soft", "kv_aware+sticky"]
    assert set(printed["replay"]["sessions"]) == {"kv_aware+soft", "kv_aware+sticky"}
    assert main([*args, "--sessions", "always"]) == 2


def test_load_generator_sends_the_session_key_when_asked() -> None:
    seen: list[dict[str, str]] = []

    class Refused:
        status_code = 503
        text = "no"
        headers: dict[str, str] = {}

        def __enter__(self) -> Refused:
            return self

        def __exit__(self, *_: object) -> None:
            return None

    def post(path: str, **kwargs: Any) -> Refused:
        seen.append(kwargs["headers"])
        return Refused()

    sessions = build_schedule("agentic", WorkloadParams(duration_s=5, rate=1, system_tokens=50, turns=2))
    planned = sessions[0].requests[0]
    for header in (False, True):
        replay = Replay(Dispatcher(sessions), "m", 5.0, session_header=header)
        send(post, replay, planned, StreamRecord(planned.label, sessions[0].key, 0, 0.0, 0.0))
    assert "x-session-id" not in seen[0]
    assert seen[1]["x-session-id"] == sessions[0].key == "agent-0"
