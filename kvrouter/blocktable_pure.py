"""The block tables in pure Python: dicts of ints with the compiled tables' exact behaviour.

The reference that `kvrouter/_blocktable.c` is property-tested against, and the index's storage when the
extension was not built (then a tracked block costs about three times the memory, and lookups several times the
time; the router logs which one it runs). Dict order is the recency order of an `ordered` table.
"""

from __future__ import annotations

import bisect
import itertools
import operator
import sys
from collections.abc import Iterable, Sequence

from kvrouter.blocktable_protocol import BlockTable

_MAX_WORDS = 64
_INT_BYTES = sys.getsizeof(2**63)
_FIRST_CHUNK = 64
_ZEROS = itertools.repeat(0)


class PureBlockTable:
    def __init__(self, words: int = 1, ordered: bool = False) -> None:
        if not 1 <= words <= _MAX_WORDS:
            raise ValueError(f"words must be in 1..{_MAX_WORDS}")
        self._words = words
        self._ordered = bool(ordered)
        self._entries: dict[int, int] = {}

    @property
    def words(self) -> int:
        return self._words

    @property
    def ordered(self) -> bool:
        return self._ordered

    @property
    def nbytes(self) -> int:
        # An estimate (walking a million ints per scrape would cost more than it tells): the dict, and a 64-bit
        # key int per entry (values are mostly small cached ints or keys shared with a tier table).
        return sys.getsizeof(self._entries) + len(self._entries) * _INT_BYTES

    def __len__(self) -> int:
        return len(self._entries)

    def _bit(self, bit: int) -> int:
        if not 0 <= bit < self._words * 64:
            raise ValueError(f"bit {bit} outside this table's {self._words} words")
        return 1 << bit

    def widen(self, words: int, /) -> None:
        if not self._words <= words <= _MAX_WORDS:
            raise ValueError(f"words must be in {self._words}..{_MAX_WORDS}")
        self._words = words

    def get(self, key: int, /) -> int | None:
        return self._entries.get(key)

    def pop(self, key: int, /) -> int | None:
        return self._entries.pop(key, None)

    def set_many(self, keys: Sequence[int], values: Sequence[int], /) -> None:
        if self._words != 1:
            raise ValueError("set_many needs a one-word table")
        if len(keys) != len(values):
            raise ValueError("keys and values must have the same length")
        entries = self._entries
        for key, value in zip(keys, values, strict=True):
            if self._ordered:
                entries.pop(key, None)
            entries[key] = value

    def or_bit(self, keys: Sequence[int], bit: int, /) -> None:
        mask = self._bit(bit)
        entries = self._entries
        if self._ordered:
            for key in reversed(keys):  # deepest first: a chain's head ends up newest
                entries[key] = entries.pop(key, 0) | mask
        else:
            for key in keys:
                entries[key] = entries.get(key, 0) | mask

    def clear_bit(self, keys: Iterable[int], bit: int, /) -> int:
        mask = self._bit(bit)
        cleared = 0
        entries = self._entries
        for key in list(keys):
            value = entries.get(key)
            if value is not None and value & mask:
                cleared += 1
                if value & ~mask:
                    entries[key] = value & ~mask
                else:
                    del entries[key]
        return cleared

    def has_bit(self, key: int, bit: int, /) -> bool:
        return bool(self._entries.get(key, 0) & self._bit(bit))

    def touch(self, keys: Sequence[int], /) -> None:
        if self._ordered:
            entries = self._entries
            for key in reversed(keys):
                value = entries.pop(key, None)
                if value is not None:
                    entries[key] = value

    def evict_oldest(self, count: int, /) -> int:
        if not self._ordered:
            raise ValueError("only an ordered table knows its oldest entries")
        oldest = list(self._entries)[: max(0, count)]
        for key in oldest:
            del self._entries[key]
        return len(oldest)

    def items(self) -> list[tuple[int, int]]:
        return list(self._entries.items())

    def retain_held(self, tables: tuple[BlockTable, ...], bit: int, /) -> int:
        if self._words != 1 or not tables:
            raise ValueError("retain_held needs a one-word map and at least one table")
        before = len(self._entries)
        self._entries = {h: k for h, k in self._entries.items() if any(t.has_bit(k, bit) for t in tables)}
        return before - len(self._entries)


