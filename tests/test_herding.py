"""The blind group (kvrouter/routing/herding.py): instances that read the same stale shared load do not herd.

Pure core, no event loop: real `Router`s, `LoadBook`s and `LoadShare`s exchanging real encoded reports."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvrouter.policies.base import Candidate, Decision, ReplicaLoad, RouteRequest
from kvrouter.policies.kv_aware import KvAwareConfig, KvAwarePolicy
from kvrouter.routing.herding import BlindGroup, BlindGroupConfig
from kvrouter.routing.lifecycle import Routed
from kvrouter.routing.load import LoadBook
from kvrouter.routing.router import Route, Router, RoutingFacts
from kvrouter.routing.sharing import LoadShare
from kvrouter.typedefs import ReplicaName

REPLICAS = [ReplicaName(f"r{number}") for number in range(4)]
ROUTES = [Route(name, 16) for name in REPLICAS]
HORIZON = 0.05
NOTHING = Decision(REPLICAS[0], ())


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Instance:
    def __init__(self, name: str, clock: Clock, blind: bool) -> None:
        self.load = LoadBook()
        group = BlindGroup(BlindGroupConfig(horizon_s=HORIZON), random.Random(name)) if blind else None
        self.share = LoadShare(name, self.load, lambda: REPLICAS, blind_group=group)
        policy = KvAwarePolicy(KvAwareConfig(calibrate=False, tune=False), clock=clock)
        self.router = Router(policy=policy, load=self.load, listeners=[self.share], blind_group=group, clock=clock)

    def route_to_chosen(self, tokens: int) -> Routed:
        facts = RoutingFacts([[1] * tokens])
        decision = self.router.decide(facts, ROUTES)
        route = next(route for route in ROUTES if route.name == decision.chosen)
        return self.router.commit(decision, facts, route)


def exchange(instances: list[Instance], now: float) -> None:
    reports = [instance.share.report() for instance in instances]
    for instance in instances:
        for payload in reports:
            instance.share.receive(payload, now)


def bursts(blind: bool, count: int = 40, *, staggered: bool = False) -> list[list[str]]:
    """`count` bursts: four instances route one request each at the same instant; their reports arrive 10 ms after
    the last decision; each burst finishes before the next. Returns each burst's choices. They decide at once,
    blind to each other; `staggered`: each first waits its stagger and hears the reports that arrived meanwhile
    (the instance ranked r decides r horizons after the burst, having heard the ones before it)."""
    clock = Clock()
    instances = [Instance(name, clock, blind) for name in ("w", "x", "y", "z")]
    if staggered:
        exchange(instances, 0.0)  # every instance knows the others: ranked w, x, y, z
    seen = []
    for burst in range(count):
        start = burst * 1.0 + (1.0 if staggered else 0.0)
        routed = []
        for instance in instances:
            group = instance.router.blind_group
            clock.now = start
            if staggered and group is not None:
                clock.now += group.stagger_s()
                exchange(instances, clock.now)  # the earlier instances' reports have arrived
            routed.append(instance.route_to_chosen(8000))
        seen.append([str(request.replica) for request in routed])
        clock.now += 0.01
        exchange(instances, clock.now)
        clock.now += 0.5
        for request in routed:
            request.finish(clock.now)
        exchange(instances, clock.now)
    return seen


def crowding(burst: list[str]) -> int:
    """Requests on the burst's busiest replica (1: one each, as one router would place them; 4: all on one)."""
    return max(Counter(burst).values())


def test_without_the_blind_group_instances_with_the_same_stale_view_herd() -> None:
    assert all(crowding(burst) == 4 for burst in bursts(blind=False))


def test_with_the_blind_group_a_burst_spreads_over_the_replicas() -> None:
    spread = bursts(blind=True)
    # The first burst: nothing measured yet, the same herd. Then each instance has measured three blind peer
    # dispatches per decision and places them first from a random place: the burst spreads.
    assert crowding(spread[0]) == 4
    later = [crowding(burst) for burst in spread[1:]]
    assert sum(later) / len(later) < 2.5
    assert max(later) < 4 or later.count(4) <= 2
    assert sum(len(set(burst)) >= 3 for burst in spread[1:]) >= len(later) // 2
    assert bursts(blind=True) == spread  # seeded: the same draws, the same choices


