"""The admin API: look at and steer the fleet of a running router, and tell orchestrators when it is ready.

Routes, all behind `Settings.admin_token` sent as ``Authorization: Bearer TOKEN`` (with no token configured they
answer 403: a router is never steerable by accident):

* ``GET  /admin/replicas`` — every replica with its state, load, cached blocks and drain flag.
* ``POST /admin/replicas/{name}/drain`` — no new request goes there; requests in flight finish. With
  ``?wait=SECONDS`` the answer waits until the replica has nothing in flight (or the time is up), which is what
  a rollout script wants before restarting the engine.
* ``POST /admin/replicas/{name}/undrain`` — routable again.
* ``POST /admin/reload`` — re-read replicas.yaml and apply it live; SIGHUP does the same.

And, open because kubelets and load balancers call them: ``GET /ready`` — 200 once every readiness check passes
(the fleet is loaded, the event source has delivered the prefix index), else 503 naming the failing checks; and
``GET /live`` — 200 while the event loop answers (liveness must not fail when the replicas do: /health answers
503 when no replica is routable, and restarting the router would not help).

A reload is planned purely (`plan_reload`) and applied through `FleetHooks`, which the app factory implements
over its replica set, load book, index and event sources. Added replicas start probing and following events;
removed replicas take no new requests at once and their in-flight requests finish on the objects they already
hold; a replica whose URL, events endpoint or block size changed starts afresh (its index entries are dropped);
a weight change applies in place. Drain flags survive a reload. Fleet-wide fields (tokenizer, block_size,
hash_seed, lora_adapters) change every block key, so a reload that changes them is refused with 409: restart.
Drain state is per router instance; run the call against every instance (docs/runbook.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvrouter.config import ConfigError, FleetConfig, ReplicaConfig, load_fleet
from kvrouter.typedefs import ReplicaName

log = logging.getLogger(__name__)

FLEET_WIDE_FIELDS = ("tokenizer", "block_size", "hash_seed", "lora_adapters")
"""replicas.yaml fields every block key depends on: changing them live would silently empty the index."""

DRAIN_POLL_S = 0.05
MAX_DRAIN_WAIT_S = 3600.0


class ReloadRefused(Exception):
    """The new replicas.yaml cannot be applied live; the message says why and what to do instead."""


@dataclass(frozen=True, slots=True)
class ReloadPlan:
    """What a reload changes, by replica name, in replicas.yaml order."""

    added: tuple[ReplicaConfig, ...] = ()
    removed: tuple[ReplicaName, ...] = ()
    replaced: tuple[ReplicaConfig, ...] = ()
    """Same name, different URL, events endpoint or block size: a different engine as far as the index knows."""
    reweighted: tuple[ReplicaConfig, ...] = ()
    unchanged: tuple[ReplicaName, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.replaced or self.reweighted)

    def as_json(self) -> dict[str, list[str]]:
        return {
            "added": [r.name for r in self.added],
            "removed": list(self.removed),
            "replaced": [r.name for r in self.replaced],
            "reweighted": [r.name for r in self.reweighted],
            "unchanged": list(self.unchanged),
        }


def plan_reload(current: FleetConfig, new: FleetConfig) -> ReloadPlan:
    """Compare two fleets; raises `ReloadRefused` when a fleet-wide field changed."""
    changed = [name for name in FLEET_WIDE_FIELDS if getattr(current, name) != getattr(new, name)]
    if changed:
        raise ReloadRefused(
            f"{', '.join(changed)} changed; every block key depends on "
            f"{'it' if len(changed) == 1 else 'them'}, so restart the router to apply this file"
        )
    old = {r.name: r for r in current.replicas}
    added: list[ReplicaConfig] = []
    replaced: list[ReplicaConfig] = []
    reweighted: list[ReplicaConfig] = []
    unchanged: list[ReplicaName] = []
    for replica in new.replicas:
        before = old.get(replica.name)
        if before is None:
            added.append(replica)
        elif before == replica:
            unchanged.append(replica.replica)
        elif before.model_copy(update={"weight": replica.weight}) == replica:
            reweighted.append(replica)
        elif current.block_size_of(before) != new.block_size_of(replica) or before.url != replica.url or (
            before.kv_events != replica.kv_events
        ):
            replaced.append(replica)
        else:
            unchanged.append(replica.replica)
    names = {r.name for r in new.replicas}
    removed = tuple(ReplicaName(r.name) for r in current.replicas if r.name not in names)
    return ReloadPlan(tuple(added), removed, tuple(replaced), tuple(reweighted), tuple(unchanged))


class FleetHooks(Protocol):
    """What the admin API needs from the application; the app factory implements it over its own parts."""

    def describe_replicas(self) -> list[dict[str, object]]:
        """One JSON-able dict per replica, in order, each with at least "name" and "in_flight"."""
        ...

    def in_flight(self, name: ReplicaName) -> int: ...

    def set_draining(self, name: ReplicaName, draining: bool) -> None: ...

    async def add_replica(self, fleet: FleetConfig, replica: ReplicaConfig) -> None:
        """Start routing to, probing and following the events of a new replica."""
        ...

    async def remove_replica(self, name: ReplicaName) -> None:
        """Stop routing to it and following its events, forget its index entries; in-flight requests finish."""
        ...

    def reweight_replica(self, fleet: FleetConfig, replica: ReplicaConfig) -> None: ...


class AdminMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.reloads = Counter(
            "kvrouter_fleet_reloads", "replicas.yaml reloads, by result (applied, unchanged, invalid, refused).",
            ["result"], registry=registry,
        )
        self.draining = Gauge(
            "kvrouter_replica_draining", "1 while an operator has drained the replica on this router.",
            ["replica"], registry=registry,
        )
        self.fleet_replicas = Gauge(
            "kvrouter_fleet_replicas", "Replicas in the loaded replicas.yaml.", registry=registry,
        )


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


class FleetAdmin:
    """Holds the loaded fleet and the drain flags; serialises reloads."""

    def __init__(
        self,
        *,
        fleet: FleetConfig,
        fleet_path: Path | None,
        hooks: FleetHooks,
        metrics: AdminMetrics,
        load: Callable[[Path], FleetConfig] = load_fleet,
    ) -> None:
        self.fleet = fleet
        self.fleet_path = fleet_path
        self.hooks = hooks
        self.metrics = metrics
        self.draining: set[ReplicaName] = set()
        self._load = load
        self._lock = asyncio.Lock()
        metrics.fleet_replicas.set(len(fleet.replicas))

    def has(self, name: str) -> bool:
        return any(r.name == name for r in self.fleet.replicas)

    def drain(self, name: ReplicaName) -> None:
        self.draining.add(name)
        self.hooks.set_draining(name, True)
        self.metrics.draining.labels(name).set(1)
        log.info("replica %s drained: no new requests", name)

    def undrain(self, name: ReplicaName) -> None:
        self.draining.discard(name)
        self.hooks.set_draining(name, False)
        self.metrics.draining.labels(name).set(0)
        log.info("replica %s undrained", name)

    async def wait_idle(self, name: ReplicaName, timeout_s: float) -> int:
        """Wait until `name` has nothing in flight or `timeout_s` passed; the in-flight count at the end."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        # Polled: the load book counts requests synchronously on the hot path and notifies nobody.
        while True:
            remaining = self.hooks.in_flight(name)
            left = deadline - loop.time()
            if remaining == 0 or left <= 0:
                return remaining
            await asyncio.sleep(min(DRAIN_POLL_S, left))

    async def reload(self) -> ReloadPlan:
        """Re-read replicas.yaml and apply it; raises ConfigError or ReloadRefused and then changes nothing."""
        if self.fleet_path is None:
            raise ReloadRefused("this router was started without a replicas.yaml path; nothing to re-read")
        async with self._lock:
            try:
                new = await asyncio.to_thread(self._load, self.fleet_path)
                plan = plan_reload(self.fleet, new)
            except ConfigError:
                self.metrics.reloads.labels("invalid").inc()
                raise
            except ReloadRefused:
                self.metrics.reloads.labels("refused").inc()
                raise
            await self._apply(new, plan)
            self.fleet = new
            self.metrics.fleet_replicas.set(len(new.replicas))
            self.metrics.reloads.labels("unchanged" if plan.empty else "applied").inc()
            if not plan.empty:
                log.info("replicas.yaml reloaded: %s", plan.as_json())
            return plan

    async def _apply(self, new: FleetConfig, plan: ReloadPlan) -> None:
        # Removals first: a replica renamed in place must not briefly exist twice in the index.
        for name in plan.removed:
            await self.hooks.remove_replica(name)
            self.draining.discard(name)
            with contextlib.suppress(KeyError):
                self.metrics.draining.remove(name)
        for replica in plan.replaced:
            await self.hooks.remove_replica(replica.replica)
            await self.hooks.add_replica(new, replica)
            if replica.replica in self.draining:
                self.hooks.set_draining(replica.replica, True)
        for replica in plan.reweighted:
            self.hooks.reweight_replica(new, replica)
        for replica in plan.added:
            await self.hooks.add_replica(new, replica)

    def describe(self) -> list[dict[str, object]]:
        views = self.hooks.describe_replicas()
        for view in views:
            view["draining"] = view.get("name") in self.draining
        return views


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
            {"error": {"message": "missing or wrong admin token", "type": "authentication_error",
                       "code": "invalid_admin_token"}},
            status=401, headers={"WWW-Authenticate": 'Bearer realm="kvrouter-admin"'},
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
    admin.drain(name)
    in_flight = await admin.wait_idle(name, wait) if wait > 0 else admin.hooks.in_flight(name)
    return web.json_response({"replica": name, "draining": True, "in_flight": in_flight, "idle": in_flight == 0})


