"""The compiled block tables held against their pure-Python twin, operation by operation, and their edges."""

from __future__ import annotations

import random
import subprocess
import sys
import tracemalloc

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvrouter.blocks import chain_keys
from kvrouter.blocktable import Backend, BlockTable, load_backend, native_backend, pure_backend

NATIVE = native_backend()
PURE = pure_backend()

# A small pool (so keys meet again, collide in small tables and wrap around the probe area), 0 and the top value
# (the spare zero slot, the largest key), and now and then any key at all.
POOL = [0, 1, 2, 3, 2**64 - 1, 2**63, *(random.Random(7).getrandbits(64) for _ in range(40))]
KEYS = st.one_of(st.sampled_from(POOL), st.integers(0, 2**64 - 1))
KEY_LISTS = st.lists(KEYS, max_size=30)


class NativeVersusPure(RuleBasedStateMachine):
    """Two tiers and two engine maps per backend, driven alike; every reading must agree."""

    @initialize(ordered=st.booleans())
    def build(self, ordered: bool) -> None:
        self.ordered = ordered
        self.sides: list[tuple[Backend, tuple[BlockTable, BlockTable], tuple[BlockTable, BlockTable]]] = []
        for backend in (NATIVE, PURE):
            tiers = (backend.table(1, ordered), backend.table(1, ordered))
            maps = (backend.table(1, False), backend.table(1, False))
            self.sides.append((backend, tiers, maps))
        self.words = 1

    @rule(tier=st.integers(0, 1), keys=KEY_LISTS, bit=st.sampled_from([0, 1, 2, 5, 63, 64, 65, 130]))
    def or_bit(self, tier: int, keys: list[int], bit: int) -> None:
        if bit >= self.words * 64:
            for _, tiers, _ in self.sides:
                with pytest.raises(ValueError):
                    tiers[tier].or_bit(keys, bit)
            return
        for _, tiers, _ in self.sides:
            tiers[tier].or_bit(keys, bit)

    @rule(tier=st.integers(0, 1), keys=KEY_LISTS, bit=st.sampled_from([0, 1, 2, 5, 63, 64]))
    def clear_bit(self, tier: int, keys: list[int], bit: int) -> None:
        if bit >= self.words * 64:
            return
        cleared = {tiers[tier].clear_bit(keys, bit) for _, tiers, _ in self.sides}
        assert len(cleared) == 1

    @rule(tier=st.integers(0, 1), keys=KEY_LISTS)
    def touch(self, tier: int, keys: list[int]) -> None:
        for _, tiers, _ in self.sides:
            tiers[tier].touch(keys)

    @precondition(lambda self: self.ordered)
    @rule(tier=st.integers(0, 1), count=st.integers(0, 20))
    def evict(self, tier: int, count: int) -> None:
        evicted = {tiers[tier].evict_oldest(count) for _, tiers, _ in self.sides}
        assert len(evicted) == 1

    @precondition(lambda self: self.words < 3)
    @rule()
    def widen(self) -> None:
        self.words += 1
        for _, tiers, _ in self.sides:
            for table in tiers:
                table.widen(self.words)

    @rule(which=st.integers(0, 1), pairs=st.lists(st.tuples(KEYS, KEYS), max_size=20))
    def map_set(self, which: int, pairs: list[tuple[int, int]]) -> None:
        for _, _, maps in self.sides:
            maps[which].set_many([h for h, _ in pairs], [k for _, k in pairs])

    @rule(which=st.integers(0, 1), key=KEYS)
    def map_pop(self, which: int, key: int) -> None:
        popped = {maps[which].pop(key) for _, _, maps in self.sides}
        assert len(popped) == 1

    @rule(which=st.integers(0, 1), tier=st.integers(0, 1), hashes=KEY_LISTS, bit=st.sampled_from([0, 1, 2]))
    def remove_blocks(self, which: int, tier: int, hashes: list[int], bit: int) -> None:
        unknown = {
            backend.remove_blocks(maps[which], hashes, tiers[tier], tiers, bit) for backend, tiers, maps in self.sides
        }
        assert len(unknown) == 1

    @rule(which=st.integers(0, 1), bit=st.sampled_from([0, 1, 2, 64]))
    def clear_source(self, which: int, bit: int) -> None:
        if bit >= self.words * 64:
            return
        cleared = {backend.clear_source(maps[which], tiers, bit) for backend, tiers, maps in self.sides}
        assert len(cleared) == 1

    @rule(which=st.integers(0, 1), bit=st.sampled_from([0, 1, 2]))
    def retain_held(self, which: int, bit: int) -> None:
        dropped = {maps[which].retain_held(tiers, bit) for _, tiers, maps in self.sides}
        assert len(dropped) == 1

    @rule(which=st.integers(0, 1), keys=KEY_LISTS, now=KEYS, bit=st.sampled_from([0, 1, 2, 64]))
    def expire_marks(self, which: int, keys: list[int], now: int, bit: int) -> None:
        # An engine map stands in for a replica's provisional marks (key -> end), the first tier for the GPU's.
        if bit >= self.words * 64:
            for backend, tiers, maps in self.sides:
                with pytest.raises(ValueError):
                    backend.expire_marks(maps[which], keys, now, tiers[0], bit)
            return
        dropped = {backend.expire_marks(maps[which], keys, now, tiers[0], bit) for backend, tiers, maps in self.sides}
        assert len(dropped) == 1

    @rule(keys=st.lists(KEYS, min_size=1, max_size=30), with_lower=st.booleans())
    def prefix_lengths(self, keys: list[int], with_lower: bool) -> None:
        results = [
            backend.prefix_lengths(keys, tiers[0], (tiers[1],) if with_lower else ())
            for backend, tiers, _ in self.sides
        ]
        assert results[0] == results[1]

    @rule(excluded=st.lists(st.sampled_from([0, 1, 2, 64]), max_size=3))
    def held_counts(self, excluded: list[int]) -> None:
        excluded = [bit for bit in excluded if bit < self.words * 64]
        results = [backend.held_counts(tiers, excluded) for backend, tiers, _ in self.sides]
        assert results[0] == results[1]

    @invariant()
    def same_entries(self) -> None:
        (_, native_tiers, native_maps), (_, pure_tiers, pure_maps) = self.sides
        for native, pure in zip(native_tiers, pure_tiers, strict=True):
            assert len(native) == len(pure)
            if self.ordered:
                assert native.items() == pure.items()  # the recency order too
            else:
                assert dict(native.items()) == dict(pure.items())
            assert native.words == pure.words == self.words
        for native, pure in zip(native_maps, pure_maps, strict=True):
            assert dict(native.items()) == dict(pure.items())
            assert len(native) == len(pure)


