"""Block keys of a cached token prefix are reused, and equal hashing the prompt from scratch, bit for bit.

A chain of block keys depends on the seed, the block size, the adapter and salt (the root) and every earlier
block; the render cache keeps an entry's keys per (block size, seed, root) and hands a new prompt the keys of
the full blocks of the prefix it reused. Held here against `chain_keys` over whole prompts: conversations and
siblings sharing prefixes of varied lengths (most ending mid-block), several block sizes, seeds (the C path's
and, past 2**64, the Python one's), adapters and salts asked in any order of the same entries; and the cache's
byte count, keys included, against its entries and its bound.
"""

from __future__ import annotations

import functools
import json
import tracemalloc
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.blocks import chain_keys, extend_keys
from kvrouter.openai_request import ParsedRequest, parse_request
from kvrouter.routing.router import RoutingFacts
from kvrouter.tinymodel import ensure_tokenizer
from kvrouter.tokenization import HfPromptTokenizer

SEEDS = st.sampled_from([0, 7, 2**63 + 11, 2**64 + 5])
ROOTS = st.sampled_from([(None, None), ("adapter-a", None), (None, "salt-1"), ("adapter-b", "salt-1")])
BLOCKS = st.sampled_from([1, 3, 16, 17, 64])
SPEC = st.tuples(BLOCKS, SEEDS, ROOTS)
WORDS = st.lists(st.sampled_from(["the", " cat", "\n", "é", "日本", "<|end|>", "42", " sat", "."]), max_size=30)


@functools.cache
def tokenizer() -> HfPromptTokenizer:
    return HfPromptTokenizer(ensure_tokenizer(), threads=1)


def chat(messages: list[dict[str, Any]]) -> ParsedRequest:
    return parse_request("chat", json.dumps({"model": "m", "messages": messages}).encode())


def scratch(ids: Any, spec: tuple[int, int, tuple[str | None, str | None]]) -> list[int]:
    block_size, seed, (lora, salt) = spec
    return list(chain_keys(list(ids), block_size, seed=seed, lora=lora, cache_salt=salt))


def cached(prompt: HfPromptTokenizer, ids: Any, spec: tuple[int, int, tuple[str | None, str | None]]) -> list[int]:
    block_size, seed, (lora, salt) = spec
    keys = prompt.block_keys(ids, block_size, seed=seed, lora=lora, cache_salt=salt)
    assert keys is not None, "a chat prompt's ids are the render cache's"
    return list(keys)


def entries_bytes(prompt: HfPromptTokenizer) -> int:
    return sum(stored.nbytes() for stored in prompt.cache._entries.values())


@settings(max_examples=40, deadline=None)
@given(
    st.lists(WORDS.map("".join), min_size=1, max_size=4),
    st.lists(st.tuples(WORDS.map("".join), WORDS.map("".join)), min_size=1, max_size=5),
    st.lists(SPEC, min_size=1, max_size=4),
)
def test_reused_keys_equal_keys_from_scratch(
    systems: list[str], turns: list[tuple[str, str]], specs: list[Any]
) -> None:
    prompt = tokenizer()
    # Siblings (one system prompt, different turns) and growing conversations: prefixes of every length.
    for number, system in enumerate(systems):
        messages: list[dict[str, Any]] = [{"role": "system", "content": "Be exact. " * 70 + system}]
        for user, assistant in turns[number % len(turns) :]:
            messages.append({"role": "user", "content": user})
            [ids] = prompt.token_ids(chat(messages))
            for spec in specs:
                assert cached(prompt, ids, spec) == scratch(ids, spec)
            messages.append({"role": "assistant", "content": assistant})
    assert prompt.cache.nbytes == entries_bytes(prompt)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=200),
    st.integers(0, 200),
    BLOCKS,
    SEEDS,
    ROOTS,
)
def test_extend_keys_from_a_prefix_ending_anywhere(
    tokens: list[int], cut: int, block_size: int, seed: int, root: tuple[str | None, str | None]
) -> None:
    lora, salt = root
    whole = chain_keys(tokens, block_size, seed=seed, lora=lora, cache_salt=salt)
    known = chain_keys(tokens[:cut], block_size, seed=seed, lora=lora, cache_salt=salt)  # may end mid-block
    assert extend_keys(tokens, block_size, known, seed=seed, lora=lora, cache_salt=salt) == whole


