"""Deterministic workloads: a seed and a few knobs in, a schedule of sessions out.

A schedule is a list of `Session`s sorted by `start_s` (seconds after the test starts; arrivals are open-loop).
A session is one or more requests sent one after another on the same conversation: request k+1 is sent
`think_s` after request k finished, so histories grow the way real chats and agents grow theirs. The assistant
turns inside a history are written by the workload, not taken from the engine's output, so every policy under
test receives byte-identical requests.

Workloads (`WORKLOADS`):
* ``multi-tenant`` — `tenants` tenants (Zipf popularity, exponent `tenant_skew`), each with a system prompt of
  about `system_tokens` tokens plus tool schemas; one short user turn per request.
* ``multi-turn`` — chat sessions of `turns` turns on a shared system prompt (one of `tenants`), each turn adding
  a user message (~`user_tokens`) and the previous assistant reply (~`output_tokens`).
* ``agentic`` — an agent loop: a task, then `turns` steps, each appending an assistant tool call and a long tool
  result (~`tool_result_tokens`).
* ``hot-spot`` — multi-tenant, until `hot_at` × duration, after which one tenant takes `hot_share` of arrivals.
* ``mooncake`` — replay of a Mooncake trace (see `trace.py`): token-id prompts, open-loop at trace timestamps.

Token counts are approximate: words of a fixed English vocabulary, ~1.7 tokens each with the bundled tiny
tokenizer (`kvrouter.tinymodel`), fewer with a large production vocabulary.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvrouter.loadgen.plan import Body, PlannedRequest, Session, WorkloadParams
from kvrouter.loadgen.trace import trace_sessions

TOKENS_PER_WORD = 1.7

_WORD_TEXT = (
    "account balance invoice customer order shipment delivery warehouse product catalog price discount "
    "contract clause policy insurance claim payment refund schedule meeting agenda minutes report quarter "
    "revenue forecast budget expense approval manager team project milestone deadline status update review "
    "search result source citation summary answer question context document section paragraph table figure "
    "code function variable module error exception test build deploy server request response latency cache "
    "memory storage network region cluster replica model token prompt template language translation japanese "
    "english business formal polite greeting request confirm cancel change address phone email number date "
    "time week month year morning evening today tomorrow yesterday please thank you sorry kindly regarding "
    "following above below attached previous next first second third final total average maximum minimum "
    "check verify compare analyze explain describe list show find return create delete update retrieve "
    "always never only must should may can will the a of to and in for on with by from as at is are be"
)
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(slots=True)
class _Text:
    """Deterministic filler text; a tenant's text depends only on (seed, tenant)."""

    seed: int
    cache: dict[tuple[str, int, int], str] = field(default_factory=dict)

    def words(self, purpose: str, index: int, tokens: int) -> str:
        key = (purpose, index, tokens)
        cached = self.cache.get(key)
        if cached is None:
            rng = random.Random(f"{self.seed}:{purpose}:{index}")
            count = max(1, round(tokens / TOKENS_PER_WORD))
            cached = " ".join(rng.choices(_WORDS, k=count))
            self.cache[key] = cached
        return cached


def _arrivals(rng: random.Random, rate: float, duration_s: float) -> list[float]:
    times: list[float] = []
    if rate <= 0:
        return times
    now = rng.expovariate(rate)
    while now < duration_s:
        times.append(now)
        now += rng.expovariate(rate)
    return times


def _zipf_weights(count: int, skew: float) -> list[float]:
    return [1.0 / math.pow(rank + 1, skew) for rank in range(count)]


def _tools(text: _Text, tenant: int, count: int) -> list[dict[str, Any]]:
    tools = []
    for index in range(count):
        description = text.words(f"tool-description-{index}", tenant, 60)
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": f"tenant{tenant}_tool{index}",
                    "description": description,
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "query": {"type": "string", "description": text.words("arg", tenant * 64 + index, 12)},
                            "limit": {"type": "integer", "minimum": 1, "maximum": 100},
                        },
                        "required": ["query"],
                    },
                },
            }
        )
    return tools


def _system_prompt(text: _Text, tenant: int, tokens: int) -> str:
    return f"You are the assistant of tenant {tenant}. " + text.words("system", tenant, tokens)


def _chat_body(messages: list[dict[str, Any]], max_tokens: int, tools: list[dict[str, Any]] | None) -> Body:
    body: Body = {"messages": messages, "max_tokens": max_tokens, "ignore_eos": True}
    if tools:
        body["tools"] = tools
    return body


def _tenant_chooser(params: WorkloadParams, rng: random.Random) -> Callable[[float], int]:
    weights = _zipf_weights(params.tenants, params.tenant_skew)
    # Tenant ids are shuffled so the most popular tenant is not always tenant 0 (the hot spot's tenant).
    order = list(range(params.tenants))
    rng.shuffle(order)

    def choose(_at: float) -> int:
        return order[rng.choices(range(params.tenants), weights=weights)[0]]

    return choose


