"""Request ids for requests that come without an `X-Request-Id`: unique, and cheap enough for the hot path.

An id is 32 hex digits like a uuid4's: 64 random bits drawn once per router process, then a 64-bit counter.
Ids stay unique across the router's processes and instances (a shared prefix is a 1 in 2**64 chance per pair)
and within one process by the counter, while a request costs an increment and a format instead of a
`uuid.uuid4()` (a 16-byte `os.urandom` read and a UUID object: ~2% of a request's router CPU). The random
prefix is a parameter, so tests can fix it.
"""

from __future__ import annotations

import itertools
import os


class RequestIds:
    """`ids()` -> the next id: `prefix` (default: 64 random bits) in the first 16 hex digits, a counter after."""

    def __init__(self, prefix: int | None = None) -> None:
        if prefix is None:
            prefix = int.from_bytes(os.urandom(8), "big")
        self._prefix = f"{prefix & ((1 << 64) - 1):016x}"
        self._counter = itertools.count()

    def __call__(self) -> str:
        return f"{self._prefix}{next(self._counter) & ((1 << 64) - 1):016x}"


__all__ = ["RequestIds"]
