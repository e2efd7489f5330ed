"""The simulated engine's own chained block hashes (pure).

A block's hash is blake2b-64 over (parent hash, the block's token ids, extra keys), so equal hashes mean equal
prefixes, as in vLLM's prefix cache. It is deliberately a different function from the router's keys
(`kvrouter.blocks`): the router must never depend on the engine's hash, only on the token ids inside events,
and this module lets the simulator judge that independently. `seed` plays the role of vLLM's PYTHONHASHSEED-
dependent root: two simulated replicas with different seeds publish different hashes for the same tokens.

Extra keys follow vLLM: a LoRA adapter's name keys every block of its requests, the cache salt the first block
only (`block_extras`). Blocks without tokens (trace replay, where a prompt is a list of block ids) hash an integer
label instead of token ids.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b

_MASK = (1 << 64) - 1


def root_hash(seed: int = 0) -> int:
    """What the first block of every prompt chains from."""
    digest = blake2b(b"kvrouter-sim-root", digest_size=8, key=seed.to_bytes(8, "little")).digest()
    return int.from_bytes(digest, "little")


def block_extras(index: int, lora_name: str | None = None, cache_salt: str | None = None) -> tuple[str, ...]:
    """vLLM's extra hash keys of block `index` of a request: the adapter name on every block, then the salt on
    the first."""
    extras: tuple[str, ...] = () if lora_name is None else (lora_name,)
    if index == 0 and cache_salt is not None:
        extras += (cache_salt,)
    return extras


def hash_block(parent: int, token_ids: Sequence[int], extras: Sequence[str] = ()) -> int:
    """Hash of one full block chained from `parent` (a block hash or `root_hash`)."""
    hasher = blake2b(parent.to_bytes(8, "little"), digest_size=8)
    hasher.update(array("I", token_ids).tobytes())
    for extra in extras:
        hasher.update(b"\x00extra\x00" + extra.encode())
    return int.from_bytes(hasher.digest(), "little") & _MASK


def hash_label(parent: int, label: int) -> int:
    """Hash of one full block known only by an integer label (a trace's block id, a synthetic output block)."""
    hasher = blake2b(parent.to_bytes(8, "little"), digest_size=8)
    hasher.update(b"\x01label" + (label & _MASK).to_bytes(8, "little"))
    return int.from_bytes(hasher.digest(), "little")


def prompt_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    cache_salt: str | None = None,
    lora_name: str | None = None,
    seed: int = 0,
) -> list[int]:
    """Hashes of every full block of a prompt, prefix-chained, with vLLM's extra keys."""
    hashes: list[int] = []
    parent = root_hash(seed)
    for index in range(len(token_ids) // block_size):
        block = token_ids[index * block_size : (index + 1) * block_size]
        parent = hash_block(parent, block, block_extras(index, lora_name, cache_salt))
        hashes.append(parent)
    return hashes


def label_hashes(labels: Sequence[int], *, seed: int = 0, parent: int | None = None) -> list[int]:
    """Chained hashes of blocks known by labels (a trace's per-block hash ids)."""
    hashes: list[int] = []
    current = root_hash(seed) if parent is None else parent
    for label in labels:
        current = hash_label(current, label)
        hashes.append(current)
    return hashes
