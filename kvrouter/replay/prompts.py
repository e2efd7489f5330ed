"""Trace block ids -> token ids -> kvrouter's block keys and the engine's block hashes, computed once per prefix.

Each trace chain id stands for a fixed, deterministic block of token ids (a function of the id and the seed), and
a request's prompt is its blocks' tokens cut to `input_length`; a prompt longer than its blocks (the GMI trace)
is padded with tokens unique to the request. Router keys come from `kvrouter.blocks.chain_keys` over those
tokens at the engine's block size, exactly as for a live request. Since a chain id names a whole prefix, the key
of an engine block is a function of (the chain id of the trace block it ends in, its end offset there): keys are
cached under that pair, and a request only materialises tokens from its first uncached engine block onward, in
one `chain_keys` call. The engine's hash of a block is that (chain id, offset) label as one integer — an opaque
handle that names the prefix, unrelated to the key — so the index still maps engine hashes back to keys through
the stored events, as it does live.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import cast, overload

import numpy as np

from kvrouter.blocks import chain_keys
from kvrouter.replay.trace import TraceRequest
from kvrouter.typedefs import BlockKey, EngineBlockHash

_VOCAB = 32_000
_MIX = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
_UNIQUE_BASE = 1 << 62
"""Engine hashes of blocks that hold request-unique padding start here (chain labels stay far below)."""


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    keys: list[BlockKey]
    """kvrouter's key of every full engine block of the prompt."""
    engine_hashes: list[EngineBlockHash]
    """The engine's hash of the same blocks."""


class SizedPrompt(Sequence[int]):
    """A prompt whose token ids are made only if read; routing needs its length and precomputed keys only."""

    __slots__ = ("_catalog", "_request")

    def __init__(self, catalog: PromptCatalog, request: TraceRequest) -> None:
        self._catalog = catalog
        self._request = request

    def __len__(self) -> int:
        return self._request.input_length

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...

    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        tokens = self._catalog.tokens(self._request, 0, self._request.input_length)
        return tokens[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._catalog.tokens(self._request, 0, self._request.input_length))


class PromptCatalog:
    """Tokens, keys and engine hashes for a trace's requests at one engine block size."""

    def __init__(
        self,
        *,
        trace_block_tokens: int,
        block_size: int,
        hash_seed: int = 0,
        token_seed: int = 0,
        vocab: int = _VOCAB,
    ) -> None:
        self.trace_block_tokens = trace_block_tokens
        self.vocab = vocab
        """Token ids are drawn from [0, vocab): a live router rejects ids outside its tokenizer's vocabulary."""
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.token_seed = token_seed
        self._cache: dict[int, BlockKey] = {}
        self.keys_by_hash: dict[int, BlockKey] = {}
        """Engine hash -> key of every prompt block prepared so far."""
        self._unique = 0
        self._ramp = np.arange(max(trace_block_tokens, 4096), dtype=np.uint64)

    def _sequence(self, seed: int, count: int) -> array[int]:
        # A multiplicative sequence (numpy, wrapping uint64): cheap, deterministic, distinct per seed.
        start = np.uint64((seed * _MIX + self.token_seed) & _MASK64)
        step = np.uint64(((seed * _MIX) >> 17 | 1) & _MASK64)
        values = (start + self._ramp[:count] * step) >> np.uint64(40)
        return array("I", (values % np.uint64(self.vocab)).astype(np.uint32).tobytes())

    def _block_tokens(self, chain_id: int) -> array[int]:
        return self._sequence(chain_id + 1, self.trace_block_tokens)

    def _padding(self, request: TraceRequest, count: int) -> array[int]:
        if count > len(self._ramp):
            self._ramp = np.arange(count, dtype=np.uint64)
        return self._sequence(-(request.index + 1) & _MASK64, count)

    def tokens(self, request: TraceRequest, start: int, end: int) -> array[int]:
        """Token ids [start, end) of the request's prompt."""
        size = self.trace_block_tokens
        chain = request.chain
        result = array("I")
        first = start // size
        last = (end - 1) // size
        for position in range(first, min(last, len(chain) - 1) + 1):
            result.extend(self._block_tokens(chain[position]))
        covered = first * size + len(result)
        if covered < end:
            result.extend(self._padding(request, end - max(covered, start)))
        offset = start - first * size
        return result[offset : offset + end - start]

    def prepare(self, request: TraceRequest) -> PreparedPrompt:
        bsize = self.block_size
        tsize = self.trace_block_tokens
        chain = request.chain
        full = request.input_length // bsize
        within = min(full, len(chain) * tsize // bsize)
        span = tsize + 1
        # The label of a block ending at token `end`: (chain id of the trace block holding token end-1, offset).
        labels = [
            chain[(end - 1) // tsize] * span + end - (end - 1) // tsize * tsize
            for end in range(bsize, (within + 1) * bsize, bsize)
        ]
        cache = self._cache
        keys: list[BlockKey | None] = list(map(cache.get, labels))
        try:
            done = keys.index(None)  # cached labels are prefix-closed: every request stores a whole prefix
        except ValueError:
            done = within
        if done < full:
            tokens = self.tokens(request, done * bsize, full * bsize)
            parent = keys[done - 1] if done else None
            fresh = chain_keys(tokens, bsize, seed=self.hash_seed, parent=parent)
            del keys[done:]
            keys.extend(fresh)
            for label, key in zip(labels[done:], fresh, strict=False):
                cache[label] = key
            for _ in range(within, full):
                self._unique += 1
                labels.append(_UNIQUE_BASE + self._unique)
        for label, new_key in zip(labels[done:], keys[done:], strict=True):
            self.keys_by_hash[label] = cast(BlockKey, new_key)
        return PreparedPrompt(cast(list[BlockKey], keys), cast(list[EngineBlockHash], labels))