def _single_turn_sessions(params: WorkloadParams, choose: Callable[[float], int], label: str) -> list[Session]:
    rng = random.Random(f"{params.seed}:{label}:arrivals")
    text = _Text(params.seed)
    sessions: list[Session] = []
    for number, at in enumerate(_arrivals(rng, params.rate, params.duration_s)):
        tenant = choose(at)
        system = _system_prompt(text, tenant, params.system_tokens)
        tools = _tools(text, tenant, params.tools_per_tenant)
        user = text.words("user", number, params.user_tokens)

        def make(system: str = system, tools: list[dict[str, Any]] = tools, user: str = user) -> Body:
            messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
            return _chat_body(messages, params.output_tokens, tools)

        request = PlannedRequest("chat", make, label, params.output_tokens)
        sessions.append(Session(at, (request,), f"tenant-{tenant}"))
    return sessions


def multi_tenant(params: WorkloadParams) -> list[Session]:
    choose = _tenant_chooser(params, random.Random(f"{params.seed}:tenants"))
    return _single_turn_sessions(params, choose, "multi-tenant")


def hot_spot(params: WorkloadParams) -> list[Session]:
    rng = random.Random(f"{params.seed}:hot")
    base = _tenant_chooser(params, random.Random(f"{params.seed}:tenants"))
    switch_at = params.hot_at * params.duration_s

    def choose(at: float) -> int:
        if at >= switch_at and rng.random() < params.hot_share:
            return 0
        return base(at)

    return _single_turn_sessions(params, choose, "hot-spot")


def _think(rng: random.Random, mean: float) -> float:
    return rng.expovariate(1.0 / mean) if mean > 0 else 0.0


def multi_turn(params: WorkloadParams) -> list[Session]:
    rng = random.Random(f"{params.seed}:multi-turn")
    text = _Text(params.seed)
    sessions: list[Session] = []
    for number, at in enumerate(_arrivals(rng, params.rate, params.duration_s)):
        tenant = rng.randrange(params.tenants)
        system = _system_prompt(text, tenant, params.system_tokens)
        history: list[dict[str, Any]] = [{"role": "system", "content": system}]
        requests: list[PlannedRequest] = []
        for turn in range(params.turns):
            user_tokens = max(4, round(params.user_tokens * rng.uniform(0.5, 1.5)))
            history = [*history, {"role": "user", "content": text.words("turn", number * 1000 + turn, user_tokens)}]

            def make(messages: list[dict[str, Any]] = history) -> Body:
                return _chat_body(list(messages), params.output_tokens, None)

            think = 0.0 if turn == 0 else _think(rng, params.think_s)
            requests.append(PlannedRequest("chat", make, "multi-turn", params.output_tokens, think))
            reply = text.words("reply", number * 1000 + turn, params.output_tokens)
            history = [*history, {"role": "assistant", "content": reply}]
        sessions.append(Session(at, tuple(requests), f"chat-{number}"))
    return sessions


def agentic(params: WorkloadParams) -> list[Session]:
    rng = random.Random(f"{params.seed}:agentic")
    text = _Text(params.seed)
    sessions: list[Session] = []
    for number, at in enumerate(_arrivals(rng, params.rate, params.duration_s)):
        tenant = rng.randrange(params.tenants)
        tools = _tools(text, tenant, params.tools_per_tenant)
        history: list[dict[str, Any]] = [
            {"role": "system", "content": _system_prompt(text, tenant, params.system_tokens)},
            {"role": "user", "content": text.words("task", number, params.user_tokens)},
        ]
        requests: list[PlannedRequest] = []
        for step in range(params.turns):

            def make(messages: list[dict[str, Any]] = history, tools: list[dict[str, Any]] = tools) -> Body:
                return _chat_body(list(messages), params.output_tokens, tools)

            think = 0.0 if step == 0 else _think(rng, params.think_s / 10)
            requests.append(PlannedRequest("chat", make, "agentic", params.output_tokens, think))
            call_id = f"call_{number}_{step}"
            tool = rng.randrange(max(1, params.tools_per_tenant))
            arguments = json.dumps({"query": text.words("query", number * 1000 + step, 12)})
            result_tokens = max(16, round(params.tool_result_tokens * rng.uniform(0.5, 1.5)))
            history = [
                *history,
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": f"tenant{tenant}_tool{tool}", "arguments": arguments},
                        }
                    ],
                },
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "content": text.words("result", number * 1000 + step, result_tokens),
                },
            ]
        sessions.append(Session(at, tuple(requests), f"agent-{number}"))
    return sessions


def mooncake(params: WorkloadParams) -> list[Session]:
    if params.trace is None:
        raise ValueError("the mooncake workload needs a trace file (--kv-trace / --trace)")
    return trace_sessions(params)


WORKLOADS: Mapping[str, Callable[[WorkloadParams], list[Session]]] = {
    "multi-tenant": multi_tenant,
    "multi-turn": multi_turn,
    "agentic": agentic,
    "hot-spot": hot_spot,
    "mooncake": mooncake,
}


def build_schedule(name: str, params: WorkloadParams) -> list[Session]:
    """The workload's sessions, sorted by start time."""
    try:
        workload = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}") from None
    return sorted(workload(params), key=lambda session: session.start_s)


def count_requests(sessions: Sequence[Session]) -> int:
    return sum(len(session.requests) for session in sessions)


def with_overrides(params: WorkloadParams, **changes: Any) -> WorkloadParams:
    """`params` with the given fields replaced, skipping None values (unset command-line flags)."""
    return replace(params, **{name: value for name, value in changes.items() if value is not None})
