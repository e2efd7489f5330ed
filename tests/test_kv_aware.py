"""The kv_aware policy: TTFT estimate per replica, hot-spot guard, tie-breaks, prefill progress, purity."""

from __future__ import annotations

import pytest

from kvrouter.config import Settings
from kvrouter.policies import build_policy
from kvrouter.policies.base import Candidate, ReplicaLoad, RouteRequest
from kvrouter.policies.kv_aware import KvAwareConfig, KvAwarePolicy
from kvrouter.typedefs import ReplicaName

A, B, C = ReplicaName("a"), ReplicaName("b"), ReplicaName("c")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def cand(name: ReplicaName, cached: int = 0, *, in_flight: int = 0, pending: int = 0, decoding: int = 0) -> Candidate:
    load = ReplicaLoad(in_flight=in_flight, pending_prefill_tokens=pending, decode_requests=decoding)
    return Candidate(name, cached, load)


def policy(**overrides: float) -> KvAwarePolicy:
    return KvAwarePolicy(KvAwareConfig(**overrides), clock=FakeClock())  # type: ignore[arg-type]


def test_cached_replica_wins_when_queues_are_equal() -> None:
    decision = policy().select(RouteRequest(prompt_tokens=10_000), [cand(A), cand(B, 8192), cand(C, 4096)])
    assert decision.chosen == B


def test_queue_outweighs_cache() -> None:
    # B holds 8k of a 10k prompt but has 100k tokens of prefill queued: about 2 s, against 0.2 s on A.
    decision = policy().select(
        RouteRequest(prompt_tokens=10_000), [cand(A, in_flight=1), cand(B, 8192, in_flight=3, pending=100_000)]
    )
    assert decision.chosen == A
    scores = {s.replica: s for s in decision.candidates}
    assert scores[B].score > scores[A].score
    assert scores[A].breakdown["uncached_tokens"] == 10_000
    assert scores[B].breakdown["uncached_tokens"] == 10_000 - 8192


def test_score_is_an_estimate_in_seconds() -> None:
    decision = policy(
        prefill_tokens_per_s=10_000, decode_pass_s=0.0, decode_s_per_request=0.0, cache_weight=4.0
    ).select(RouteRequest(prompt_tokens=5_000), [cand(A, 1_000, pending=6_000)])
    (score,) = decision.candidates
    assert score.breakdown["ttft_estimate_s"] == pytest.approx((6_000 + 4_000) / 10_000)
    assert score.breakdown["prefill_s"] == pytest.approx(1.0)
    # The score takes off the affinity bonus: 3 more seconds' worth per 10k cached tokens at weight 4.
    assert score.breakdown["affinity_s"] == pytest.approx(3 * 1_000 / 10_000)
    assert score.score == pytest.approx(1.0 - 0.3)


def test_cache_affinity_weighs_cached_tokens_above_their_prefill_time() -> None:
    # B's estimate is worse (9k more queued tokens) but it holds 4k cached tokens: weight 1 picks A,
    # weight 4 keeps the request with its cache.
    request = RouteRequest(prompt_tokens=10_000)
    candidates = [cand(A, 0, pending=1_000), cand(B, 4_096, pending=10_000)]
    honest = policy(cache_weight=1.0, decode_pass_s=0.0, decode_s_per_request=0.0).select(request, candidates)
    assert honest.chosen == A
    pinned = policy(cache_weight=4.0, decode_pass_s=0.0, decode_s_per_request=0.0)
    assert pinned.select(request, candidates).chosen == B


def test_derived_cache_weight_is_one_plus_the_measured_reuse() -> None:
    kv = policy()
    assert kv.cache_weight == 1.0  # nothing seen yet: a cached token is worth its prefill time now
    # A request with 3k of its 4k prompt cached where it went: 3k reused for 1k computed.
    kv.record(kv.select(RouteRequest(prompt_tokens=4_000), [cand(A, 3_000)]))
    assert kv.reuse == pytest.approx(3.0)
    assert kv.cache_weight == pytest.approx(4.0)
    # Mostly cold traffic pulls it back toward 1; the breakdown shows the weight each decision used.
    for _ in range(20):
        kv.record(kv.select(RouteRequest(prompt_tokens=4_000), [cand(A)]))
    assert 1.0 < kv.cache_weight < 1.1
    decision = kv.select(RouteRequest(prompt_tokens=100), [cand(A)])
    assert decision.candidates[0].breakdown["cache_weight"] == pytest.approx(kv.cache_weight)


