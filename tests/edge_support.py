"""A kvrouter served the way `kvrouter serve` serves it (AppRunner with handler cancellation, `EdgeSite` with its
connection cap and header timer) on 127.0.0.1 port 0, plus raw-socket helpers for hostile clients."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from kvrouter.config import parse_fleet
from kvrouter.metrics import RouterMetrics
from kvrouter.server.app import METRICS, PROXY, create_app
from kvrouter.server.client_limits import EDGE, ClientEdge, EdgeSite
from kvrouter.server.proxy import Proxy
from tests.conftest import router_settings
from tests.fake_replica import FakeReplica


@dataclass
class EdgeRouter:
    app: web.Application
    url: str
    port: int

    @property
    def edge(self) -> ClientEdge:
        return self.app[EDGE]

    @property
    def metrics(self) -> RouterMetrics:
        return self.app[METRICS]

    @property
    def proxy(self) -> Proxy:
        return self.app[PROXY]

    def rejections(self, reason: str) -> float:
        value = self.metrics.registry.get_sample_value("kvrouter_client_rejections_total", {"reason": reason})
        return value or 0.0


@asynccontextmanager
async def edge_router(
    replicas: list[FakeReplica],
    *,
    tokenizer: Path | None = None,
    port: int = 0,
    reuse_port: bool = False,
    **overrides: Any,
) -> AsyncIterator[EdgeRouter]:
    """`reuse_port`: listen with SO_REUSEPORT, as each `--workers` process does (several routers on one `port`)."""
    fleet_data: dict[str, Any] = {"replicas": [{"name": r.name, "url": r.url} for r in replicas]}
    if tokenizer is not None:
        fleet_data["tokenizer"] = str(tokenizer)
    fleet = parse_fleet(fleet_data, Path("edge-replicas.yaml"))
    app = create_app(router_settings(**overrides), fleet, registry=CollectorRegistry())
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = EdgeSite(runner, app[EDGE], "127.0.0.1", port, reuse_port=reuse_port)
    await site.start()
    try:
        yield EdgeRouter(app, f"http://127.0.0.1:{site.port}", site.port)
    finally:
        await runner.cleanup()


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """Everything the server sent until it closed the connection; fails if it stays open `seconds`."""
    return await asyncio.wait_for(reader.read(), timeout=seconds)


def status_of(answer: bytes) -> int:
    """The status code of the first HTTP response in `answer` (0 when there is none)."""
    if not answer.startswith(b"HTTP/1."):
        return 0
    try:
        return int(answer.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0


def content_length(head: bytes) -> int:
    """The Content-Length of an HTTP message head (request or response; 0 when absent)."""
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    return length


async def read_response(reader: asyncio.StreamReader, seconds: float = 15.0) -> tuple[int, bytes]:
    """One Content-Length-framed response: its status and body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), seconds)
    body = await asyncio.wait_for(reader.readexactly(content_length(head)), seconds)
    return status_of(head), body
