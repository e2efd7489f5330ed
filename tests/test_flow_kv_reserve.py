"""KV room for the more urgent bands (kvrouter.flow.kv_reserve): the reserve is the urgent bands' largest recent
prompt, a replica's free KV the router's estimate, and one band is never held."""

from __future__ import annotations

from kvrouter.flow.classes import FlowClass
from kvrouter.flow.kv_reserve import WINDOW_S, KvReserve
from kvrouter.flow.settings import FlowConfig
from kvrouter.policies.base import ReplicaLoad

HIGH, NORMAL, LOW = 0, 1, 2
CAPACITY = 100_000


def band(number: int) -> FlowClass:
    return FlowClass(number, "anonymous")


def test_the_reserve_is_the_more_urgent_bands_largest_recent_prompt() -> None:
    kv = KvReserve(3, CAPACITY)
    kv.arrived(band(HIGH), 30_000, now=0.0)
    kv.arrived(band(HIGH), 10_000, now=10.0)
    kv.arrived(band(NORMAL), 50_000, now=10.0)
    assert kv.reserve(HIGH, 10.0) == 0  # nothing is kept from the first band
    assert kv.reserve(NORMAL, 10.0) == 30_000
    assert kv.reserve(LOW, 10.0) == 50_000  # the normal band is more urgent than low
    assert kv.reserve(NORMAL, WINDOW_S + 5.0) == 10_000  # the 30k prompt left the window
    assert kv.reserve(NORMAL, WINDOW_S + 20.0) == 0


def test_one_band_is_never_held() -> None:
    kv = KvReserve(3, CAPACITY)
    kv.arrived(band(NORMAL), 90_000, now=0.0)
    full = ReplicaLoad(kv_usage=1.0, pending_prefill_tokens=50_000)
    assert kv.reserve(NORMAL, 1.0) == 0
    assert kv.open_bands([(full, True)], 1.0) == [True, True, False]  # only low would wait for normal's room


def test_free_kv_is_the_scraped_room_less_the_pending_prefill() -> None:
    kv = KvReserve(2, CAPACITY)
    assert kv.free_tokens(ReplicaLoad()) is None  # not scraped yet: unknown
    load = ReplicaLoad(kv_usage=0.6, pending_prefill_tokens=10_000)
    assert kv.free_tokens(load) == 30_000
    assert kv.keeps(load, 30_000) and not kv.keeps(load, 30_001)
    assert kv.keeps(ReplicaLoad(), 10**9)  # unknown counts as keeping it


def test_a_band_is_open_only_where_a_replica_with_room_keeps_the_reserve() -> None:
    kv = KvReserve(2, CAPACITY)
    kv.arrived(band(HIGH), 20_000, now=0.0)
    roomy_but_full = (ReplicaLoad(kv_usage=0.95), True)
    kv_free_but_busy = (ReplicaLoad(kv_usage=0.1), False)
    assert kv.open_bands([roomy_but_full, kv_free_but_busy], 1.0) == [True, False]
    assert kv.open_bands([(ReplicaLoad(kv_usage=0.7), True)], 1.0) == [True, True]


def test_the_flow_section_turns_it_on_and_takes_a_capacity() -> None:
    assert FlowConfig().band_kv_reserve is True and FlowConfig().kv_capacity_tokens is None
    assert FlowConfig(kv_capacity_tokens=1_048_576).kv_capacity_tokens == 1_048_576
