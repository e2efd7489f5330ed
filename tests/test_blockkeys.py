"""The C block keys (kvrouter/_blockkeys.c) equal the xxhash package's, bit for bit, on every path."""

from __future__ import annotations

from array import array

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter import _blockkeys
from kvrouter.blocks import chain_keys, python_chain_keys, root_material
from kvrouter.typedefs import BlockKey

SEEDS = st.one_of(st.sampled_from([0, 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))


@settings(max_examples=400, deadline=None)
@given(
    data=st.one_of(st.binary(max_size=20), st.binary(max_size=300), st.binary(min_size=230, max_size=3000)),
    seed=SEEDS,
)
def test_xxh3_matches_the_xxhash_package(data: bytes, seed: int) -> None:
    # Every size class of XXH3-64: 0, 1-3, 4-8, 9-16, 17-128, 129-240 and the striped long input (> 1 block).
    assert _blockkeys.xxh3_64(data, seed) == xxhash.xxh3_64_intdigest(data, seed)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=400),
    block_size=st.sampled_from([1, 3, 4, 16, 32, 61, 64, 128]),
    seed=SEEDS,
    root=st.one_of(
        st.just(b""),
        st.integers(0, 2**64 - 1).map(lambda key: key.to_bytes(8, "little")),
        st.tuples(st.none() | st.text(max_size=20), st.none() | st.text(max_size=20)).map(lambda p: root_material(*p)),
    ),
)
def test_chained_keys_match_the_python_path(tokens: list[int], block_size: int, seed: int, root: bytes) -> None:
    expected = python_chain_keys(tokens, block_size, seed, root)
    assert _blockkeys.chain_keys(tokens, block_size, seed, root) == expected
    # The tokenizer's cached renders are array('I'): hashed in place, the same keys; a tuple (an event) too.
    assert _blockkeys.chain_keys(array("I", tokens), block_size, seed, root) == expected
    assert _blockkeys.chain_keys(memoryview(array("I", tokens)), block_size, seed, root) == expected
    assert _blockkeys.chain_keys(tuple(tokens), block_size, seed, root) == expected
    assert python_chain_keys(array("I", tokens), block_size, seed, root) == expected


@pytest.mark.parametrize("buffer", [array("H", [1, 2]), array("Q", [1, 2]), array("i", [1, 2]), b"abcd", bytearray(4)])
def test_a_buffer_of_anything_but_4_byte_unsigned_ints_is_refused(buffer: object) -> None:
    with pytest.raises(TypeError, match="4-byte unsigned ints"):
        _blockkeys.chain_keys(buffer, 1, 0, b"")


def test_chain_keys_takes_the_c_path_and_keeps_its_contract() -> None:
    tokens = list(range(100))
    parent = BlockKey(0xDEADBEEF)
    expected = python_chain_keys(tokens, 16, 7, parent.to_bytes(8, "little"))
    assert chain_keys(tokens, 16, seed=7, parent=parent) == expected
    assert chain_keys(tokens, 16, lora="a") != chain_keys(tokens, 16)
    assert len(chain_keys(tokens, 16)) == 6 and chain_keys(tokens[:15], 16) == []
    assert chain_keys(tokens, 16)[:3] == chain_keys(tokens[:48], 16)  # a prefix's keys are the chain's first keys


@pytest.mark.parametrize("bad, error", [([1, -1], OverflowError), ([1, 2**32], OverflowError), ([1, "2"], TypeError)])
def test_bad_token_ids_raise_like_the_python_path(bad: list[object], error: type[Exception]) -> None:
    with pytest.raises(error):
        _blockkeys.chain_keys(bad, 2, 0, b"")  # type: ignore[arg-type]
    with pytest.raises(error):
        python_chain_keys(bad, 2, 0, b"")  # type: ignore[arg-type]