NativeVersusPure.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestNativeVersusPure = NativeVersusPure.TestCase


@pytest.mark.parametrize("backend", [NATIVE, PURE], ids=lambda b: b.name)
def test_zero_and_the_top_key_are_ordinary_keys(backend: Backend) -> None:
    table = backend.table()
    table.or_bit([0, 2**64 - 1], 3)
    assert table.get(0) == table.get(2**64 - 1) == 8
    assert table.clear_bit([0], 3) == 1
    assert table.get(0) is None and len(table) == 1


def test_the_native_backend_is_what_loads_here() -> None:
    # The extension is built by `pip install` (optional, so an install without a compiler still works): this
    # machine has one, so the router must be running the compiled tables.
    assert load_backend().name == "native"


def test_bad_keys_and_bits_raise_before_anything_changes() -> None:
    table = NATIVE.table()
    table.or_bit([1, 2], 0)
    with pytest.raises(TypeError):
        table.or_bit([3, "4"], 0)  # type: ignore[list-item]
    with pytest.raises(ValueError):
        table.or_bit([3], 64)
    assert dict(table.items()) == {1: 1, 2: 1}
    with pytest.raises(ValueError):
        NATIVE.table(0)
    with pytest.raises(ValueError):
        NATIVE.table(1).evict_oldest(1)  # unordered
    with pytest.raises(ValueError):
        NATIVE.table(2).set_many([1], [2])


