"""Serving one built app: listen (SO_REUSEPORT under `--workers`), run until SIGTERM/SIGINT, drain, stop.

Shared by the `serve` subcommand (`kvrouter/serve.py`) and each `--workers` process
(`kvrouter/server/workers.py`), which both import it; neither imports the other's serving code, so there is no
circle between them.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
from collections.abc import Callable

from aiohttp import web

from kvrouter.config import FleetConfig, ModelsConfig, Settings
from kvrouter.server.client_limits import EDGE, EdgeSite

log = logging.getLogger("kvrouter")

YOUNG_GENERATION_THRESHOLD = 10_000
"""Net allocations of tracked objects before a young collection (CPython's default is 700). The request path makes
no reference cycles (tests/test_request_garbage.py), so a young collection finds nothing to free there, yet at
700 the allocation count of the requests in flight alone kept crossing it, a pass over every young object each
time (and the older generations' passes those trigger). At 10,000 that count stays under it in steady state
(seen on `loadtest/router_cpu.py`'s replicas with 20 tenants of 1,000-token prompts and 16 connections, not the
benchmark's load); cyclic garbage from rarer paths waits for at most that many objects."""


async def serve(
    app: web.Application,
    settings: Settings,
    fleet: FleetConfig | ModelsConfig,
    *,
    ready: Callable[[int], None] | None = None,
) -> int:
    """Serve `app` until SIGTERM/SIGINT; `ready` gets the bound port (useful with port 0)."""
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=settings.shutdown_grace_s, access_log=None)
    await runner.setup()
    site = EdgeSite(runner, app[EDGE], settings.host, settings.port, backlog=2048, reuse_port=settings.workers > 1)
    try:
        await site.start()
    except OSError as error:
        await runner.cleanup()
        print(f"kvrouter: cannot listen on {settings.host}:{settings.port}: {error.strerror or error}", file=sys.stderr)
        return 1
    # Everything built so far (modules, app, tokenizer) lives as long as the process: moving it out of the
    # collector's view keeps full collections, which would otherwise walk it all, from stalling requests.
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_GENERATION_THRESHOLD, *gc.get_threshold()[1:])
    port = site.port
    fleets = fleet.models if isinstance(fleet, ModelsConfig) else [fleet]
    log.info(
        "kvrouter listening on %s:%d; policy %s; %d replicas%s",
        settings.host,
        port,
        settings.policy,
        sum(len(f.replicas) for f in fleets),
        f" in {len(fleets)} fleets ({', '.join(str(f.model) for f in fleets)})" if len(fleets) > 1 else "",
    )
    if ready is not None:
        ready(port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    log.info("shutting down: no new connections; in-flight requests get up to %.0fs", settings.shutdown_grace_s)
    await runner.cleanup()
    log.info("stopped")
    return 0


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory
