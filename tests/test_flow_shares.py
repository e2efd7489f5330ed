"""Headroom for light tenants (kvrouter.flow.shares): a heavy tenant cannot fill the light tenants' unused share
of the prefill budget; with one tenant nothing changes."""

from __future__ import annotations

from typing import cast

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.flow.classes import FlowClass
from kvrouter.flow.queue import FlowQueue
from kvrouter.flow.saturation import SaturationRule
from kvrouter.flow.settings import FlowConfig
from kvrouter.flow.shares import BandShares, TenantShares, both
from kvrouter.policies.base import ReplicaLoad
from kvrouter.routing.lifecycle import Routed

NORMAL = 1
BUDGET = 4_000.0


def flow(tenant: str, weight: float = 1.0) -> FlowClass:
    return FlowClass(NORMAL, tenant, weight, tenant)


class FakeRouted:
    """What the book reads of a routed request."""

    def __init__(self, prompt_tokens: int, predicted_cached: int = 0) -> None:
        self.prompt_tokens = prompt_tokens
        self.predicted_cached = predicted_cached


def dispatch(shares: TenantShares, tenant: str, tokens: int, now: float = 0.0, weight: float = 1.0) -> Routed:
    """A request of `tenant` arrives and goes to a replica."""
    routed = cast(Routed, FakeRouted(tokens))
    shares.arrived(flow(tenant, weight), tokens, now)
    shares.routed(routed, flow(tenant, weight))
    return routed


def test_one_tenant_is_never_held() -> None:
    shares = TenantShares()
    dispatch(shares, "a", 10_000)
    assert shares.eligible(BUDGET, 0.0, {}) is None
    assert shares.eligible(BUDGET, 0.0, {"a": 1.0}) is None


def test_a_heavy_tenant_waits_while_the_room_is_the_light_tenants_reserve() -> None:
    shares = TenantShares()
    dispatch(shares, "noisy", 9_000)  # noisy sent 9,000 prompt tokens, light 1,000
    light = dispatch(shares, "light", 1_000)
    shares.on_first_token(light, 0.1)  # light's prefill is done: its whole share (2,000 of 4,000) is in reserve
    eligible = shares.eligible(BUDGET, 1_500.0, {})
    assert eligible is not None
    assert not eligible(flow("noisy")) and eligible(flow("light"))
    assert eligible(flow("newcomer"))  # a tenant with nothing running is not heavy
    assert shares.eligible(BUDGET, 2_500.0, {}) is None  # more room than the reserve: everyone goes
    # The light tenant uses its share: the reserve shrinks by what it has queued.
    dispatch(shares, "light", 1_500)
    assert shares.eligible(BUDGET, 600.0, {}) is None


def test_heaviness_is_what_a_tenant_sent_lately_by_weight() -> None:
    shares = TenantShares(horizon_s=10.0)
    dispatch(shares, "a", 4_000, now=0.0)
    dispatch(shares, "b", 1_000, now=0.0)
    held = shares.eligible(BUDGET, 0.0, {})
    assert held is not None and not held(flow("a")) and held(flow("b"))
    # With a weight of 8, a's 4,000 tokens are half of b's 1,000 per weight: b is the heavy one.
    weighted = TenantShares(horizon_s=10.0)
    dispatch(weighted, "a", 4_000, weight=8.0)
    dispatch(weighted, "b", 1_000)
    held = weighted.eligible(BUDGET, 0.0, {})
    assert held is not None and held(flow("a", weight=8.0)) and not held(flow("b"))
    # What was sent long ago fades: 200 s later b's new 1,000 tokens outweigh a's 4,000.
    dispatch(shares, "b", 1_000, now=200.0)
    later = shares.eligible(BUDGET, 0.0, {})
    assert later is not None and later(flow("a")) and not later(flow("b"))


def test_a_tenant_leaves_the_active_set_when_its_last_request_ends() -> None:
    shares = TenantShares()
    heavy = dispatch(shares, "heavy", 9_000)
    light = dispatch(shares, "light", 100)
    assert shares.eligible(BUDGET, 0.0, {}) is not None
    shares.on_finish(light, 1.0)
    assert "light" not in shares.weights and shares.eligible(BUDGET, 0.0, {}) is None
    # ... unless it waits in the queue: waiting tenants are active too.
    assert shares.eligible(BUDGET, 0.0, {"light": 1.0}) is not None
    shares.on_finish(heavy, 2.0)
    assert shares.weights == {} and shares.queued_prefill == {}


