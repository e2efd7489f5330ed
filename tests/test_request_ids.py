"""Request ids the router makes up: uuid4-shaped, unique within a process and apart across processes."""

from __future__ import annotations

from kvrouter.server.request_ids import RequestIds


def test_ids_are_32_hex_digits_with_the_prefix_first_and_a_counter_after() -> None:
    ids = RequestIds(prefix=0xABC)
    first, second = ids(), ids()
    assert first == "0000000000000abc" + "0" * 16
    assert second == "0000000000000abc" + "0" * 15 + "1"
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in (first, second))


def test_ids_are_unique_in_a_process_and_two_processes_draw_different_prefixes() -> None:
    ids = RequestIds()
    assert len({ids() for _ in range(10_000)}) == 10_000
    assert RequestIds()()[:16] != RequestIds()()[:16]  # two random 64-bit draws: equal once in 2**64
