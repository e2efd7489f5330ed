"""The router queue's pure core: bands, tenant fairness, TTLs, lengths, starvation, saturation (kvrouter.flow)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.config import ConfigError, parse_fleet
from kvrouter.flow.classes import FlowClass
from kvrouter.flow.queue import OVERFLOW_TENANT, FlowQueue
from kvrouter.flow.saturation import SaturationRule
from kvrouter.flow.settings import BandConfig, FlowConfig
from kvrouter.policies.base import ReplicaLoad

HIGH, NORMAL, LOW = 0, 1, 2


def flow(band: int = NORMAL, tenant: str = "a", weight: float = 1.0) -> FlowClass:
    return FlowClass(band, tenant, weight, tenant)


def test_bands_are_strict_most_urgent_first() -> None:
    queue: FlowQueue[str] = FlowQueue(FlowConfig())
    queue.push("low", flow(LOW), 0.0)
    queue.push("normal", flow(NORMAL), 0.1)
    queue.push("high", flow(HIGH), 0.2)
    order = [waiter.payload for waiter in iter(lambda: queue.pop(1.0), None)]
    assert order == ["high", "normal", "low"]
    assert len(queue) == 0


def test_inside_a_band_the_tenant_with_less_service_goes_first() -> None:
    queue: FlowQueue[str] = FlowQueue(FlowConfig())
    for number in range(5):
        queue.push(f"a{number}", flow(tenant="a"), 0.0)
    queue.push("b0", flow(tenant="b"), 0.5)
    first = queue.pop(1.0)
    assert first is not None and first.payload == "a0"
    queue.charge(first.flow, 1000, 1.0)  # a was served 1,000 tokens: b (lifted to a's old counter, 0) goes next
    second = queue.pop(1.0)
    assert second is not None and second.payload == "b0"


def test_weights_share_service_in_proportion() -> None:
    config = FlowConfig()
    queue: FlowQueue[str] = FlowQueue(config)
    for number in range(300):
        queue.push(f"h{number}", flow(tenant="heavy", weight=2.0), 0.0)
        queue.push(f"l{number}", flow(tenant="light", weight=1.0), 0.0)
    served: Counter[str] = Counter()
    for _ in range(300):
        waiter = queue.pop(1.0)
        assert waiter is not None
        queue.charge(waiter.flow, 100, 1.0)
        served[waiter.flow.tenant] += 100
    assert served["heavy"] == pytest.approx(2 * served["light"], rel=0.02)


def test_with_vtc_counters_an_idle_tenant_banks_no_credit() -> None:
    """A tenant that arrives late starts level with the backlogged ones, not far ahead of them."""
    queue: FlowQueue[str] = FlowQueue(FlowConfig(fair_horizon_s=None))
    for number in range(20):
        queue.push(f"a{number}", flow(tenant="a"), 0.0)
        queue.push(f"b{number}", flow(tenant="b"), 0.0)
    for _ in range(20):
        waiter = queue.pop(1.0)
        assert waiter is not None
        queue.charge(waiter.flow, 100, 1.0)
    for number in range(20):
        queue.push(f"c{number}", flow(tenant="c"), 2.0)
    served: Counter[str] = Counter()
    for _ in range(15):
        waiter = queue.pop(3.0)
        assert waiter is not None
        queue.charge(waiter.flow, 100, 1.0)
        served[waiter.flow.tenant] += 1
    # Without the lift c would take all 15 (its counter 0 against a's and b's 1,000); with it they share.
    assert served["c"] <= 6 and served["a"] >= 4 and served["b"] >= 4


def test_with_decayed_counters_a_light_tenant_goes_first_until_level() -> None:
    queue: FlowQueue[str] = FlowQueue(FlowConfig(fair_horizon_s=30.0))
    now = 0.0
    for number in range(40):  # heavy is served alone for 20 s: 40 x 1,000 tokens
        queue.push(f"h{number}", flow(tenant="heavy"), now)
        waiter = queue.pop(now)
        assert waiter is not None
        queue.charge(waiter.flow, 1000, now)
        now += 0.5
    for number in range(10):
        queue.push(f"h-more{number}", flow(tenant="heavy"), now)
        queue.push(f"l{number}", flow(tenant="light"), now)
    order = [waiter.flow.tenant for waiter in iter(lambda: queue.pop(now), None)]
    # light has no recent use: its burst goes first while heavy's decayed use (~20k tokens) stays ahead of it.
    assert order[:10] == ["light"] * 10


def test_decay_forgets_old_use() -> None:
    queue: FlowQueue[str] = FlowQueue(FlowConfig(fair_horizon_s=10.0))
    queue.push("a", flow(tenant="a"), 0.0)
    first = queue.pop(0.0)
    assert first is not None
    queue.charge(first.flow, 1_000_000, 0.0)
    queue.push("b", flow(tenant="b"), 100.0)
    queue.charge(flow(tenant="b"), 100, 100.0)
    queue.push("a", flow(tenant="a"), 100.0)
    # After ten horizons a's million tokens weigh ~45: less than b's 100, so a goes first.
    nxt = queue.pop(100.0)
    assert nxt is not None and nxt.flow.tenant == "a"
    assert queue.position(queue.push("a2", flow(tenant="a"), 100.0), 100.0)["tenant_service"] < 100  # type: ignore[arg-type]


def test_starving_requests_get_their_share_of_dispatches_and_no_more() -> None:
    queue: FlowQueue[str] = FlowQueue(FlowConfig(starvation_s=5.0, starvation_share=0.25))
    for number in range(4):
        queue.push(f"low{number}", flow(LOW), 0.0)
    for number in range(12):
        queue.push(f"high{number}", flow(HIGH), 1.0)
    before = [queue.pop(4.0) for _ in range(3)]
    assert [waiter.payload for waiter in before if waiter is not None] == ["high0", "high1", "high2"]
    after = [waiter.payload for waiter in (queue.pop(6.0) for _ in range(8)) if waiter is not None]
    # Strict order (high) except every 4th dispatch, which goes to the oldest starving low.
    assert after == ["low0", "high3", "high4", "high5", "low1", "high6", "high7", "high8"]
    strict: FlowQueue[str] = FlowQueue(FlowConfig(starvation_s=5.0))
    strict.push("low", flow(LOW), 0.0)
    strict.push("high", flow(HIGH), 1.0)
    first = strict.pop(4.0)
    assert first is not None and first.payload == "high"


def test_ttl_and_length_limits() -> None:
    config = FlowConfig(bands=[BandConfig(name="only", ttl_s=2.0, max_queue=2)], default_band="only")
    queue: FlowQueue[str] = FlowQueue(config)
    assert queue.push("a", flow(0), 0.0) is not None
    assert queue.push("b", flow(0), 1.0) is not None
    assert queue.push("c", flow(0), 1.5) is None  # full
    assert queue.next_deadline() == 2.0
    gone = queue.expire(2.5)
    assert [waiter.payload for waiter in gone] == ["a"] and gone[0].state == "expired"
    assert len(queue) == 1 and queue.next_deadline() == 3.0
    assert queue.push("c", flow(0), 2.5) is not None


def test_a_cancelled_waiter_is_never_dispatched_and_frees_its_place() -> None:
    config = FlowConfig(bands=[BandConfig(name="only", max_queue=1)], default_band="only")
    queue: FlowQueue[str] = FlowQueue(config)
    waiter = queue.push("left", flow(0), 0.0)
    assert waiter is not None and queue.cancel(waiter)
    assert not queue.cancel(waiter)
    assert len(queue) == 0 and queue.pop(1.0) is None
    assert queue.push("next", flow(0), 1.0) is not None


def test_tenants_beyond_the_cap_share_one_fairness_id() -> None:
    queue: FlowQueue[str] = FlowQueue(FlowConfig(max_tenants=2))
    ids = [queue.push(name, flow(tenant=name), 0.0) for name in ("a", "b", "c", "d")]
    assert [waiter.fair_id for waiter in ids if waiter is not None] == ["a", "b", OVERFLOW_TENANT, OVERFLOW_TENANT]


def test_position_says_where_a_waiter_stands() -> None:
    queue: FlowQueue[str] = FlowQueue(FlowConfig())
    queue.push("h", flow(HIGH), 0.0)
    queue.push("a0", flow(tenant="a"), 0.0)
    second = queue.push("a1", flow(tenant="a"), 0.5)
    assert second is not None
    position = queue.position(second, 1.5)
    assert position["band"] == "normal" and position["ahead_in_tenant"] == 1
    assert position["queued_in_more_urgent_bands"] == 1 and position["waited_s"] == 1.0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["push", "pop", "cancel", "expire"]), st.integers(0, 2), st.sampled_from("abc")),
        max_size=80,
    )
)
def test_every_waiter_leaves_exactly_once(ops: list[tuple[str, int, str]]) -> None:
    """Whatever the sequence, each pushed waiter ends dispatched, expired, cancelled or still queued — once."""
    config = FlowConfig(starvation_s=3.0)
    queue: FlowQueue[int] = FlowQueue(config)
    pushed = []
    seen: Counter[int] = Counter()
    now = 0.0
    for number, (op, band, tenant) in enumerate(ops):
        now += 0.5
        if op == "push":
            waiter = queue.push(number, flow(band, tenant), now)
            if waiter is not None:
                pushed.append(waiter)
        elif op == "pop":
            popped = queue.pop(now)
            if popped is not None:
                seen[popped.payload] += 1
                queue.charge(popped.flow, 10 * (number % 7), now)
        elif op == "cancel" and pushed:
            if queue.cancel(pushed[number % len(pushed)]):
                seen[pushed[number % len(pushed)].payload] += 1
        elif op == "expire":
            for waiter in queue.expire(now + 40.0 * band):
                seen[waiter.payload] += 1
        assert len(queue) == sum(waiter.state == "queued" for waiter in pushed)
    for waiter in pushed:
        assert seen[waiter.payload] == (0 if waiter.state == "queued" else 1)


def test_saturation_needs_every_replica_over_its_threshold() -> None:
    rule = SaturationRule(prefill_tokens=8192, engine_waiting=4, kv_usage=0.9)
    busy = ReplicaLoad(pending_prefill_tokens=9000)
    assert rule.reason(busy) is not None
    assert rule.reason(busy, queued_tokens=100.0) is None  # the policy's estimate: most of it is computed
    assert rule.reason(ReplicaLoad(engine_waiting=4)) is not None
    assert rule.reason(ReplicaLoad(kv_usage=0.95)) is not None
    assert rule.saturated([(busy, None), (ReplicaLoad(engine_waiting=5), None)])
    assert not rule.saturated([(busy, None), (ReplicaLoad(pending_prefill_tokens=10), None)])
    assert not rule.saturated([])


def test_the_flow_section_is_validated_with_one_line_errors() -> None:
    replicas = [{"name": "a", "url": "http://127.0.0.1:1"}]
    fleet = parse_fleet({"replicas": replicas, "flow": {"tenants": {"team-a": {"weight": 3}}}}, Path("r.yaml"))
    assert fleet.flow.tenants["team-a"].weight == 3 and fleet.flow.default_band == "normal"
    bad = [
        ({"default_band": "urgent"}, "default_band 'urgent' is not one of the bands"),
        ({"bands": [{"name": "x"}, {"name": "x"}]}, "band names must be unique"),
        ({"hold_passes": 0}, "flow.hold_passes"),
        ({"tenants": {"bad name": {}}}, "tenant name 'bad name'"),
        ({"surprise": 1}, "flow.surprise"),
    ]
    for section, message in bad:
        with pytest.raises(ConfigError) as caught:
            parse_fleet({"replicas": replicas, "flow": section}, Path("r.yaml"))
        assert message in str(caught.value) and "\n" not in str(caught.value)


def test_predicted_wait_follows_the_dispatch_rate_while_backlogged() -> None:
    queue: FlowQueue[int] = FlowQueue(FlowConfig())
    assert queue.predicted_wait(flow()) is None  # nothing seen yet
    now = 0.0
    for number in range(40):
        queue.push(number, flow(), now)
        now += 0.5  # one dispatch every half second while one waits
        assert queue.pop(now) is not None
    idle_until = now + 100.0  # an idle hour does not slow the estimate: only backlogged time counts
    for number in range(5):
        queue.push(number, flow(), idle_until)
    predicted = queue.predicted_wait(flow())
    assert predicted == pytest.approx(6 * 0.5, rel=0.05)
    assert queue.predicted_wait(flow(LOW)) == pytest.approx(predicted)  # nothing queued in other bands
    queue.push(99, flow(HIGH), idle_until)
    assert queue.predicted_wait(flow(HIGH)) == pytest.approx(2 * 0.5, rel=0.05)
