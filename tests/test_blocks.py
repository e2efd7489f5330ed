"""Block keys: chained, prefix-exact, isolated by adapter and salt; vLLM's cached-token rule."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvrouter.blocks import cacheable_tokens, chain_keys

TOKENS = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=80)


@given(TOKENS, st.integers(min_value=1, max_value=9))
def test_only_full_blocks_are_keyed_and_keys_are_prefix_exact(tokens: list[int], block_size: int) -> None:
    keys = chain_keys(tokens, block_size)
    assert len(keys) == len(tokens) // block_size
    for cut in range(len(keys) + 1):
        assert chain_keys(tokens[: cut * block_size], block_size) == keys[:cut]


@given(TOKENS, st.integers(min_value=1, max_value=9), st.integers(min_value=0, max_value=8))
def test_chaining_from_a_parent_equals_keying_the_whole_prompt(tokens: list[int], block_size: int, split: int) -> None:
    keys = chain_keys(tokens, block_size, seed=7)
    split = min(split, len(keys))
    if split == 0:
        return
    tail = chain_keys(tokens[split * block_size :], block_size, seed=7, parent=keys[split - 1])
    assert keys[split:] == tail


def test_a_changed_token_changes_its_block_and_every_later_key() -> None:
    tokens = list(range(64))
    changed = [*tokens[:20], 999, *tokens[21:]]
    a, b = chain_keys(tokens, 16), chain_keys(changed, 16)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))


def test_seed_adapter_and_salt_isolate_the_chain() -> None:
    tokens = list(range(32))
    plain = chain_keys(tokens, 16)
    variants = [
        chain_keys(tokens, 16, seed=1),
        chain_keys(tokens, 16, lora="sql-adapter"),
        chain_keys(tokens, 16, cache_salt="tenant-a"),
        chain_keys(tokens, 16, cache_salt="tenant-b"),
        chain_keys(tokens, 16, lora="sql-adapter", cache_salt="tenant-a"),
    ]
    every = [plain, *variants]
    for i, first in enumerate(every):
        for second in every[i + 1 :]:
            assert not set(first) & set(second)
    assert chain_keys(tokens, 16, cache_salt="tenant-a") == variants[2]  # deterministic


def test_token_ids_beyond_16_bits_are_distinguished() -> None:
    assert chain_keys([70000, 1], 2) != chain_keys([70000 - 65536, 2], 2)
    assert chain_keys([2**32 - 1, 0], 2) != chain_keys([0, 2**32 - 1], 2)


def test_the_engine_always_computes_the_last_prompt_token() -> None:
    # 469 tokens, 14 blocks of 32 cached: 448 cached (the engine's own report in the s1 capture).
    assert cacheable_tokens(469, 14, 32) == 448
    # A prompt of exactly 14 full blocks can reuse only 13 of them.
    assert cacheable_tokens(448, 14, 32) == 416
    assert cacheable_tokens(448, 3, 32) == 96
    assert cacheable_tokens(1, 5, 16) == 0
    assert cacheable_tokens(0, 5, 16) == 0
