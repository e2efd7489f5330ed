"""Replica state without a network: the breaker on a hand-moved clock, and reading vLLM's /metrics text."""

from __future__ import annotations

from kvrouter.config import ReplicaConfig
from kvrouter.server.replicas import BreakerPolicy, BreakerState, ReplicaState, parse_engine_gauges


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def replica(clock: Clock, failures: int = 3) -> ReplicaState:
    config = ReplicaConfig.model_validate({"name": "a", "url": "http://127.0.0.1:1"})
    return ReplicaState(config, 16, BreakerPolicy(failures, 1.0, 5.0), clock)


def test_breaker_opens_after_consecutive_failures() -> None:
    clock = Clock()
    state = replica(clock)
    assert not state.record_failure("x") and not state.record_failure("x")
    state.record_success()
    assert not state.record_failure("x") and not state.record_failure("x")
    assert state.routable
    assert state.record_failure("x")
    assert state.state is BreakerState.OPEN and not state.routable


def test_breaker_half_opens_then_backs_off_doubling_up_to_the_cap() -> None:
    clock = Clock()
    state = replica(clock, failures=1)
    state.record_failure("down")
    windows = []
    for _ in range(5):
        windows.append(state.open_until - clock.now)
        clock.now = state.open_until
        assert state.state is BreakerState.HALF_OPEN and state.routable
        assert state.record_failure("still down")
    assert windows == [1.0, 2.0, 4.0, 5.0, 5.0]
    clock.now = state.open_until
    state.record_success()
    assert state.state is BreakerState.CLOSED
    state.record_failure("down again")
    assert state.open_until - clock.now == 1.0  # a recovery resets the back-off


VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 99.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1e6
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
"""


def test_engine_gauges_sum_requests_and_average_usage() -> None:
    gauges = parse_engine_gauges(VLLM_METRICS)
    assert gauges is not None
    assert (gauges.running, gauges.waiting, gauges.kv_usage) == (4, 7, 0.375)


def test_engine_gauges_older_names_and_absence() -> None:
    old = 'vllm:gpu_cache_usage_perc{model_name="m"} 0.9\nvllm:num_requests_waiting 2\n'
    gauges = parse_engine_gauges(old)
    assert gauges is not None and (gauges.waiting, gauges.running, gauges.kv_usage) == (2, 0, 0.9)
    assert parse_engine_gauges("python_info 1\n# vllm:num_requests_waiting 3\n") is None


def test_half_open_lets_one_trial_through() -> None:
    clock = Clock()
    state = replica(clock, failures=1)
    state.record_failure("down")
    clock.now = state.open_until
    assert state.routable
    state.begin_attempt()
    assert not state.routable  # others wait for the trial's verdict
    state.end_attempt()  # the trial's client left: no verdict, another trial may go
    assert state.routable
    state.begin_attempt()
    state.record_success()
    assert state.state is BreakerState.CLOSED
    state.begin_attempt()
    assert state.routable  # closed: no trial bookkeeping