def test_staggered_instances_decide_a_burst_in_rank_order_as_one_router_would() -> None:
    # Every burst: four requests, four replicas, one each (one router deciding them in turn does the same).
    assert all(crowding(burst) == 1 for burst in bursts(blind=True, count=12, staggered=True))


def test_the_stagger_is_the_rank_times_the_horizon_capped() -> None:
    group = BlindGroup(BlindGroupConfig(horizon_s=0.004), random.Random(0))
    assert group.stagger_s() == 0.0  # no rank known yet
    group.rank_among(0, 3)
    assert group.stagger_s() == 0.0
    group.rank_among(2, 3)
    assert group.stagger_s() == pytest.approx(0.008)
    group.retune(0.04)  # a slower plane: 80 ms, capped at the default 50 for the last rank
    assert group.stagger_s() == pytest.approx(0.05)
    group.rank_among(1, 3)  # the steps shrink alike: rank 1 still decides before rank 2
    assert group.stagger_s() == pytest.approx(0.025)
    group.waited(0.05)
    assert (group.staggered, group.stagger_seconds) == (1, pytest.approx(0.05))
    for config in (BlindGroupConfig(horizon_s=0.004, stagger_max_s=0.0), BlindGroupConfig(0.004, ranked=False)):
        unranked = BlindGroup(config, random.Random(0))
        unranked.rank_among(2, 3)
        assert unranked.stagger_s() == 0.0
    for bad in (-0.001, 1.5):
        with pytest.raises(ValueError):
            BlindGroupConfig(horizon_s=0.01, stagger_max_s=bad)


def test_a_staggering_instance_does_not_count_later_ranked_peers_as_blind() -> None:
    # Ranked first of three: the others wait longer and decide after seeing this instance's decisions.
    # Without the stagger, or with steps the cap cuts shorter than the horizon (0.03 / 2 < 0.02), they are.
    for stagger, counted in ((0.05, 1.0), (0.0, 4.0), (0.03, 4.0)):
        group = BlindGroup(BlindGroupConfig(horizon_s=0.02, window=4, stagger_max_s=stagger), random.Random(1))
        group.rank_among(1, 3)
        group.committed(NOTHING, 1000, 0.0)
        group.peer_dispatched(1, 0.01)  # ranked before: blind to each other
        group.peer_dispatched(3, 0.01, ranked_after=True)  # ranked after: blind only without the stagger
        assert group.expected_unseen(0.05) == pytest.approx(counted)


def test_the_blind_group_counts_peer_dispatches_inside_its_horizon_only() -> None:
    group = BlindGroup(BlindGroupConfig(horizon_s=0.02, window=4), random.Random(1))
    group.committed(NOTHING, 1000, 0.0)
    group.peer_dispatched(2, 0.0)  # the same instant: dispatched after this decision had been shared (instant)
    group.peer_dispatched(3, 0.01)  # blind to each other
    group.peer_dispatched(5, 0.03)  # outside the horizon: that peer had seen this decision
    assert group.expected_unseen(0.03) == pytest.approx(3.0)
    assert group.placeholder_tokens() == 1000
    group.committed(NOTHING, 3000, 1.0)
    assert group.expected_unseen(1.1) == pytest.approx(1.5)  # the second window saw nothing
    assert group.placeholder_tokens() == 2000


def test_with_nothing_unseen_the_decision_is_the_policy_own() -> None:
    clock = Clock()
    policy = KvAwarePolicy(KvAwareConfig(calibrate=False, tune=False), clock=clock)
    group = BlindGroup(BlindGroupConfig(horizon_s=HORIZON), random.Random(3))
    loads = [ReplicaLoad(in_flight=n, pending_prefill_tokens=4000 * n) for n in (3, 0, 2, 1)]
    candidates = [Candidate(name, 0, load) for name, load in zip(REPLICAS, loads, strict=True)]
    request = RouteRequest(prompt_tokens=5000)
    assert group.select(policy, request, candidates, 0.0) == policy.select(request, candidates)


