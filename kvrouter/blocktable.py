"""Storage behind the prefix index: the compiled block tables, or their pure-Python twin.

`kvrouter/_blocktable.c` holds the index's tables as open-addressing arrays of 64-bit keys and mask words (about
a third of the memory of dicts of Python ints, and the lookup loop in C). `kvrouter/blocktable_pure.py` does the
same with dicts: the reference the compiled tables are tested against, and the fallback when the extension was
not built (an install without a C compiler). `load_backend()` picks the compiled one when it imports.
The interface both implement is in `kvrouter/blocktable_protocol.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from kvrouter.blocktable_protocol import (
    BlockTable,
    ClearSource,
    ExpireMarks,
    HeldCounts,
    PrefixLengths,
    RemoveBlocks,
    TableFactory,
)


@dataclass(frozen=True, slots=True)
class Backend:
    """One implementation of the tables and the whole-index operations over them.

    * `prefix_lengths(keys, gpu, lower)`: per source bit, the leading keys it holds in any tier and in `gpu`;
    * `held_counts(tables, excluded_bits)`: per bit, distinct keys holding it in any table; and distinct keys
      holding some bit outside `excluded_bits`;
    * `remove_blocks(engine_map, hashes, tier, tables, bit)`: a source's BlockRemoved; returns unknown hashes;
    * `clear_source(engine_map, tables, bit)`: a source's blocks gone; clears `bit` on the keys its map names;
    * `expire_marks(marks, keys, now, gpu, bit)`: provisional marks of `keys` at most `now` go, with `bit` in `gpu`.
    """

    name: str
    table: TableFactory
    prefix_lengths: PrefixLengths
    held_counts: HeldCounts
    remove_blocks: RemoveBlocks
    clear_source: ClearSource
    expire_marks: ExpireMarks


def pure_backend() -> Backend:
    from kvrouter import blocktable_pure as pure

    return Backend(
        "pure",
        pure.PureBlockTable,
        pure.prefix_lengths,
        pure.held_counts,
        pure.remove_blocks,
        pure.clear_source,
        pure.expire_marks,
    )


def native_backend() -> Backend:
    """The compiled tables; ImportError when the extension was not built."""
    from kvrouter import _blocktable as native

    return Backend(
        "native",
        cast(TableFactory, native.BlockTable),
        cast(PrefixLengths, native.prefix_lengths),
        cast(HeldCounts, native.held_counts),
        cast(RemoveBlocks, native.remove_blocks),
        cast(ClearSource, native.clear_source),
        cast(ExpireMarks, native.expire_marks),
    )


def load_backend() -> Backend:
    try:
        return native_backend()
    except ImportError:
        return pure_backend()


__all__ = ["Backend", "BlockTable", "load_backend", "native_backend", "pure_backend"]
