"""`kvrouter [serve] --replicas replicas.yaml`: run the router.

Settings come from the environment (`KVROUTER_*`) with command-line flags on top; replicas.yaml is read with
`load_router_config` (one fleet, or a `models:` list of fleets: kvrouter/server/fleets.py). Any bad file or
value ends the process with exit code 2 and one line on stderr that names the file or setting, the field and
what was expected. The server runs on uvloop with handler cancellation (a client
that disconnects cancels its request upstream), freezes its start-up heap out of the garbage collector's
full passes (a tail-latency spike otherwise), and shuts down gracefully on SIGTERM/SIGINT: it stops accepting,
gives in-flight requests `shutdown_grace_s` to finish, then stops background work.
`--workers N` runs N such processes on the port (SO_REUSEPORT), supervised by this one (`kvrouter.server.workers`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any

from pydantic import ValidationError
from pydantic_settings import SettingsError

from kvrouter.config import POLICY_NAMES, ConfigError, FleetConfig, ModelsConfig, Settings, load_router_config
from kvrouter.server.fleets import build_router_app
from kvrouter.server.serving import loop_factory, serve

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
    "--flow-control": ("flow_control", "true/false: hold requests in the router while every replica is saturated"),
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


def load_configuration(args: argparse.Namespace) -> tuple[Settings, FleetConfig | ModelsConfig]:
    settings = settings_from_args(args)
    if settings.replicas is None:
        raise ConfigError("setting 'replicas' (--replicas / KVROUTER_REPLICAS): a replicas.yaml path is required")
    return settings, load_router_config(settings.replicas)


def one_line(message: str) -> str:
    """Operators grep logs: a multi-line parser message (YAML's caret diagrams) becomes one line."""
    parts = [part.strip() for part in message.splitlines()]
    return " ".join(part for part in parts if part and set(part) != {"^"})


def run(args: argparse.Namespace) -> int:
    try:
        settings, fleet = load_configuration(args)
        logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        # Built before the loop starts so a policy or tokenizer problem is a configuration error (exit 2).
        app = build_router_app(settings, fleet)
        if settings.workers > 1:
            from kvrouter.server.workers import check_workers

            check_workers(settings, fleet)
    except ConfigError as error:
        print(f"kvrouter: {one_line(str(error))}", file=sys.stderr)
        return 2
    if settings.workers > 1:
        from kvrouter.server.workers import run_workers

        return run_workers(settings, fleet)
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(serve(app, settings, fleet))