def test_ints_are_taken_modulo_2_to_the_64() -> None:
    # As wire.py folds engine hashes: a signed 64-bit hash keeps its bits, a wider int its low 64 bits.
    table = NATIVE.table()
    table.set_many([-1, -(2**63), 2**64 + 7], [5, 6, 7])
    assert table.get(2**64 - 1) == 5 and table.get(2**63) == 6 and table.get(7) == 7
    assert NATIVE.remove_blocks(table, [-1, -2], NATIVE.table(), (NATIVE.table(),), 0) == 1


def test_wide_masks_read_back_as_one_int() -> None:
    table = NATIVE.table(3)
    table.or_bit([9], 0)
    table.or_bit([9], 70)
    table.or_bit([9], 191)
    assert table.get(9) == 1 | 1 << 70 | 1 << 191
    any_lengths, gpu_lengths = NATIVE.prefix_lengths([9, 10], table, ())
    assert any_lengths == gpu_lengths == {0: 1, 70: 1, 191: 1}


@pytest.mark.parametrize("ordered", [False, True])
def test_memory_stays_in_the_load_band_as_the_table_grows_and_shrinks(ordered: bool) -> None:
    # 16 bytes per one-word entry at a load between 0.53 and 0.8 (plus 8 bytes of links per slot when ordered),
    # measured by tracemalloc as well as by the table's own count.
    rng = random.Random(1)
    table = NATIVE.table(1, ordered)
    per_slot = 16 + (8 if ordered else 0)
    tracemalloc.start()
    try:
        for _ in range(40):
            table.or_bit([rng.getrandbits(64) for _ in range(2_500)], 0)
            traced = tracemalloc.get_traced_memory()[0]
            entries = len(table)
            assert per_slot * entries / 0.8 <= table.nbytes <= per_slot * entries / 0.5 + 512
            assert abs(traced - table.nbytes) <= 4096 + 0.05 * table.nbytes
    finally:
        tracemalloc.stop()
    keys = [key for key, _ in table.items()]
    table.clear_bit(keys[: len(keys) * 9 // 10], 0)  # most of it goes: the table gives the memory back
    assert len(table) == len(keys) - len(keys) * 9 // 10
    assert table.nbytes <= per_slot * len(table) / 0.5 + 512


def test_deleting_from_a_crowded_table_keeps_every_other_key_reachable() -> None:
    # Backward-shift deletion over long probe runs that wrap past the end of the slot array.
    rng = random.Random(5)
    table = NATIVE.table(1, True)
    alive: dict[int, None] = {}
    for round_ in range(200):
        new = [rng.getrandbits(64) for _ in range(rng.randrange(1, 40))]
        table.or_bit(new, round_ % 3)
        alive.update(dict.fromkeys(reversed(new)))
        for key in rng.sample(list(alive), min(len(alive), rng.randrange(0, 30))):
            assert table.pop(key) is not None
            del alive[key]
        assert len(table) == len(alive)
        assert all(table.get(key) is not None for key in alive)
    assert [key for key, _ in table.items()] == list(alive)  # oldest first, through every move


def test_without_the_compiled_extensions_the_router_still_routes() -> None:
    # An install without a C compiler: the three extensions missing. The index, the block keys and the cost refit
    # fall back to their pure-Python twins and give the same answers (the app logs a warning for each at start).
    script = """
import importlib.abc, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name in ("kvrouter._blocktable", "kvrouter._blockkeys", "kvrouter._costfit"):
            raise ImportError(name)
sys.meta_path.insert(0, Missing())
from kvrouter.blocks import chain_keys, native_block_keys
from kvrouter.blocktable import load_backend
from kvrouter.index import PrefixIndex
from kvrouter.routing.calibration import Observation, ReplicaCosts, fit_costs, native_cost_fit
window = [Observation(w, 0.5, 1.0, 2.0, 0.01 + w / 1e4) for w in (10.0, 20.0, 40.0, 80.0)]
fit = fit_costs(window, ReplicaCosts(1e4, 0.01, 0.0))
keys = chain_keys(list(range(64)), 16)
index = PrefixIndex()
index.store_keys("a", [1, 2, 3, 4], keys)
print(native_block_keys(), load_backend().name, index.backend.name, index.longest_prefixes(keys, 0.0)["a"].blocks,
      keys[0], native_cost_fit(), fit is not None)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "pure", "pure", "4", str(chain_keys(list(range(64)), 16)[0]), "False", "True"]
