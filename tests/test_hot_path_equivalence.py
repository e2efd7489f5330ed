"""The hot path's shortcuts change no routing decision and no predicted cached token.

Two routers see the same requests on the same (injected) clock, with the same KV events: one as the proxy runs
it (the render cache reusing token prefixes, the Rust tokenizer called directly, the compiled index with its
provisional marks expiring in C), one built from the plain definitions (every prompt rendered and tokenized whole
through transformers, the pure-Python index). Every decision — the chosen replica and every candidate's score
breakdown — and every predicted cached-token count must be equal, over many tenants sharing long system prompts,
growing conversations, marks that expire while others are renewed, and blocks stored and evicted by events; with
the tokenizer encoding on its threads only, and encoding short tails on the event loop (`tokenizer_inline_chars`).
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
from typing import Any

import pytest

from kvrouter.blocks import chain_keys
from kvrouter.blocktable import native_backend, pure_backend
from kvrouter.config import Settings
from kvrouter.index import PrefixIndex
from kvrouter.openai_request import ParsedRequest, parse_request
from kvrouter.policies import build_policy
from kvrouter.routing.load import LoadBook
from kvrouter.routing.router import Route, Router
from kvrouter.tinymodel import ensure_tokenizer
from kvrouter.tokenization import HfPromptTokenizer
from kvrouter.typedefs import EngineBlockHash, ReplicaName

BLOCK = 16
ROUTES = [Route(ReplicaName(f"r{n}"), BLOCK) for n in range(4)]
WORDS = ["the", "of", "tenant", "invoice", "é", "日本", "\n", "  ", "<|end|>", "order", "x=1", "tool"]


class WholePrompt:
    """The reference tokenizer: render, then tokenize the whole text through transformers. No cache."""

    def __init__(self, prompt: HfPromptTokenizer) -> None:
        self.prompt = prompt

    async def prompt_token_ids(self, request: ParsedRequest) -> list[list[int]]:
        text = self.prompt.render(request)
        return [list(self.prompt.tokenizer(text, add_special_tokens=False).input_ids)]


def requests(seed: int) -> list[tuple[float, bytes]]:
    """(arrival time, body): tenants with long system prompts, short distinct questions, growing conversations."""
    rng = random.Random(seed)
    systems = [f"You serve tenant {t}. " + " ".join(rng.choices(WORDS, k=300)) for t in range(6)]
    conversations: list[list[dict[str, Any]]] = []
    out = []
    now = 0.0
    for n in range(160):
        now += rng.choice([0.01, 0.2, 1.0, 3.0])  # marks (5 s) expire between some requests and not others
        if conversations and rng.random() < 0.4:
            messages = rng.choice(conversations)
            messages.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=20))})
        else:
            messages = [{"role": "system", "content": rng.choice(systems)}]
            conversations.append(messages)
        messages.append({"role": "user", "content": f"question {n}: " + " ".join(rng.choices(WORDS, k=30))})
        out.append((now, json.dumps({"model": "m", "messages": messages, "max_tokens": 8}).encode()))
    return out


@pytest.mark.parametrize("inline_chars", [0, 300, Settings().tokenizer_inline_chars])
def test_decisions_and_predictions_equal_the_plain_definitions(inline_chars: int) -> None:
    """With every encode on the threads (0), short tails on the loop (300: some tails over it, some under) and the
    default bound: the same ids, keys, decisions and predictions as the plain definitions, so as each other."""
    settings = Settings()
    fast_prompt = HfPromptTokenizer(ensure_tokenizer(), threads=1, inline_chars=inline_chars)
    encodes: list[bool] = []  # per encode: on the event loop's thread?
    encode = fast_prompt._encode

    def spy(text: str, add_special: bool) -> list[int]:
        encodes.append(threading.current_thread() is threading.main_thread())
        return encode(text, add_special)

    fast_prompt._encode = spy  # type: ignore[method-assign]
    plain_prompt = HfPromptTokenizer(ensure_tokenizer(), threads=1)
    clock = [0.0]
    routers = [
        Router(
            policy=build_policy("kv_aware", settings, clock=lambda: clock[0]),
            load=LoadBook(),
            index=PrefixIndex(provisional_ttl_s=5.0, backend=backend),
            tokenizer=tokenizer,
            clock=lambda: clock[0],
        )
        for backend, tokenizer in ((native_backend(), fast_prompt), (pure_backend(), WholePrompt(plain_prompt)))
    ]
    rng = random.Random(1)
    in_flight: list[list[Any]] = []
    next_hash = 1
    for now, body in requests(seed=3):
        clock[0] = now
        decisions, predicted, keys = [], [], []
        routed_pair = []
        block_keys_pair: list[list[Any]] = []
        for router in routers:
            facts = asyncio.run(router.facts(parse_request("chat", body)))
            decision = router.decide(facts, ROUTES)
            routed = router.commit(decision, facts, next(r for r in ROUTES if r.name == decision.chosen))
            decisions.append(decision)
            predicted.append(routed.predicted_cached)
            keys.append([list(prompt) for prompt in facts.prompts or ()])  # the fast path's ids are an array
            block_keys_pair.append(facts.keys(BLOCK, 0))  # the fast path's reuse a cached prefix's
            routed_pair.append(routed)
        assert keys[0] == keys[1], "the token ids differ"
        assert block_keys_pair[0] == block_keys_pair[1] == chain_keys(keys[1][0], BLOCK), "the block keys differ"
        assert decisions[0] == decisions[1]
        assert predicted[0] == predicted[1]
        in_flight.append(routed_pair)
        # The engine reports what it computed for a few requests, and evicts some of it later.
        if rng.random() < 0.5:
            replica = decisions[0].chosen
            prompt = keys[0][0] if keys[0] else []
            block_keys = chain_keys(prompt, BLOCK)
            hashes = [EngineBlockHash(next_hash + i) for i in range(len(block_keys))]
            next_hash += len(block_keys)
            evict = rng.random() < 0.3
            for router in routers:
                assert isinstance(router.index, PrefixIndex)
                router.index.store_keys(replica, hashes, block_keys)
                if evict:
                    router.index.remove_blocks(replica, hashes[len(hashes) // 2 :])
        while in_flight and rng.random() < 0.6:
            for routed in in_flight.pop(0):
                routed.first_token(now)
                routed.finish(now)
    assert fast_prompt.cache.partial_hits > 50  # the fast side did take its shortcuts
    # ... on the path asked for: the threads only, or the loop for short tails (and the threads for 300's long ones)
    assert any(encodes) == (inline_chars > 0) and all(encodes) == (inline_chars > 300), (inline_chars, encodes)
    fast_prompt.close()
    plain_prompt.close()