def test_the_queue_skips_held_tenants_and_so_does_the_starvation_guard() -> None:
    queue: FlowQueue[str] = FlowQueue(FlowConfig(starvation_share=1.0))
    queue.push("noisy-0", flow("noisy"), 0.0)
    queue.push("light-0", flow("light"), 20.0)
    assert queue.waiting_weights() == {"noisy": 1.0, "light": 1.0}
    light_only = lambda candidate: candidate.tenant == "light"  # noqa: E731
    # noisy-0 has starved (20 s) and the guard serves every starving head, but not a held one.
    first = queue.pop(20.0, light_only)
    assert first is not None and first.payload == "light-0"
    assert queue.pop(20.0, light_only) is None
    second = queue.pop(20.0)
    assert second is not None and second.payload == "noisy-0"


def test_room_is_the_budget_left_on_each_replica() -> None:
    rule = SaturationRule(prefill_tokens=1_000)
    loads = [
        (ReplicaLoad(pending_prefill_tokens=400), None),
        (ReplicaLoad(pending_prefill_tokens=5_000), None),
        (ReplicaLoad(pending_prefill_tokens=5_000), 900.0),  # the policy's estimate wins
    ]
    assert rule.room(loads) == 600 + 0 + 100


def test_being_held_back_does_not_make_a_heavy_tenant_light() -> None:
    # Heaviness follows what a tenant sends, not what it is served: a held tenant's waiting requests count.
    shares = TenantShares()
    light = dispatch(shares, "light", 1_000)
    shares.on_first_token(light, 0.1)
    for _ in range(5):
        shares.arrived(flow("noisy"), 2_000, 0.2)  # sent, all waiting: nothing of it was served
    held = shares.eligible(BUDGET, 1_000.0, {"noisy": 1.0})
    assert held is not None and not held(flow("noisy")) and held(flow("light"))


# -- headroom for the more urgent bands (BandShares) -------------------------------------------------------------

HIGH, LOW = 0, 2


def band_flow(band: int) -> FlowClass:
    return FlowClass(band, "anonymous")


def send(bands: BandShares, band: int, tokens: int, now: float = 0.0) -> Routed:
    """A request of `band` arrives and goes to a replica."""
    routed = cast(Routed, FakeRouted(tokens))
    bands.arrived(band_flow(band), tokens, now)
    bands.routed(routed, band_flow(band))
    return routed


def test_one_band_is_never_held() -> None:
    bands = BandShares(3)
    send(bands, NORMAL, 50_000)
    assert not bands.may_hold(NORMAL) and not bands.may_hold(HIGH) and bands.may_hold(LOW)
    assert bands.eligible(BUDGET, 0.0) is None  # the only band sending has nothing before it
    assert bands.reserves(BUDGET) == [0.0, 0.0, 0.0]


def test_a_band_waits_while_the_room_is_the_more_urgent_bands_reserve() -> None:
    bands = BandShares(3)
    urgent = send(bands, HIGH, 2_000)  # high sent 20% of the prompt tokens
    send(bands, NORMAL, 8_000)
    assert bands.may_hold(NORMAL)
    # High's share of the budget (800 of 4,000) less its own queued prefill (2,000): nothing in reserve yet.
    assert bands.eligible(BUDGET, 100.0) is None
    bands.on_first_token(urgent, 0.1)  # its prefill is done: its whole share is in reserve
    eligible = bands.eligible(BUDGET, 500.0)
    assert eligible is not None
    assert eligible(band_flow(HIGH)) and not eligible(band_flow(NORMAL)) and not eligible(band_flow(LOW))
    assert bands.eligible(BUDGET, 900.0) is None  # more room than the reserve: every band goes
    # The low band's reserve is the high and the normal band's shares (normal's own prefill still queued).
    assert bands.reserves(BUDGET) == [0.0, 800.0, 800.0]


def test_a_band_that_stopped_sending_is_no_longer_held_for() -> None:
    bands = BandShares(2)
    urgent = send(bands, HIGH, 2_000, now=0.0)
    bands.on_finish(urgent, 1.0)
    send(bands, NORMAL, 8_000, now=1.0)
    assert bands.reserves(BUDGET)[NORMAL] > 0
    send(bands, NORMAL, 8_000, now=3_000.0)  # 100 time constants later, past the rebase: high's share is gone
    assert not bands.may_hold(NORMAL)
    assert bands.eligible(BUDGET, 0.0) is None


