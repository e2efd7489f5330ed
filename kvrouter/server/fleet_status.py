"""The endpoints of a several-model router (`kvrouter.server.fleets`) that look at every fleet at once.

GET /v1/models lists what the fleets' routable replicas list, plus every configured model name, alias and LoRA
adapter (an adapter's `parent` is its fleet's model), so a model whose replicas are all down still shows.
GET /health: 200 while some fleet has a routable replica; `status` is ok (every fleet healthy), degraded or
unavailable, `models` has each fleet's own status and policy, `replicas` every replica with its `model`.
GET /ready: ready when every fleet's readiness checks pass (their names prefixed by the model).
GET /metrics: one exposition, the fleets' series labelled by `model` (`kvrouter.server.fleet_metrics`).
GET /debug/queue: `?model=` one fleet's router queue, else every fleet's.
The admin API: GET /admin/replicas (every fleet's, with `model`), drain and undrain (the fleet that has the
replica). POST /admin/reload and SIGHUP are refused: a models file is read once, at start; restart the router
to apply a change (drain first to lose nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from prometheus_client import generate_latest

from kvrouter.admin.api import ADMIN_KEY, ADMIN_TOKEN_KEY, READINESS_KEY, check_admin_token
from kvrouter.config import Settings
from kvrouter.metrics import RouterMetrics
from kvrouter.openai_request import RequestError
from kvrouter.server.fleet_metrics import exposition_registry
from kvrouter.server.model_directory import FleetApp, ModelDirectory
from kvrouter.server.proxy import error_response
from kvrouter.server.status import EVENT_STREAMS
from kvrouter.server.worker_metrics import EXPOSITION, metrics_response
from kvrouter.typedefs import ReplicaName

log = logging.getLogger(__name__)

RELOAD_REFUSED = (
    "live reload of a replicas.yaml with a 'models' list is not supported: restart the router to apply it "
    "(drain and undrain work per replica)"
)


class FleetsStatus:
    def __init__(self, directory: ModelDirectory, metrics: RouterMetrics) -> None:
        self.directory = directory
        self.fleets = directory.fleets
        self.first = self.fleets[0].proxy
        self.exposition = exposition_registry(metrics.registry, [(f.model, f.registry) for f in self.fleets])
        self.created = int(time.time())

    async def models(self, request: web.Request) -> web.Response:
        try:
            self.first.check_client(request)
        except RequestError as error:
            return error_response(error)
        answers = await asyncio.gather(*(fleet.status.listed_models() for fleet in self.fleets))
        merged: dict[str, dict[str, Any]] = {}
        for fleet, listed in zip(self.fleets, answers, strict=True):
            for entries in listed:
                for entry in entries:
                    merged.setdefault(str(entry.get("id")), entry)
            for name, parent in self._configured(fleet):
                entry = {"id": name, "object": "model", "created": self.created, "owned_by": "kvrouter", "root": name}
                merged.setdefault(name, entry if parent is None else {**entry, "parent": parent})
        return web.json_response({"object": "list", "data": list(merged.values())})

    @staticmethod
    def _configured(fleet: FleetApp) -> list[tuple[str, str | None]]:
        """Each configured name with its parent model (None: the model or an alias)."""
        names: list[tuple[str, str | None]] = [(fleet.model, None), *((alias, None) for alias in fleet.fleet.aliases)]
        return names + [(adapter, fleet.model) for adapter in sorted(fleet.fleet.all_adapters)]

    async def health(self, request: web.Request) -> web.Response:
        models: dict[str, dict[str, Any]] = {}
        replicas: dict[str, Any] = {}
        healthy = 0
        for fleet in self.fleets:
            body, routable = fleet.status.health_view(fleet.app.get(EVENT_STREAMS))
            healthy += routable
            models[fleet.model] = {"status": body["status"], "policy": body["policy"]}
            for name, view in body["replicas"].items():
                replicas[name] = {"model": fleet.model, **view}
        everywhere = all(view["status"] == "ok" for view in models.values())
        status = "ok" if everywhere else "degraded" if healthy else "unavailable"
        return web.json_response(
            {"status": status, "models": models, "replicas": replicas}, status=200 if healthy else 503
        )

    async def ready(self, request: web.Request) -> web.Response:
        checks: dict[str, str] = {}
        ready = True
        for fleet in self.fleets:
            fleet_ready, fleet_checks = fleet.app[READINESS_KEY].evaluate()
            ready = ready and fleet_ready
            checks.update({f"{fleet.model}/{name}": outcome for name, outcome in fleet_checks.items()})
        if ready:
            return web.json_response({"ready": True, "checks": checks})
        reason = "; ".join(f"{name}: {outcome}" for name, outcome in checks.items() if outcome != "ok")
        return web.json_response({"ready": False, "reason": reason, "checks": checks}, status=503)

    async def live(self, request: web.Request) -> web.Response:
        return web.json_response({"live": True})

    def own_exposition(self) -> bytes:
        """This process's metrics (the front's and every fleet's), gauges brought up to date."""
        for fleet in self.fleets:
            fleet.proxy.replicas.update_gauges()
        return generate_latest(self.exposition)

    async def prometheus(self, request: web.Request) -> web.Response:
        return await metrics_response(request, self.own_exposition())  # under --workers, every worker's

    async def debug_queue(self, request: web.Request) -> web.StreamResponse:
        try:
            self.first.check_admin(request)
            model = request.query.get("model")
            if model is not None:
                return await self.directory.find(model).status.debug_queue(request)
        except RequestError as error:
            return error_response(error)
        snapshots: dict[str, Any] = {}
        for fleet in self.fleets:
            gate = fleet.proxy.gate
            snapshots[fleet.model] = {"enabled": False} if gate is None else gate.snapshot()
        return web.json_response({"models": snapshots})

    # -- the admin API over every fleet ----------------------------------------------------------------------

    async def list_replicas(self, request: web.Request) -> web.Response:
        if (refusal := check_admin_token(request)) is not None:
            return refusal
        views = [{**view, "model": f.model} for f in self.fleets for view in f.app[ADMIN_KEY].describe()]
        return web.json_response({"replicas": views, "fleet_path": str(self.first.settings.replicas or "")})

    async def drain(self, request: web.Request) -> web.Response:
        return await self._set_draining(request, draining=True)

    async def undrain(self, request: web.Request) -> web.Response:
        return await self._set_draining(request, draining=False)

    async def _set_draining(self, request: web.Request, *, draining: bool) -> web.Response:
        if (refusal := check_admin_token(request)) is not None:
            return refusal
        name = request.match_info["name"]
        owner = next((f for f in self.fleets if f.app[ADMIN_KEY].has(name)), None)
        if owner is None:
            refused = RequestError(f"no replica named {name!r} in any fleet", status=404, code="unknown_replica")
            return error_response(refused)
        admin = owner.app[ADMIN_KEY]
        replica = ReplicaName(name)
        shared = await (admin.drain(replica) if draining else admin.undrain(replica))
        body: dict[str, Any] = {"replica": name, "model": owner.model, "draining": draining, "shared": shared}
        if draining:
            in_flight = admin.hooks.in_flight(replica)
            body.update(in_flight=in_flight, idle=in_flight == 0)
        return web.json_response(body)

    async def reload(self, request: web.Request) -> web.Response:
        if (refusal := check_admin_token(request)) is not None:
            return refusal
        return error_response(RequestError(RELOAD_REFUSED, status=409, code="reload_refused"))


