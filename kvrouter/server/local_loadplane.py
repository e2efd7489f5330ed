"""Shared load between router processes on one host without Redis: `--workers N` over Unix datagram sockets.

The `--workers` supervisor makes a private directory (mode 0700) and hands it to every worker
(`KVROUTER_LOAD_SHARE_DIR`). Each worker binds one datagram socket there, `<pid>-<random>.sock`, and sends its
`LoadShare.report()` to every socket in the directory (listed again at most once a tick), its own included (the echo
measures the staleness, as on Redis): as soon as `LoadShare.notify` says its own load changed (a dispatch, a prefill
done, a request finished — the request only sets a flag; the sender task runs after it, and every change made before
it runs goes out in one report), on a change no listener signalled at the next tick (`interval_s`), and every
`heartbeat_s`. What it receives it folds in, exactly as from Redis (same codec, validation, expiry:
kvrouter/routing/sharing.py). A worker that died leaves its socket file: the next send is refused and the file is
removed; its load expires like a silent Redis peer's.

Why datagrams and not shared memory: a report is small and absolute, so one datagram per peer per interval carries
it whole, with nothing to lock; the fleet can change on a live reload (a shared-memory table would need a layout
every process agrees on, rebuilt in step); and the Redis plane's decoding, hostile-input checks and expiry apply
unchanged. A report larger than `max_datagram_bytes` leaves out its newest routed prefixes (hints only).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import math
import os
import random
import socket
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from aiohttp import web

from kvrouter.redisplane.loadplane import PlaneStats
from kvrouter.routing.sharing import LoadShare

log = logging.getLogger(__name__)


class LocalLoadPlane:
    def __init__(
        self,
        share: LoadShare,
        directory: Path,
        *,
        interval_s: float = 0.02,
        heartbeat_s: float = 0.5,
        max_datagram_bytes: int = 60_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.share = share
        self.directory = directory
        self.interval_s = interval_s
        self.heartbeat_s = heartbeat_s
        self.max_datagram_bytes = max_datagram_bytes
        self.clock = clock
        self.stats = PlaneStats()
        self.path = directory / f"{os.getpid()}-{random.getrandbits(32):08x}.sock"
        self.dropped = 0
        """Reports a peer's full queue refused (it is busy: it gets the next one)."""
        self._wake = asyncio.Event()
        share.notify = self._wake.set
        self._last_sent = 0.0
        self._own = str(self.path)
        self._peers: list[str] = []
        self._listed_at = -math.inf
        """The sockets in the directory, listed at most once a tick: a report goes out on every change."""

    def _drain(self, sock: socket.socket) -> None:
        while True:
            try:
                payload = sock.recv(self.max_datagram_bytes + 1024)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            self.stats.received += 1
            self.stats.received_bytes += len(payload)
            self.share.receive(payload, self.clock())

    def _send(self, sock: socket.socket) -> None:
        self._last_sent = now = self.clock()
        payload = self.share.report(self.max_datagram_bytes, now=now)
        if now - self._listed_at >= self.interval_s:
            self._listed_at = now
            try:
                # os.listdir, not Path.glob: this runs up to 50 times a second in every worker (glob cost ~0.7% of a
                # busy worker's samples).
                directory = str(self.directory)
                self._peers = [
                    os.path.join(directory, name) for name in os.listdir(directory) if name.endswith(".sock")
                ]
            except OSError:
                self._peers = [self._own]
        for peer in list(self._peers):
            try:
                sock.sendto(payload, peer)
            except (ConnectionRefusedError, FileNotFoundError):
                self._peers.remove(peer)
                with contextlib.suppress(OSError):
                    os.unlink(peer)  # its process is gone
                continue
            except BlockingIOError:
                self.dropped += 1
                continue
            except OSError as error:
                if error.errno != errno.EMSGSIZE:
                    raise
                self.dropped += 1
                continue
            if peer != self._own:
                self.stats.published_bytes += len(payload)
        self.stats.published += 1

    async def run(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        loop = asyncio.get_running_loop()
        try:
            sock.setblocking(False)
            sock.bind(str(self.path))
            os.chmod(self.path, 0o600)
            loop.add_reader(sock.fileno(), self._drain, sock)
            self.stats.connected = True
            self._send(sock)  # announce at once
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._ticker(), name="kvrouter-local-load-plane-tick")
                tasks.create_task(self._sender(sock), name="kvrouter-local-load-plane-sender")
        finally:
            self.stats.connected = False
            with contextlib.suppress(Exception):
                loop.remove_reader(sock.fileno())
            sock.close()
            with contextlib.suppress(OSError):
                self.path.unlink()

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            now = self.clock()
            self.share.expire(now)
            if self.share.due(now, self._last_sent, self.heartbeat_s):
                self._wake.set()

    async def _sender(self, sock: socket.socket) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.share.due(self.clock(), self._last_sent, self.heartbeat_s):
                self._send(sock)

    async def context(self, app: web.Application) -> AsyncIterator[None]:
        async def guarded() -> None:
            while True:
                try:
                    await self.run()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    self.stats.session_errors += 1
                    log.exception("local load plane failed; restarting it")
                    await asyncio.sleep(1.0)

        task = asyncio.create_task(guarded(), name="kvrouter-local-load-plane")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


__all__ = ["LocalLoadPlane"]
