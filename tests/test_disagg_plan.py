"""The P/D planner (kvrouter.routing.disagg): when a request is split, where each leg goes, and what each leg costs
the load book."""

from __future__ import annotations

from kvrouter.blocks import chain_keys
from kvrouter.config import Settings
from kvrouter.index import PrefixIndex
from kvrouter.policies import build_policy
from kvrouter.policies.base import ReplicaLoad
from kvrouter.routing.disagg import DisaggSettings, PdPlanner
from kvrouter.routing.load import LoadBook
from kvrouter.routing.router import Route, Router, RoutingFacts
from kvrouter.typedefs import EngineBlockHash, ReplicaName

BLOCK = 16
P0, P1, D0, D1 = (ReplicaName(name) for name in ("p0", "p1", "d0", "d1"))
ROUTES = [Route(P0, BLOCK, role="prefill"), Route(P1, BLOCK, role="prefill"), Route(D0, BLOCK, role="decode")]
ROUTES.append(Route(D1, BLOCK, role="decode"))


def planner(mode: str = "conditional", threshold: int = 256) -> tuple[PdPlanner, PrefixIndex, LoadBook]:
    index = PrefixIndex(provisional_ttl_s=5.0)
    load = LoadBook()
    router = Router(
        policy=build_policy("kv_aware", Settings(), clock=lambda: 0.0), load=load, index=index, clock=lambda: 0.0
    )
    return PdPlanner(router, DisaggSettings(mode, threshold)), index, load  # type: ignore[arg-type]


def facts(tokens: int, start: int = 1) -> RoutingFacts:
    return RoutingFacts([list(range(start, start + tokens))])


def cache(index: PrefixIndex, replica: ReplicaName, request: RoutingFacts) -> None:
    assert request.prompts is not None
    keys = chain_keys(request.prompts[0], BLOCK)
    index.store_keys(replica, [EngineBlockHash(i + 1) for i in range(len(keys))], keys)


def test_short_prompts_run_whole_on_a_decode_worker_and_long_ones_are_split() -> None:
    pd, _, _ = planner(threshold=256)
    short = pd.plan(facts(200), ROUTES)
    assert not short.split and short.reason == "short" and short.decode.chosen in (D0, D1)
    long = pd.plan(facts(2000), ROUTES)
    assert long.split and long.reason == "split" and long.local_uncached == 2000
    assert long.prefill is not None and long.prefill.chosen in (P0, P1) and long.decode.chosen in (D0, D1)


def test_a_prompt_mostly_cached_on_a_decode_worker_runs_there_whole() -> None:
    pd, index, _ = planner(threshold=256)
    turn = facts(2000)
    cache(index, D1, turn)
    plan = pd.plan(facts(2000), ROUTES)
    assert not plan.split and plan.decode.chosen == D1 and plan.local_uncached is not None
    assert plan.local_uncached < 256


def test_the_prefill_worker_is_chosen_by_its_cache() -> None:
    pd, index, _ = planner(mode="always")
    request = facts(4000)
    cache(index, P1, request)
    plan = pd.plan(request, ROUTES)
    assert plan.prefill is not None and plan.prefill.chosen == P1


def test_the_decode_worker_is_chosen_by_load_not_cache() -> None:
    pd, index, load = planner(mode="always")
    request = facts(4000)
    cache(index, D0, request)  # the cache would pull a KV-aware choice to d0...
    for _ in range(3):
        load.begin(D0, 0)  # ...but d0 has three requests in flight and d1 none
    plan = pd.plan(request, ROUTES)
    assert plan.split and plan.decode.chosen == D1


def test_a_decode_worker_with_a_nearly_full_cache_is_passed_over() -> None:
    pd, _, _ = planner(mode="always")
    ranker = pd.ranker
    from kvrouter.policies.base import Candidate, RouteRequest

    candidates = [Candidate(D0, 0, ReplicaLoad(in_flight=0, kv_usage=0.95)), Candidate(D1, 0, ReplicaLoad(in_flight=4))]
    assert ranker.select(RouteRequest(prompt_tokens=10), candidates).chosen == D1


def test_legs_charge_the_load_book_once_each() -> None:
    pd, _, load = planner(mode="always")
    request = facts(3000)
    plan = pd.plan(request, ROUTES)
    assert plan.prefill is not None
    prefill_route = next(r for r in ROUTES if r.name == plan.prefill.chosen)
    decode_route = next(r for r in ROUTES if r.name == plan.decode.chosen)
    prefill = pd.commit_prefill(plan, request, prefill_route, arrival=0.0)
    assert load.snapshot(prefill_route.name).pending_prefill_tokens == 3000
    decode = pd.commit_decode(plan, request, decode_route, arrival=0.0)
    snapshot = load.snapshot(decode_route.name)
    assert snapshot.in_flight == 1 and snapshot.pending_prefill_tokens == 0  # the KV arrives; nothing to compute
    prefill.first_token(0.5)
    prefill.finish(0.5)
    decode.first_token(0.6)
    decode.finish(1.0)
    assert load.snapshot(prefill_route.name).in_flight == 0 and load.snapshot(decode_route.name).in_flight == 0


def test_modes_off_and_fallbacks() -> None:
    pd, _, _ = planner(mode="off")
    assert pd.plan(facts(5000), ROUTES).reason == "off"
    pd, _, _ = planner(mode="always")
    decode_only = [r for r in ROUTES if r.role == "decode"]
    plan = pd.plan(facts(5000), decode_only)
    assert not plan.split and plan.reason == "no_prefill_worker" and plan.decode.chosen in (D0, D1)
    prefill_only = [r for r in ROUTES if r.role == "prefill"]
    plan = pd.plan(facts(5000), prefill_only)
    assert not plan.split and plan.reason == "no_decode_worker" and plan.decode.chosen in (P0, P1)
    unknown = pd.plan(RoutingFacts(None), ROUTES)
    assert unknown.split  # no tokenizer: the length is unknown, and `always` splits anyway
    pd, _, _ = planner(mode="conditional")
    assert pd.plan(RoutingFacts(None), ROUTES).split  # unknown length: split while a prefill worker is routable
