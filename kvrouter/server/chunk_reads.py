"""Reading a replica's answer chunk by chunk, each wait bounded by `read_timeout_s`, with one timer per answer.

aiohttp's own `sock_read` timer is dropped when a replica's chunked framing breaks mid-body, so the proxy bounds
every wait for the next chunk itself. An `asyncio.timeout` around each read did that at the price of a Timeout
object and a loop timer made and torn down per chunk (~4-5 µs each here), and a streamed answer is read one SSE
event at a time. `ChunkReader` keeps one loop timer per answer: a read only notes when it began; when the timer
fires it either re-arms itself for the deadline of the read now waiting, or, when that read has waited the whole
window, fails it with the `TimeoutError` that `asyncio.timeout` raised, through the stream's own `set_exception`
(no task is cancelled). Between reads (while a chunk goes to the client) no deadline runs, as before.
"""

from __future__ import annotations

import asyncio

import aiohttp


class ChunkReader:
    """`read()`: the next chunk of `content` (b"" at its end); `TimeoutError` after `seconds` without one."""

    __slots__ = ("_armed_for", "_content", "_loop", "_seconds", "_since", "_timer")

    def __init__(self, content: aiohttp.StreamReader, seconds: float) -> None:
        self._content = content
        self._loop = asyncio.get_running_loop()
        self._seconds = seconds
        self._since: float | None = None
        """When the read now waiting began; None between reads."""
        self._timer: asyncio.TimerHandle | None = None
        self._armed_for = 0.0
        """The loop time the timer is set for."""

    async def read(self) -> bytes:
        since = self._loop.time()
        self._since = since
        if self._timer is None:
            self._arm(since + self._seconds)
        try:
            return await self._content.readany()
        finally:
            self._since = None

    def buffered(self) -> bytes:
        """What has arrived and not been read, without waiting: what `read()` would return at once (its errors
        included), or b"" when it would wait (or the answer has ended: `at_end()`). A chunk that is already here
        needs no deadline, and no timer is armed for it."""
        return self._content.read_nowait()

    def at_end(self) -> bool:
        """The answer has ended: its end was seen and every chunk before it has been read."""
        return self._content.at_eof()

    def close(self) -> None:
        """The answer is done with: drop the timer (and with it the cycle timer -> bound `_check` -> self)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        since = self._since
        if since is None:
            self._timer = None  # no read waiting: the next one arms the timer again
            return
        deadline = since + self._seconds
        if deadline <= self._armed_for:
            # The timer set for this read's deadline fired (the loop may run a timer a clock tick early, as it
            # would have run asyncio.timeout's).
            self._timer = None
            self._content.set_exception(TimeoutError())
            return
        self._arm(deadline)

    def _arm(self, when: float) -> None:
        self._armed_for = when
        self._timer = self._loop.call_at(when, self._check)