def test_a_sibling_reuses_the_prefix_keys_and_hashes_only_its_tail() -> None:
    prompt = HfPromptTokenizer(ensure_tokenizer(), threads=1)
    head = {"role": "system", "content": "Answer briefly. " * 80}
    [first] = prompt.token_ids(chat([head, {"role": "user", "content": "a"}]))
    spec = (16, 3, (None, None))
    assert cached(prompt, first, spec) == scratch(first, spec)
    [second] = prompt.token_ids(chat([head, {"role": "user", "content": "b " * 60}]))
    stored = prompt.cache._by_ids[id(second)]
    # Before its own keys are asked for, the sibling's entry holds the shared prefix's full blocks' keys.
    [(key_spec, known)] = stored.keys.items()
    assert key_spec[:2] == (16, 3) and 0 < len(known) < len(second) // 16
    assert list(known) == scratch(second, spec)[: len(known)]
    assert cached(prompt, second, spec) == scratch(second, spec)
    # Another seed or adapter on the same entry is a chain of its own.
    for other in [(16, 4, (None, None)), (16, 3, ("adapter-a", None)), (32, 3, (None, None))]:
        assert cached(prompt, second, other) == scratch(second, other)
    assert prompt.cache.nbytes == entries_bytes(prompt)
    prompt.close()


def test_ids_the_cache_does_not_hold_are_hashed_by_the_caller() -> None:
    prompt = HfPromptTokenizer(ensure_tokenizer(), threads=1)
    [ids] = prompt.token_ids(chat([{"role": "user", "content": "hello " * 50}]))
    assert prompt.block_keys(list(ids), 16, seed=0, lora=None, cache_salt=None) is None
    assert prompt.block_keys(ids[:-1], 16, seed=0, lora=None, cache_salt=None) is None
    facts = RoutingFacts([ids[:-1]], known_keys=prompt.block_keys)
    assert facts.keys(16, 0) == chain_keys(list(ids[:-1]), 16)
    facts = RoutingFacts([ids], known_keys=prompt.block_keys, lora="x", cache_salt="s")
    assert facts.keys(16, 0) == chain_keys(list(ids), 16, lora="x", cache_salt="s")
    prompt.close()


def test_keys_count_in_the_cache_bound() -> None:
    prompt = HfPromptTokenizer(ensure_tokenizer(), threads=1, cache_bytes=200_000)
    for n in range(40):
        [ids] = prompt.token_ids(chat([{"role": "system", "content": f"{n} " + "Be exact. " * 300}]))
        for block_size in (1, 2, 4, 8, 16):
            assert cached(prompt, ids, (block_size, n, (None, None))) == scratch(ids, (block_size, n, (None, None)))
        assert prompt.cache.nbytes == entries_bytes(prompt) <= 200_000
        assert all(len(stored.keys) <= 4 for stored in prompt.cache._entries.values())
        assert set(prompt.cache._by_ids) == {id(stored.ids) for stored in prompt.cache._entries.values()}
    prompt.close()


def test_the_counted_bytes_of_keys_cover_what_they_allocate() -> None:
    prompt = HfPromptTokenizer(ensure_tokenizer(), threads=1)
    prompts = [
        prompt.token_ids(chat([{"role": "user", "content": f"{n} " + "Be exact. " * 200}]))[0] for n in range(20)
    ]
    before_counted = prompt.cache.nbytes
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for ids in prompts:
            cached(prompt, ids, (16, 0, (None, None)))
            cached(prompt, ids, (4, 9, ("adapter-a", None)))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0 < grown <= prompt.cache.nbytes - before_counted
    prompt.close()