def test_both_combines_predicates() -> None:
    assert both(None, None) is None
    only_high = BandShares(2)
    send(only_high, HIGH, 1_000)
    assert both(None, lambda flow: flow.band == 0) is not None
    combined = both(lambda flow: flow.tenant == "a", lambda flow: flow.band == 0)
    assert combined is not None
    assert combined(FlowClass(0, "a")) and not combined(FlowClass(1, "a")) and not combined(FlowClass(0, "b"))


def test_the_flow_section_keeps_band_headroom_off_by_default() -> None:
    assert FlowConfig().band_headroom is False
    assert FlowConfig(band_headroom=True).band_headroom is True


# -- the request path's O(1) answer ---------------------------------------------------------------------------

EVENTS = st.lists(
    st.tuples(
        st.sampled_from(["dispatch", "arrive", "first", "finish", "ask"]),
        st.integers(0, 5),  # tenant
        st.sampled_from([0, 1, 1, 50, 1_000, 1_000, 9_000]),  # prompt tokens: equal sends make ties
        st.sampled_from([1.0, 1.0, 2.0, 0.5, 3.0]),  # weight
        st.floats(0.0, 2.0),  # time step
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(EVENTS, st.sampled_from([0.0, 4_000.0, 65_536.0]), st.lists(st.floats(0.0, 1.2), min_size=3, max_size=3))
def test_admits_answers_as_the_scan_does(
    events: list[tuple[str, int, int, float, float]], budget: float, rooms: list[float]
) -> None:
    shares = TenantShares(horizon_s=5.0)  # short, so the totals are rescaled (and summed afresh) along the way
    running: dict[int, list[Routed]] = {}
    weights: dict[int, float] = {}
    now = 0.0
    answered = 0
    for kind, tenant, tokens, weight, step in events:
        now += step * 20
        name = f"t{tenant}"
        weight = weights.setdefault(tenant, weight) if running.get(tenant) else weight
        if kind == "dispatch":
            weights[tenant] = weight
            running.setdefault(tenant, []).append(dispatch(shares, name, tokens, now, weight))
        elif kind == "arrive":
            shares.arrived(flow(name, weight), tokens, now)
        elif kind == "first" and running.get(tenant):
            shares.on_first_token(running[tenant][0], now)
        elif kind == "finish" and running.get(tenant):
            shares.on_finish(running[tenant].pop(0), now)
        for fraction in rooms:
            room = budget * fraction
            eligible = shares.eligible(budget, room, {})
            for asked in range(7):
                expected = eligible is None or eligible(flow(f"t{asked}"))
                got = shares.admits(f"t{asked}", budget, room)
                assert got is None or got == expected
                answered += got is not None
    assert not events or answered > 0


def test_admits_defers_only_near_a_tie() -> None:
    shares = TenantShares()
    dispatch(shares, "a", 1_000)
    dispatch(shares, "b", 1_000)  # a tie: whether a is heavy is the scan's rounding
    assert shares.admits("a", BUDGET, 0.0) is None
    dispatch(shares, "c", 10)
    assert shares.admits("c", BUDGET, 0.0) is True  # clearly light
    assert shares.admits("a", BUDGET, BUDGET) is True  # heavy, but the room exceeds any reserve
    assert shares.admits("a", BUDGET, 0.0) is None  # heavy and the room is small: the scan decides
    assert shares.admits("newcomer", BUDGET, 0.0) is True


class CountingDict(dict[str, float]):
    """A dict that counts the walks over it."""

    walks = 0

    def items(self):  # type: ignore[no-untyped-def]
        self.walks += 1
        return super().items()

    def values(self):  # type: ignore[no-untyped-def]
        self.walks += 1
        return super().values()

    def __iter__(self):  # type: ignore[no-untyped-def]
        self.walks += 1
        return super().__iter__()


def test_admits_does_not_walk_the_tenants() -> None:
    # With a thousand active tenants, a call reads the asking tenant's entries and the running totals only.
    shares = TenantShares()
    shares.weights = CountingDict()
    for n in range(1_000):
        dispatch(shares, f"t{n}", 100 + n)
    answers = [shares.admits(f"t{n}", BUDGET, BUDGET) for n in range(1_000)]
    assert all(answers)
    assert shares.weights.walks <= 1  # at most one summing afresh