def prefix_lengths(
    keys: Sequence[int], gpu: BlockTable, lower: tuple[BlockTable, ...], /
) -> tuple[dict[int, int], dict[int, int]]:
    gpu_entries = _entries(gpu)
    any_lengths = _leading(keys, [gpu_entries, *map(_entries, lower)])
    return any_lengths, (_leading(keys, [gpu_entries]) if lower else dict(any_lengths))


def _entries(table: BlockTable) -> dict[int, int]:
    if not isinstance(table, PureBlockTable):
        raise TypeError("the pure backend's functions take PureBlockTable")
    return table._entries


def _leading(keys: Sequence[int], tables: list[dict[int, int]]) -> dict[int, int]:
    """Bit -> leading `keys` whose mask (OR over `tables`) has it. The keys are probed with C-level
    `map(dict.get)` in growing chunks (64, then 8x more), stopping at the first chunk where no bit is left;
    within a chunk the masks are AND-accumulated and, as the running AND only loses bits (so as a number it
    never grows), each drop point is found by bisection: Python-level work per drop point, not per block."""
    lengths: dict[int, int] = {}
    alive = -1
    start, size, total = 0, _FIRST_CHUNK, len(keys)
    while start < total:
        chunk = keys[start : start + size]
        masks = list(map(tables[0].get, chunk, _ZEROS))
        for table in tables[1:]:
            if not table.keys().isdisjoint(chunk):
                masks = list(map(operator.or_, masks, map(table.get, chunk, _ZEROS)))
        if alive < 0:
            alive = masks[0]
        if masks.count(alive) != len(masks):  # else every live bit holds the whole chunk
            running = list(itertools.accumulate(masks, operator.and_, initial=alive))[1:]
            position = 0
            while alive:
                drop = bisect.bisect_right(running, -alive, lo=position, key=operator.neg)
                if drop == len(running):
                    break
                _record(lengths, alive & ~running[drop], start + drop)
                alive = running[drop]
                position = drop
        if not alive:
            return lengths
        start += size
        size *= 8
    _record(lengths, alive, total)
    return lengths


def _record(lengths: dict[int, int], bits: int, length: int) -> None:
    while bits:
        low = bits & -bits
        lengths[low.bit_length() - 1] = length
        bits ^= low


def held_counts(tables: tuple[BlockTable, ...], excluded_bits: Sequence[int], /) -> tuple[dict[int, int], int]:
    merged: dict[int, int] = {}
    for table in tables:
        for key, value in table.items():
            merged[key] = merged.get(key, 0) | value
    excluded = 0
    for bit in excluded_bits:
        excluded |= 1 << bit
    counts: dict[int, int] = {}
    distinct = 0
    for mask in merged.values():
        distinct += bool(mask & ~excluded)
        while mask:
            low = mask & -mask
            bit = low.bit_length() - 1
            counts[bit] = counts.get(bit, 0) + 1
            mask ^= low
    return counts, distinct


def remove_blocks(
    engine_map: BlockTable, hashes: Iterable[int], tier: BlockTable, tables: tuple[BlockTable, ...], bit: int, /
) -> int:
    unknown = 0
    for engine_hash in list(hashes):
        key = engine_map.get(engine_hash)
        if key is None:
            unknown += 1
            continue
        tier.clear_bit([key], bit)
        if not any(table.has_bit(key, bit) for table in tables):
            engine_map.pop(engine_hash)
    return unknown


def clear_source(engine_map: BlockTable, tables: tuple[BlockTable, ...], bit: int, /) -> int:
    if not tables or engine_map.words != 1:
        raise ValueError("clear_source needs a one-word map and at least one table")
    keys = [key for _, key in engine_map.items()]
    return sum(table.clear_bit(keys, bit) for table in tables)


def expire_marks(marks: BlockTable, keys: Sequence[int], now: int, gpu: BlockTable, bit: int, /) -> int:
    if marks.words != 1:
        raise ValueError("the marks must be a one-word table")
    gpu.clear_bit((), bit)  # the bit is checked before anything changes, as in C
    dropped = []
    for key in keys:
        mark = marks.get(key)
        if mark is not None and mark <= now:
            marks.pop(key)
            dropped.append(key)
    gpu.clear_bit(dropped, bit)
    return len(dropped)


__all__ = ["PureBlockTable", "clear_source", "expire_marks", "held_counts", "prefix_lengths", "remove_blocks"]
