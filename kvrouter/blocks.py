"""Token ids -> chained block keys (pure).

Block i's key is xxh3_64 over (key of block i-1, the block's token ids), seeded with the fleet's hash seed, so
equal keys mean equal prefixes. Only full blocks are keyed: vLLM caches full blocks only. The first block also
mixes in what vLLM isolates a cache by — the LoRA adapter and the request's `cache_salt` — so the same tokens
under a different adapter or salt give a different chain. Requests and KV events go through the same function,
which is why kvrouter never depends on the engine's hash seed or algorithm.

The keys are computed in C (`kvrouter/_blockkeys.c`, XXH3-64 implemented from the xxHash specification) when the
extension was built, else block by block through the xxhash package (`python_chain_keys`); the two give the same
keys bit for bit (tests/test_blockkeys.py), so routers and relays agree whichever path each one runs.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import cast

import xxhash

from kvrouter.typedefs import BlockKey

try:  # the same keys, computed in C (kvrouter/_blockkeys.c); absent when the extension was not built
    from kvrouter._blockkeys import chain_keys as _native_chain_keys
except ImportError:
    _native_chain_keys = None  # type: ignore[assignment]
_SEED_LIMIT = 1 << 64


def native_block_keys() -> bool:
    """Whether `chain_keys` runs in C."""
    return _native_chain_keys is not None


def root_material(lora: str | None = None, cache_salt: str | None = None) -> bytes:
    """What the first block chains from: empty unless an adapter or salt isolates the request."""
    if lora is None and cache_salt is None:
        return b""
    return b"\x00lora:" + (lora or "").encode() + b"\x00salt:" + (cache_salt or "").encode()


def chain_keys(
    token_ids: Sequence[int],
    block_size: int,
    *,
    seed: int = 0,
    parent: BlockKey | None = None,
    lora: str | None = None,
    cache_salt: str | None = None,
) -> list[BlockKey]:
    """Keys of every full block of `token_ids`, chained from `parent` (None: the start of a prompt).

    `lora`/`cache_salt` only matter when `parent` is None (the chain's first block carries them onward).
    """
    full = len(token_ids) // block_size
    if full == 0:
        return []
    previous = root_material(lora, cache_salt) if parent is None else parent.to_bytes(8, "little")
    if _native_chain_keys is not None and 0 <= seed < _SEED_LIMIT:
        return cast("list[BlockKey]", _native_chain_keys(token_ids, block_size, seed, previous))
    return python_chain_keys(token_ids, block_size, seed, previous)


def extend_keys(
    token_ids: Sequence[int],
    block_size: int,
    known: Sequence[int],
    *,
    seed: int = 0,
    lora: str | None = None,
    cache_salt: str | None = None,
) -> list[BlockKey]:
    """`chain_keys` of a prompt (from its start) whose first `len(known)` full blocks' keys are already known.

    `known` must be the keys of those blocks under the same block size, seed, adapter and salt (a chain's keys
    depend on all of them and on every earlier block); only the blocks after them are hashed.
    """
    full = len(token_ids) // block_size
    reused = min(len(known), full)
    if reused == 0:
        return chain_keys(token_ids, block_size, seed=seed, lora=lora, cache_salt=cache_salt)
    # A list (the render cache's) is sliced as it is: its ints are shared, not rebuilt from 8-byte values.
    head = cast("list[BlockKey]", known[:reused] if type(known) is list else list(known[:reused]))
    if reused < full:
        head += chain_keys(token_ids[reused * block_size :], block_size, seed=seed, parent=head[-1])
    return head


def python_chain_keys(token_ids: Sequence[int], block_size: int, seed: int, previous: bytes) -> list[BlockKey]:
    """`chain_keys` through the xxhash package, one call per block: the reference the C path is tested against,
    and the path when the extension was not built. `previous` is what the first block chains from."""
    full = len(token_ids) // block_size
    size = full * block_size
    # Event batches carry exactly the full blocks' tokens: skip the copy a slice would make.
    data = array("I", token_ids if len(token_ids) == size else token_ids[:size]).tobytes()
    step = block_size * 4
    keys: list[int] = []
    append = keys.append
    hasher = xxhash.xxh3_64_intdigest
    for start in range(0, size * 4, step):
        key = hasher(previous + data[start : start + step], seed)
        append(key)  # not BlockKey(key): calling a NewType costs a Python call per block
        previous = key.to_bytes(8, "little")
    return cast("list[BlockKey]", keys)


def cacheable_tokens(prompt_tokens: int, matched_blocks: int, block_size: int) -> int:
    """Tokens vLLM reports as cached for a prompt whose first `matched_blocks` blocks are cached.

    vLLM always computes the last prompt token, so at most `prompt_tokens - 1` tokens count, in whole blocks.
    """
    if prompt_tokens <= 0:
        return 0
    limit = (prompt_tokens - 1) // block_size
    return min(matched_blocks, limit) * block_size
