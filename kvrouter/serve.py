"""`kvrouter [serve] --replicas replicas.yaml`: run the router.

Settings come from the environment (`KVROUTER_*`) with command-line flags on top; replicas.yaml is read with
`load_fleet`. Any bad file or value ends the process with exit code 2 and one line on stderr that names the
file or setting, the field and what was expected. The server runs on uvloop with handler cancellation (a client
that disconnects cancels its request upstream), freezes its start-up heap out of the garbage collector's
full passes (a tail-latency spike otherwise), and shuts down gracefully on SIGTERM/SIGINT: it stops accepting,
gives in-flight requests `shutdown_grace_s` to finish, then stops background work.
`--workers N` runs N such processes on the port (SO_REUSEPORT), supervised by this one (`kvrouter.workers`).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any

from aiohttp import web
from pydantic import ValidationError
from pydantic_settings import SettingsError

from kvrouter.app import create_app
from kvrouter.client_limits import EDGE, EdgeSite
from kvrouter.config import POLICY_NAMES, ConfigError, FleetConfig, Settings, load_fleet

log = logging.getLogger("kvrouter")

# flag -> Settings field; values stay strings here so pydantic validates them and names the field on error.
FLAGS: dict[str, tuple[str, str]] = {
    "--replicas": ("replicas", "path of replicas.yaml (KVROUTER_REPLICAS)"),
    "--host": ("host", "address to listen on (default 0.0.0.0)"),
    "--port": ("port", "port to listen on (default 8000)"),
    "--policy": ("policy", f"routing policy: {', '.join(POLICY_NAMES)} (default kv_aware)"),
    "--log-level": ("log_level", "debug, info, warning or error"),
    "--workers": ("workers", "router processes sharing the port"),
    "--redis-url": ("redis_url", "follow KV events through Redis, e.g. redis://127.0.0.1:6379/0"),
    "--admin-token": ("admin_token", "Bearer token required by /debug and /admin endpoints"),
    "--max-retries": ("max_retries", "retries on another replica before any byte reached the client"),
    "--max-concurrency": ("max_concurrency", "requests in flight before new ones get 429"),
    "--max-body-bytes": ("max_body_bytes", "largest request body accepted"),
    "--connect-timeout": ("connect_timeout_s", "seconds to connect to a replica"),
    "--read-timeout": ("read_timeout_s", "longest wait in seconds for the next chunk from a replica"),
    "--health-interval": ("health_interval_s", "seconds between /health probes"),
    "--metrics-interval": ("metrics_interval_s", "seconds between engine /metrics scrapes"),
    "--shutdown-grace": ("shutdown_grace_s", "seconds in-flight requests get on SIGTERM"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for flag, (field, help_text) in FLAGS.items():
        parser.add_argument(flag, dest=field, default=None, metavar=field.upper(), help=help_text)


def _env_name(field: str) -> str:
    return f"KVROUTER_{field.upper()}"


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Environment first, flags on top; `ConfigError` with one line naming the setting and the problem."""
    overrides: dict[str, Any] = {
        field: getattr(args, field) for field, _ in FLAGS.values() if getattr(args, field, None) is not None
    }
    try:
        return Settings(**overrides)
    except ValidationError as error:
        first = error.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else "?"
        flag = next((f for f, (name, _) in FLAGS.items() if name == field), None)
        source = f"{flag} / {_env_name(field)}" if flag else _env_name(field)
        given = f", got {first['input']!r}" if "input" in first and not isinstance(first["input"], dict) else ""
        raise ConfigError(f"setting '{field}' ({source}): {first['msg']}{given}") from None
    except SettingsError as error:
        raise ConfigError(f"environment: {error}") from None


def load_configuration(args: argparse.Namespace) -> tuple[Settings, FleetConfig]:
    settings = settings_from_args(args)
    if settings.replicas is None:
        raise ConfigError("setting 'replicas' (--replicas / KVROUTER_REPLICAS): a replicas.yaml path is required")
    return settings, load_fleet(settings.replicas)


async def serve(
    app: web.Application, settings: Settings, fleet: FleetConfig, *, ready: Callable[[int], None] | None = None
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
    port = site.port
    log.info(
        "kvrouter listening on %s:%d; policy %s; %d replicas",
        settings.host,
        port,
        settings.policy,
        len(fleet.replicas),
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


def one_line(message: str) -> str:
    """Operators grep logs: a multi-line parser message (YAML's caret diagrams) becomes one line."""
    parts = [part.strip() for part in message.splitlines()]
    return " ".join(part for part in parts if part and set(part) != {"^"})


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(args: argparse.Namespace) -> int:
    try:
        settings, fleet = load_configuration(args)
        logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        # Built before the loop starts so a policy or tokenizer problem is a configuration error (exit 2).
        app = create_app(settings, fleet)
        if settings.workers > 1:
            from kvrouter.workers import check_workers

            check_workers(settings, fleet)
    except ConfigError as error:
        print(f"kvrouter: {one_line(str(error))}", file=sys.stderr)
        return 2
    if settings.workers > 1:
        from kvrouter.workers import run_workers

        return run_workers(settings, fleet)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(serve(app, settings, fleet))
