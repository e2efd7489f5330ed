"""The upstream rules without a network: whose failure closes which breaker, the pass-through allow-list, and the
engine token counters that count as progress (issue 15, upstream side)."""

from __future__ import annotations

from kvrouter.config import DEFAULT_PASSTHROUGH_PATHS
from kvrouter.server.proxy import PathAllowList
from kvrouter.server.replicas import BreakerState, engine_token_total
from tests.test_proxy_replicas import Clock, replica


def test_a_stall_opens_the_breaker_at_once_and_only_a_request_closes_it() -> None:
    clock = Clock()
    state = replica(clock)
    assert state.record_stall("no first byte")
    assert state.state is BreakerState.OPEN and state.stalled
    state.record_success(probe=True)  # /health says 200 while the engine hangs
    assert state.state is BreakerState.OPEN
    clock.now += 1.0
    assert state.state is BreakerState.HALF_OPEN and state.routable
    state.record_success(probe=True)
    assert state.state is BreakerState.HALF_OPEN
    state.begin_attempt()
    state.record_success()  # the half-open trial, a real request, came back
    assert state.state is BreakerState.CLOSED and not state.stalled and not state.probe_blind


def test_probe_successes_do_not_erase_failures_a_probe_cannot_see() -> None:
    clock = Clock()
    state = replica(clock)
    state.record_failure("answered 500", probe_blind=True)
    state.record_success(probe=True)
    state.record_failure("answered 500", probe_blind=True)
    state.record_success(probe=True)
    assert state.record_failure("answered 500", probe_blind=True)
    state.record_success(probe=True)
    assert state.state is BreakerState.OPEN


def test_a_breaker_opened_by_connect_errors_is_closed_by_a_passing_probe() -> None:
    clock = Clock()
    state = replica(clock, failures=1)
    assert state.record_failure("ClientConnectorError")
    state.record_success(probe=True)  # the restarted replica answers /health again
    assert state.state is BreakerState.CLOSED


def test_the_allow_list_matches_raw_paths_exactly_or_plain_sub_paths() -> None:
    allowed = PathAllowList(DEFAULT_PASSTHROUGH_PATHS)
    for path in ("/tokenize", "/detokenize", "/v1/embeddings", "/v1/responses", "/v1/responses/resp_1/cancel"):
        assert allowed.allows(path), path
    refused = ["/reset_prefix_cache", "/sleep", "/collective_rpc", "/tokenize/", "/tokenize/x", "//tokenize", "*"]
    refused += ["/v1/responses/", "/v1/responses/../sleep", "/v1/responses/%2e%2e/sleep", "/v1/responses/a/../../x"]
    refused += ["/v1/responses/.hidden", "/v1/responses/a//b", "/TOKENIZE", "/v1/chat/completions/../../sleep"]
    for path in refused:
        assert not allowed.allows(path), path
    assert PathAllowList([]).allows("/tokenize") is False


def test_engine_token_counters_are_summed_over_series() -> None:
    text = "\n".join(
        [
            "# TYPE vllm:prompt_tokens_total counter",
            'vllm:prompt_tokens_total{engine="0",model_name="m"} 100.0',
            'vllm:prompt_tokens_total{engine="1",model_name="m"} 50.0',
            'vllm:generation_tokens_total{engine="0",model_name="m"} 7.0',
            'vllm:prompt_tokens_total_created{engine="0"} 1.7e9',
            "vllm:generation_tokens_total garbage",
        ]
    )
    assert engine_token_total(text) == 157.0
    assert engine_token_total("vllm:num_requests_waiting 3\n") is None
