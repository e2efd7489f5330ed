"""The admin API's HTTP shell, and the probes orchestrators call.

Routes, all behind `Settings.admin_token` sent as ``Authorization: Bearer TOKEN`` (with no token configured they
answer 403: a router is never steerable by accident):

* ``GET  /admin/replicas`` — every replica with its state, load, cached blocks and drain flag.
* ``POST /admin/replicas/{name}/drain`` — no new request goes there; requests in flight finish. With
  ``?wait=SECONDS`` the answer waits until the replica has nothing in flight (or the time is up), which is what
  a rollout script wants before restarting the engine.
* ``POST /admin/replicas/{name}/undrain`` — routable again.
* ``POST /admin/reload`` — re-read replicas.yaml and apply it live; SIGHUP does the same.

With Redis (``KVROUTER_REDIS_URL``) drains, undrains and reloads reach every router instance
(`kvrouter.admin.shared`); the answers say whether the change was shared. Without it they act on this instance.
The work itself is `kvrouter.fleet_admin.FleetAdmin`.

And, open because kubelets and load balancers call them: ``GET /ready`` — 200 once every readiness check passes
(at least one replica routable: configured, breaker not open, not drained — `replicas_routable`; the event
source has delivered the prefix index), else 503 with ``reason`` and the failing checks; and
``GET /live`` — 200 while the event loop answers (liveness must not fail when the replicas do: /health answers
503 when no replica is routable, and restarting the router would not help).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from aiohttp import web

from kvrouter.admin.fleet import FleetAdmin, ReloadRefused
from kvrouter.config import ConfigError
from kvrouter.redisplane.stopping import stop_task
from kvrouter.typedefs import ReplicaName

log = logging.getLogger(__name__)

MAX_DRAIN_WAIT_S = 3600.0


ReadinessCheck = Callable[[], "bool | str"]
"""True when ready; False or a short reason when not."""


@dataclass(slots=True)
class Readiness:
    """Named readiness checks; parts of the app register theirs (e.g. "events": the index caught up)."""

    checks: dict[str, ReadinessCheck] = field(default_factory=dict)

    def add(self, name: str, check: ReadinessCheck) -> None:
        self.checks[name] = check

    def evaluate(self) -> tuple[bool, dict[str, str]]:
        results: dict[str, str] = {}
        ready = True
        for name, check in self.checks.items():
            try:
                outcome = check()
            except Exception as error:  # a broken check means "not ready", never a 500 to the kubelet
                outcome = f"check failed: {type(error).__name__}: {error}"
            if outcome is True:
                results[name] = "ok"
            else:
                ready = False
                results[name] = outcome if isinstance(outcome, str) and outcome else "not ready"
        return ready, results


class ReplicaView(Protocol):
    """What readiness reads of one replica (`kvrouter.replicas.ReplicaState`)."""

    @property
    def name(self) -> ReplicaName: ...

    @property
    def routable(self) -> bool:
        """Breaker closed, or half-open with its trial free."""
        ...


class FleetView(Protocol):
    """What readiness reads of the fleet (`kvrouter.replicas.ReplicaSet`)."""

    @property
    def draining(self) -> set[ReplicaName]: ...

    def __iter__(self) -> Iterator[ReplicaView]: ...


def replicas_routable(fleet: FleetView) -> ReadinessCheck:
    """The "replicas" check: ready while at least one replica can take a request now, as the proxy decides it
    (`ReplicaSet.routable`); otherwise the reason names why none can."""

    def check() -> bool | str:
        states = list(fleet)
        if not states:
            return "no replicas configured"
        if any(state.routable and state.name not in fleet.draining for state in states):
            return True
        drained = sum(1 for state in states if state.name in fleet.draining)
        broken = sum(1 for state in states if not state.routable)
        if drained == len(states):
            return f"no replica is routable: all {len(states)} are draining"
        if broken == len(states):
            return f"no replica is routable: the circuit breaker is open on all {len(states)}"
        return f"no replica is routable: {drained} draining, {broken} with the circuit breaker open"

    return check


ADMIN_KEY = web.AppKey("kvrouter_admin", FleetAdmin)
READINESS_KEY = web.AppKey("kvrouter_readiness", Readiness)
ADMIN_TOKEN_KEY = web.AppKey("kvrouter_admin_token", str)


def _error(status: int, message: str, code: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": code}}, status=status)


def check_admin_token(request: web.Request) -> web.Response | None:
    """None when the request carries the admin token; otherwise the error answer to send."""
    token = request.app.get(ADMIN_TOKEN_KEY) or ""
    if not token:
        return _error(403, "the admin API is disabled: set KVROUTER_ADMIN_TOKEN to enable it", "admin_disabled")
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        return web.json_response(
            {
                "error": {
                    "message": "missing or wrong admin token",
                    "type": "authentication_error",
                    "code": "invalid_admin_token",
                }
            },
            status=401,
            headers={"WWW-Authenticate": 'Bearer realm="kvrouter-admin"'},
        )
    return None


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _guarded(handler: Handler) -> Handler:
    async def guarded(request: web.Request) -> web.StreamResponse:
        refusal = check_admin_token(request)
        if refusal is not None:
            return refusal
        return await handler(request)

    return guarded


def _replica_name(request: web.Request) -> ReplicaName | web.Response:
    name = request.match_info["name"]
    if not request.app[ADMIN_KEY].has(name):
        return _error(404, f"no replica named {name!r} in the loaded replicas.yaml", "unknown_replica")
    return ReplicaName(name)


async def list_replicas(request: web.Request) -> web.Response:
    admin = request.app[ADMIN_KEY]
    return web.json_response({"replicas": admin.describe(), "fleet_path": str(admin.fleet_path or "")})


def _wait_seconds(request: web.Request) -> float | web.Response:
    raw = request.query.get("wait")
    if raw is None or raw == "":
        return 0.0
    try:
        wait = float(raw)
    except ValueError:
        return _error(400, f"wait must be a number of seconds, got {raw!r}", "invalid_wait")
    if not 0 <= wait <= MAX_DRAIN_WAIT_S:
        return _error(400, f"wait must be between 0 and {MAX_DRAIN_WAIT_S:.0f} seconds", "invalid_wait")
    return wait


async def drain_replica(request: web.Request) -> web.Response:
    name = _replica_name(request)
    if isinstance(name, web.Response):
        return name
    wait = _wait_seconds(request)
    if isinstance(wait, web.Response):
        return wait
    admin = request.app[ADMIN_KEY]
    shared = await admin.drain(name)
    in_flight = await admin.wait_idle(name, wait) if wait > 0 else admin.hooks.in_flight(name)
    return web.json_response(
        {"replica": name, "draining": True, "in_flight": in_flight, "idle": in_flight == 0, "shared": shared}
    )


async def undrain_replica(request: web.Request) -> web.Response:
    name = _replica_name(request)
    if isinstance(name, web.Response):
        return name
    admin = request.app[ADMIN_KEY]
    shared = await admin.undrain(name)
    return web.json_response({"replica": name, "draining": False, "shared": shared})


async def reload_fleet(request: web.Request) -> web.Response:
    admin = request.app[ADMIN_KEY]
    try:
        plan, shared = await admin.reload()
    except ConfigError as error:
        return _error(400, str(error), "invalid_replicas_file")
    except ReloadRefused as error:
        return _error(409, str(error), "reload_refused")
    return web.json_response({"reloaded": True, "changes": plan.as_json(), "shared": shared})


async def ready(request: web.Request) -> web.Response:
    is_ready, checks = request.app[READINESS_KEY].evaluate()
    if is_ready:
        return web.json_response({"ready": True, "checks": checks})
    reason = "; ".join(f"{name}: {outcome}" for name, outcome in checks.items() if outcome != "ok")
    return web.json_response({"ready": False, "reason": reason, "checks": checks}, status=503)


async def live(request: web.Request) -> web.Response:
    return web.json_response({"live": True})


def add_admin_routes(app: web.Application) -> None:
    app.router.add_get("/admin/replicas", _guarded(list_replicas))
    app.router.add_post("/admin/replicas/{name}/drain", _guarded(drain_replica))
    app.router.add_post("/admin/replicas/{name}/undrain", _guarded(undrain_replica))
    app.router.add_post("/admin/reload", _guarded(reload_fleet))
    app.router.add_get("/ready", ready)
    app.router.add_get("/live", live)


def setup_admin(
    app: web.Application,
    admin: FleetAdmin,
    *,
    token: str | None,
    readiness: Readiness | None = None,
    reload_on_sighup: bool = True,
    sync_interval_s: float = 1.0,
) -> Readiness:
    """Register the admin routes, /ready, the SIGHUP reload and, with shared state, its poller; returns the
    Readiness."""
    readiness = readiness if readiness is not None else Readiness()
    app[ADMIN_KEY] = admin
    app[READINESS_KEY] = readiness
    app[ADMIN_TOKEN_KEY] = token or ""
    add_admin_routes(app)
    if reload_on_sighup:
        app.cleanup_ctx.append(_sighup_reload(admin))
    if admin.shared is not None:
        app.cleanup_ctx.append(_shared_sync(admin, sync_interval_s))
    return readiness


def _shared_sync(admin: FleetAdmin, interval_s: float) -> Callable[[web.Application], AsyncIterator[None]]:
    async def context(_app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(admin.run_sync(interval_s), name="kvrouter-admin-shared-state")
        yield
        await stop_task(task, "shared admin state", admin.shared.close if admin.shared is not None else None)
        if admin.shared is not None:
            await admin.shared.close()

    return context


def _sighup_reload(admin: FleetAdmin) -> Callable[[web.Application], AsyncIterator[None]]:
    async def context(_app: web.Application) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        pending: set[asyncio.Task[None]] = set()

        async def reload_logged() -> None:
            try:
                await admin.reload()
            except (ConfigError, ReloadRefused) as error:
                log.error("SIGHUP reload not applied: %s", error)
            except Exception:
                log.exception("SIGHUP reload failed")

        def on_sighup() -> None:
            task = loop.create_task(reload_logged())
            pending.add(task)
            task.add_done_callback(pending.discard)

        installed = False
        try:
            loop.add_signal_handler(signal.SIGHUP, on_sighup)
            installed = True
        except (NotImplementedError, RuntimeError, ValueError):
            # Not the main thread (tests, embedded use) or no signals on this platform: /admin/reload still works.
            log.debug("SIGHUP reload not installed on this loop")
        yield
        if installed:
            loop.remove_signal_handler(signal.SIGHUP)
        for task in list(pending):
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    return context
