"""The block tables' interface: what the index needs of a table and of the whole-index operations over tables.

Its own module so that both implementations — `kvrouter/_blocktable.c` and `kvrouter/blocktable_pure.py` — and
the backend loader in `kvrouter/blocktable.py` import it one way, with no circle between loader and pure twin.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol


class BlockTable(Protocol):
    """uint64 key -> `words` uint64 words: a tier's block -> source-bit mask, or a source's engine hash -> key."""

    @property
    def words(self) -> int: ...
    @property
    def ordered(self) -> bool: ...
    @property
    def nbytes(self) -> int: ...
    def __len__(self) -> int: ...
    def widen(self, words: int, /) -> None: ...
    def get(self, key: int, /) -> int | None: ...
    def pop(self, key: int, /) -> int | None: ...
    def set_many(self, keys: Sequence[int], values: Sequence[int], /) -> None: ...
    def or_bit(self, keys: Sequence[int], bit: int, /) -> None: ...
    def clear_bit(self, keys: Iterable[int], bit: int, /) -> int: ...
    def has_bit(self, key: int, bit: int, /) -> bool: ...
    def touch(self, keys: Sequence[int], /) -> None: ...
    def evict_oldest(self, count: int, /) -> int: ...
    def items(self) -> list[tuple[int, int]]: ...
    def retain_held(self, tables: tuple[BlockTable, ...], bit: int, /) -> int: ...


class TableFactory(Protocol):
    def __call__(self, words: int = 1, ordered: bool = False) -> BlockTable: ...


class PrefixLengths(Protocol):
    def __call__(
        self, keys: Sequence[int], gpu: BlockTable, lower: tuple[BlockTable, ...], /
    ) -> tuple[dict[int, int], dict[int, int]]: ...


class HeldCounts(Protocol):
    def __call__(
        self, tables: tuple[BlockTable, ...], excluded_bits: Sequence[int], /
    ) -> tuple[dict[int, int], int]: ...


class RemoveBlocks(Protocol):
    def __call__(
        self,
        engine_map: BlockTable,
        hashes: Iterable[int],
        tier: BlockTable,
        tables: tuple[BlockTable, ...],
        bit: int,
        /,
    ) -> int: ...


class ClearSource(Protocol):
    def __call__(self, engine_map: BlockTable, tables: tuple[BlockTable, ...], bit: int, /) -> int: ...


class ExpireMarks(Protocol):
    def __call__(self, marks: BlockTable, keys: Sequence[int], now: int, gpu: BlockTable, bit: int, /) -> int: ...


__all__ = [
    "BlockTable",
    "ClearSource",
    "ExpireMarks",
    "HeldCounts",
    "PrefixLengths",
    "RemoveBlocks",
    "TableFactory",
]