def test_decode_load_makes_a_replica_slower() -> None:
    decision = policy().select(
        RouteRequest(prompt_tokens=20_000), [cand(A, in_flight=40, decoding=40), cand(B, in_flight=4, decoding=4)]
    )
    scores = {s.replica: s for s in decision.candidates}
    assert decision.chosen == B
    assert scores[A].breakdown["decode_s"] > scores[B].breakdown["decode_s"] > 0
    assert scores[A].breakdown["passes"] == pytest.approx(20_000 / 8192)


def test_hot_spot_loses_its_cache_credit_only_for_itself() -> None:
    kv = policy(hotspot_ratio=1.5, hotspot_slack=2)
    request = RouteRequest(prompt_tokens=4_000)
    # Mean in flight is 10; A at 30 is over the cap (1.5 x 10 + 2 = 17) and its 3.9k cached tokens do not count.
    candidates = [cand(A, 3_968, in_flight=30), cand(B, 1_024, in_flight=0), cand(C, in_flight=0)]
    decision = kv.select(request, candidates)
    scores = {s.replica: s for s in decision.candidates}
    assert scores[A].breakdown["hot_spot"] == 1.0
    assert scores[A].breakdown["cache_credit_tokens"] == 0
    assert scores[A].cached_tokens == 3_968  # still reported: it is what the index believes
    assert scores[B].breakdown["hot_spot"] == 0.0
    assert scores[B].breakdown["cache_credit_tokens"] == 1_024
    assert decision.chosen == B
    # Below the cap the same replica keeps its credit and wins.
    calm = kv.select(request, [cand(A, 3_968, in_flight=12), cand(B, 1_024, in_flight=6), cand(C, in_flight=6)])
    assert calm.chosen == A


def test_ties_go_to_the_less_loaded_then_rotate() -> None:
    kv = policy(decode_pass_s=0.0, decode_s_per_request=0.0)
    request = RouteRequest(prompt_tokens=100)
    assert kv.select(request, [cand(A, in_flight=3), cand(B, in_flight=1)]).chosen == B
    chosen = []
    for _ in range(4):
        decision = kv.select(request, [cand(A), cand(B)])
        kv.record(decision)
        chosen.append(decision.chosen)
    assert set(chosen) == {A, B}


def test_select_is_a_dry_run() -> None:
    kv = policy()
    request = RouteRequest(prompt_tokens=9_000)
    candidates = [cand(A, 512, pending=20_000, in_flight=2), cand(B, pending=30_000, in_flight=2)]
    first = kv.select(request, candidates)
    assert kv.select(request, candidates) == first
    assert kv._lanes == {} and kv._turn == 0


def test_prefill_in_progress_comes_off_the_queue() -> None:
    clock = FakeClock()
    kv = KvAwarePolicy(
        KvAwareConfig(prefill_tokens_per_s=48_000, decode_pass_s=0.0, decode_s_per_request=0.0), clock=clock
    )
    big = RouteRequest(prompt_tokens=96_000)
    first = kv.select(big, [cand(A), cand(B, in_flight=1, pending=1)])
    assert first.chosen == A
    kv.record(first)
    # One second later A has computed about 48k of the 96k tokens the load book still counts as pending.
    clock.now += 1.0
    small = RouteRequest(prompt_tokens=1_000)
    decision = kv.select(small, [cand(A, in_flight=1, pending=96_000), cand(B, in_flight=1, pending=60_000)])
    scores = {s.replica: s for s in decision.candidates}
    assert scores[A].breakdown["prefill_in_progress_tokens"] == pytest.approx(48_000)
    assert scores[A].breakdown["queued_prefill_tokens"] == pytest.approx(48_000)
    assert decision.chosen == A
    # Progress never takes the whole request off: it is pending until its first token.
    clock.now += 10.0
    later = kv.select(small, [cand(A, in_flight=1, pending=96_000)])
    assert later.candidates[0].breakdown["queued_prefill_tokens"] > 0


def test_finished_prefills_leave_the_history() -> None:
    clock = FakeClock()
    kv = KvAwarePolicy(KvAwareConfig(decode_pass_s=0.0, decode_s_per_request=0.0), clock=clock)
    for tokens, pending in ((10_000, 0), (20_000, 10_000)):
        decision = kv.select(RouteRequest(prompt_tokens=tokens), [cand(A, pending=pending)])
        kv.record(decision)
    lane = kv._lanes[A]
    assert [t for _, t in lane.sent] == [10_000, 20_000]
    clock.now += 0.5
    # The first request reached its first token: only the second one's 20k are pending.
    kv.record(kv.select(RouteRequest(prompt_tokens=2), [cand(A, pending=20_000)]))
    assert [t for _, t in lane.sent] == [20_000, 2]
    assert lane.head_since == pytest.approx(100.25)