def test_placeholders_go_ahead_by_load_and_a_strong_cache_hit_is_kept() -> None:
    clock = Clock()
    policy = KvAwarePolicy(KvAwareConfig(calibrate=False, tune=False), clock=clock)
    group = BlindGroup(BlindGroupConfig(horizon_s=HORIZON), random.Random(0))
    for _ in range(64):  # a history of 3 blind peer dispatches per decision, 4,000 uncached tokens each
        clock.now += 1.0
        group.committed(NOTHING, 4000, clock.now)
        group.peer_dispatched(3, clock.now + 0.01)
    clock.now += 1.0
    assert group.expected_unseen(clock.now) == pytest.approx(3.0)
    idle = [Candidate(name, 0, ReplicaLoad()) for name in REPLICAS]
    request = RouteRequest(prompt_tokens=4000)
    chosen = Counter()
    for _ in range(200):
        decision = group.select(policy, request, idle, clock.now)
        assert group.select(policy, request, idle, clock.now) == decision  # no side effects until committed
        chosen[decision.chosen] += 1
        ahead = decision.candidates[0].breakdown.get("blind_group_ahead", 0.0)
        placed = sum(score.breakdown.get("blind_placeholder_tokens", 0.0) for score in decision.candidates)
        assert placed == ahead * 4000
        group.committed(decision, 4000, clock.now)
        group.peer_dispatched(3, clock.now + 0.01)
        clock.now += 1.0
    # One router seeing the group of four would use all four idle replicas; so do the drawn places.
    assert set(chosen) == set(REPLICAS) and min(chosen.values()) >= 25
    # A request whose prompt is cached on r2 keeps it whatever its place: the placeholders load every replica alike.
    cached = [Candidate(name, 30_000 if name == REPLICAS[2] else 0, ReplicaLoad()) for name in REPLICAS]
    hit = RouteRequest(prompt_tokens=32_000)
    for _ in range(50):
        decision = group.select(policy, hit, cached, clock.now)
        assert decision.chosen == REPLICAS[2]
        group.committed(decision, 2000, clock.now)
        group.peer_dispatched(3, clock.now + 0.01)
        clock.now += 1.0


def test_a_burst_of_reported_dispatches_counts_at_most_a_group_cap() -> None:
    """A joining (or hostile) peer's report can show thousands in flight at once: no window counts beyond the cap."""
    group = BlindGroup(BlindGroupConfig(horizon_s=0.02, window=4, max_group=8), random.Random(2))
    group.committed(NOTHING, 1000, 0.0)
    group.peer_dispatched(100_000, 0.01)
    assert group.expected_unseen(0.1) == pytest.approx(8.0)
    assert group.ahead(0.1) <= 8


def test_the_placeholder_copies_keep_every_other_field() -> None:
    """The blind group copies candidates, loads and scores field by field (faster than `dataclasses.replace`): a
    field added to one of them must reach the copy, or the decision behind placeholders silently loses it."""
    from dataclasses import fields, replace

    from kvrouter.policies.base import CandidateScore
    from kvrouter.routing import herding

    def odd(cls: type) -> dict[str, object]:
        """A distinct, non-default value for every field of `cls` (a dataclass of numbers, names and loads)."""
        values: dict[str, object] = {}
        for number, field in enumerate(fields(cls), start=3):
            kind = str(field.type)
            if "ReplicaLoad" in kind:
                values[field.name] = ReplicaLoad(**odd(ReplicaLoad))  # type: ignore[arg-type]
            elif "Mapping" in kind:
                values[field.name] = {"x": float(number)}
            elif "ReplicaName" in kind or kind == "str":
                values[field.name] = f"name-{number}"
            elif "float" in kind:
                values[field.name] = number + 0.5
            else:
                values[field.name] = number
        return values

    load = ReplicaLoad(**odd(ReplicaLoad))  # type: ignore[arg-type]
    placed = replace(
        load,
        in_flight=load.in_flight + 2,
        pending_prefill_tokens=load.pending_prefill_tokens + 100,
        peer_pending_prefill_tokens=load.peer_pending_prefill_tokens + 100,
        placeholder_prefill_tokens=load.placeholder_prefill_tokens + 100,
    )
    assert herding._placed(load, 2, 100) == placed
    candidate = Candidate(**odd(Candidate))  # type: ignore[arg-type]
    assert herding._with_load(candidate, placed) == replace(candidate, load=placed)
    assert herding._bare(candidate) == replace(candidate, cached_tokens=0, cpu_tokens=0, storage_tokens=0)
    score = CandidateScore(**odd(CandidateScore))  # type: ignore[arg-type]
    assert herding._with_breakdown(score, {"y": 1.0}) == replace(score, breakdown={"y": 1.0})
