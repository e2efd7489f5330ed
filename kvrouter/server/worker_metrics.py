"""`/metrics` under `--workers N`: every worker's metrics in each scrape, told apart by a `worker` label.

The kernel hands each connection to the shared port to one worker (SO_REUSEPORT), a scrape included, and each
worker counts only what it served. Without this, successive scrapes would read different workers' counters:
series that jump up and down (Prometheus takes each drop for a counter reset) and gauges of one worker at a
time. So each worker also serves its own exposition on a Unix socket in the supervisor's private directory
(`workers_dir`, mode 0700: `metrics-<number>.sock`), and the worker a scrape reaches asks the others and answers
with every worker's samples, each labelled `worker="<number>"` (stable across a worker's restarts; its counters
restart from zero, which Prometheus reads as the reset it is), a family's lines together as the text format
requires. Sum over the label (`sum without (worker) (...)`) for the router's totals.

A worker that does not answer within `timeout_s` (it is restarting) is left out of that scrape, which says so in
`kvrouter_workers_scraped` / `kvrouter_workers_expected` (the answering worker's own series, added to the
exposition). Only the text of the expositions is handled (no sample is parsed into numbers): a sample line is
`name{labels} value`, and the label goes first inside its braces.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

log = logging.getLogger(__name__)

WORKER_METRICS: web.AppKey[WorkerMetrics] = web.AppKey("worker_metrics")
EXPOSITION: web.AppKey[Callable[[], bytes]] = web.AppKey("own_exposition")
"""The app's own exposition (its registries, gauges brought up to date), set where /metrics is routed."""

LOG_INTERVAL_S = 60.0


class WorkerMetrics:
    def __init__(
        self, directory: Path, number: int, workers: int, *, timeout_s: float = 2.0, max_bytes: int = 64 << 20
    ) -> None:
        self.directory = directory
        self.number = number
        self.workers = workers
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.path = self.socket_of(number)
        self._logged = -LOG_INTERVAL_S

    def socket_of(self, number: int) -> Path:
        return self.directory / f"metrics-{number}.sock"

    # -- the worker's own exposition, on its Unix socket ----------------------------------------------------

    async def context(self, app: web.Application) -> AsyncIterator[None]:
        """`app.cleanup_ctx`: serve `app`'s own exposition on this worker's socket while the app runs."""
        own = app[EXPOSITION]

        async def handle(request: web.Request) -> web.Response:
            return web.Response(body=own(), content_type="text/plain")

        inner = web.Application()
        inner.router.add_get("/metrics", handle)
        runner = web.AppRunner(inner, access_log=None)
        await runner.setup()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a socket left by this worker's previous process
        site = web.UnixSite(runner, str(self.path))
        await site.start()
        os.chmod(self.path, 0o600)
        try:
            yield
        finally:
            await runner.cleanup()
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    # -- a scrape of the shared port ------------------------------------------------------------------------

    async def gather(self, own: bytes) -> bytes:
        """Every worker's exposition merged, this worker's `own` included, each sample labelled with its worker."""
        numbers = [n for n in range(self.workers) if n != self.number]
        answers = await asyncio.gather(*(self._fetch(n) for n in numbers))
        parts = [(self.number, own)] + [(n, text) for n, text in zip(numbers, answers, strict=True) if text]
        missing = [n for n, text in zip(numbers, answers, strict=True) if not text]
        now = time.monotonic()
        if missing and now - self._logged >= LOG_INTERVAL_S:
            self._logged = now
            log.warning("metrics scrape: worker(s) %s did not answer (restarting?); left out", missing)
        return merge(parts, scraped=len(parts), expected=self.workers)

    async def _fetch(self, number: int) -> bytes:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            connector = aiohttp.UnixConnector(path=str(self.socket_of(number)))
            async with (
                aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
                session.get("http://worker/metrics") as response,
            ):
                if response.status != 200:
                    return b""
                body = bytearray()
                async for chunk in response.content.iter_any():
                    body += chunk
                    if len(body) > self.max_bytes:
                        return b""
                return bytes(body)
        except (aiohttp.ClientError, OSError, TimeoutError):
            return b""


async def metrics_response(request: web.Request, own: bytes) -> web.Response:
    """A /metrics answer: this process's exposition `own`, or under `--workers` every worker's."""
    workers = request.app.get(WORKER_METRICS)
    body = own if workers is None else await workers.gather(own)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def merge(parts: list[tuple[int, bytes]], *, scraped: int, expected: int) -> bytes:
    """Prometheus text expositions of several workers as one: each family's comment lines once, then every
    worker's samples of it, each with `worker="<number>"` first among its labels."""
    families: dict[bytes, list[bytes]] = {}
    comments: set[bytes] = set()
    for number, text in parts:
        label = b'worker="%d"' % number
        family = b""
        for line in text.split(b"\n"):
            if not line:
                continue
            if line.startswith(b"#"):
                words = line.split(b" ", 3)
                if len(words) >= 3 and words[1] in (b"HELP", b"TYPE"):
                    family = words[2]
                    if line not in comments:  # every worker's exposition has them: once
                        comments.add(line)
                        families.setdefault(family, []).append(line)
                continue
            families.setdefault(family, []).append(_labelled(line, label))
    out = [line for lines in families.values() for line in lines]
    out += [
        b"# HELP kvrouter_workers_expected Router processes under --workers.",
        b"# TYPE kvrouter_workers_expected gauge",
        b"kvrouter_workers_expected %d" % expected,
        b"# HELP kvrouter_workers_scraped Workers whose metrics this scrape holds (one restarting is left out).",
        b"# TYPE kvrouter_workers_scraped gauge",
        b"kvrouter_workers_scraped %d" % scraped,
    ]
    return b"\n".join(out) + b"\n"


def _labelled(line: bytes, label: bytes) -> bytes:
    """`name{a="b"} 1` -> `name{worker="0",a="b"} 1`; `name 1` -> `name{worker="0"} 1`."""
    brace = line.find(b"{")
    space = line.find(b" ")
    if brace != -1 and (space == -1 or brace < space):
        inner = line[brace + 1 :]
        return line[: brace + 1] + label + (b"," if not inner.startswith(b"}") else b"") + inner
    if space == -1:
        return line
    return line[:space] + b"{" + label + b"}" + line[space:]


__all__ = ["EXPOSITION", "WORKER_METRICS", "WorkerMetrics", "merge", "metrics_response"]