def test_no_tokenizer_routes_on_load() -> None:
    decision = policy().select(RouteRequest(prompt_tokens=None), [cand(A, in_flight=5, pending=9_000), cand(B)])
    assert decision.chosen == B


def test_factory_reads_the_kv_settings() -> None:
    kv = build_policy("kv_aware", Settings(kv_prefill_tokens_per_s=1234.0, kv_hotspot_slack=3.0))
    assert isinstance(kv, KvAwarePolicy)
    assert kv.config.prefill_tokens_per_s == 1234.0
    assert kv.config.hotspot_slack == 3.0
    assert kv.config.batch_tokens == Settings().kv_batch_tokens
    defaults = KvAwareConfig()
    settings = Settings()
    for name in KvAwareConfig.__dataclass_fields__:
        assert getattr(settings, f"kv_{name}") == getattr(defaults, name), name


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError):
        KvAwareConfig(prefill_tokens_per_s=0)
    with pytest.raises(ValueError):
        KvAwareConfig(hotspot_ratio=0)


def test_a_peers_prefill_in_progress_comes_off_the_queue_like_its_own() -> None:
    """With shared load, the request at the head of a replica's queue is often a peer instance's: its progress
    counts as this router's own would, or the replica looks busier to K routers than to one."""
    clock = FakeClock()
    config = KvAwareConfig(prefill_tokens_per_s=48_000, decode_pass_s=0.0, decode_s_per_request=0.0)
    own, peer = KvAwarePolicy(config, clock=clock), KvAwarePolicy(config, clock=clock)
    own.record(own.select(RouteRequest(prompt_tokens=96_000), [cand(A), cand(B, in_flight=1, pending=1)]))
    peer.peer_prefill(A, 96_000, 96_000, clock.now)  # the same dispatch, heard from the peer's report
    clock.now += 1.0
    small = RouteRequest(prompt_tokens=1_000)
    for kv in (own, peer):
        loaded = ReplicaLoad(in_flight=1, pending_prefill_tokens=96_000, peer_pending_prefill_tokens=96_000)
        decision = kv.select(small, [Candidate(A, 0, loaded)])
        assert decision.candidates[0].breakdown["prefill_in_progress_tokens"] == pytest.approx(48_000)
    # A peer's second request queues behind the first; when the first reaches its first token it leaves.
    peer.peer_prefill(A, 10_000, 106_000, clock.now)
    assert [t for _, t in peer._lanes[A].sent] == [96_000, 10_000]
    peer.peer_prefill(B, 5_000, 5_000, clock.now)
    peer.record(peer.select(small, [cand(A, pending=10_000), cand(B, pending=5_000)]))
    assert [t for _, t in peer._lanes[A].sent][:1] == [10_000]
    # A report that only fell (first tokens, finishes) adds nothing; the blind group's placeholders are no request.
    peer.peer_prefill(A, 0, 0, clock.now)
    assert [t for _, t in peer._lanes[A].sent][:1] == [10_000]
    guessed = ReplicaLoad(in_flight=2, pending_prefill_tokens=40_000, placeholder_prefill_tokens=30_000)
    clock.now += 0.1
    scored = peer.select(small, [Candidate(A, 0, guessed)]).candidates[0]
    assert 0 < scored.breakdown["prefill_in_progress_tokens"] < 10_000
    assert scored.breakdown["queued_prefill_tokens"] > 30_000


def test_a_dead_peers_requests_leave_the_record_with_its_load() -> None:
    """A peer that expires takes its pending prefill out of the load book; the next look drops its requests, so the
    record stays bounded by what is pending (plus the head) whatever the peers reported."""
    clock = FakeClock()
    kv = KvAwarePolicy(KvAwareConfig(decode_pass_s=0.0, decode_s_per_request=0.0), clock=clock)
    for tokens in (4_000_000, 30_000, 20_000):
        kv.peer_prefill(A, tokens, 4_050_000, clock.now)
    clock.now += 0.2
    kv.record(kv.select(RouteRequest(prompt_tokens=500), [cand(A, pending=0)]))
    lane = kv._lanes[A]
    assert [t for _, t in lane.sent] == [500] and lane.total == 500