async def _sighup_refused(_app: web.Application) -> AsyncIterator[None]:
    """SIGHUP would end the process (its default action): it is answered with the refusal, logged."""
    loop = asyncio.get_running_loop()
    installed = False
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        loop.add_signal_handler(signal.SIGHUP, lambda: log.error("SIGHUP reload not applied: %s", RELOAD_REFUSED))
        installed = True
    yield
    if installed:
        loop.remove_signal_handler(signal.SIGHUP)


def add_status_routes(
    app: web.Application, settings: Settings, directory: ModelDirectory, metrics: RouterMetrics
) -> FleetsStatus:
    status = FleetsStatus(directory, metrics)
    app[ADMIN_TOKEN_KEY] = settings.admin_token or ""
    app.router.add_get("/v1/models", status.models)
    app.router.add_get("/health", status.health)
    app.router.add_get("/ready", status.ready)
    app.router.add_get("/live", status.live)
    app.router.add_get("/metrics", status.prometheus)
    app[EXPOSITION] = status.own_exposition
    app.router.add_get("/debug/queue", status.debug_queue)
    app.router.add_get("/admin/replicas", status.list_replicas)
    app.router.add_post("/admin/replicas/{name}/drain", status.drain)
    app.router.add_post("/admin/replicas/{name}/undrain", status.undrain)
    app.router.add_post("/admin/reload", status.reload)
    app.cleanup_ctx.append(_sighup_refused)
    return status


__all__ = ["RELOAD_REFUSED", "FleetsStatus", "add_status_routes"]