async def undrain_replica(request: web.Request) -> web.Response:
    name = _replica_name(request)
    if isinstance(name, web.Response):
        return name
    admin = request.app[ADMIN_KEY]
    admin.undrain(name)
    return web.json_response({"replica": name, "draining": False})


async def reload_fleet(request: web.Request) -> web.Response:
    admin = request.app[ADMIN_KEY]
    try:
        plan = await admin.reload()
    except ConfigError as error:
        return _error(400, str(error), "invalid_replicas_file")
    except ReloadRefused as error:
        return _error(409, str(error), "reload_refused")
    return web.json_response({"reloaded": True, "changes": plan.as_json()})


async def ready(request: web.Request) -> web.Response:
    is_ready, checks = request.app[READINESS_KEY].evaluate()
    return web.json_response({"ready": is_ready, "checks": checks}, status=200 if is_ready else 503)


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
) -> Readiness:
    """Register the admin routes, /ready and (on the running loop) the SIGHUP reload; returns the Readiness."""
    readiness = readiness if readiness is not None else Readiness()
    app[ADMIN_KEY] = admin
    app[READINESS_KEY] = readiness
    app[ADMIN_TOKEN_KEY] = token or ""
    add_admin_routes(app)
    if reload_on_sighup:
        app.cleanup_ctx.append(_sighup_reload(admin))
    return readiness


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

