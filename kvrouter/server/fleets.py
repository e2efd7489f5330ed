"""Several models behind one router: one fleet per served model, each request dispatched by its `model`.

A replicas.yaml with a `models:` list (`kvrouter.config.ModelsConfig`) makes one fleet per entry, each built by
`create_app` exactly as a one-fleet router is: its own prefix index, tokenizer, load book, policy (the entry's
`policy`, else the `policy` setting), replica set, KV-event ingest following only its replicas, flow gate and
metrics registry. Those fleet applications are never served themselves: `create_models_app` builds a front
application that owns the client edge (`kvrouter.server.client_limits`) and runs every fleet's background work
inside its own lifecycle (each fleet app's startup, shutdown and cleanup signals are sent from the front's, as
aiohttp does for sub-applications, without exposing the fleet's routes under a path prefix).

Dispatch (`kvrouter.server.model_directory`): the body is parsed once, here, and the parsed request handed to
the fleet's proxy; its `model` names a fleet's model, one of its aliases or one of its LoRA adapters. An unknown
model is OpenAI's 404 (`model_not_found`); a request without `model` goes to the only fleet when there is one,
and is a 400 when there are several. /debug/route and the pass-through paths (/tokenize, embeddings, ...)
dispatch the same way (they read `model` from the JSON body themselves).
The endpoints that look at the whole router (/v1/models, /health, /ready, /metrics, /admin) are in
`kvrouter.server.fleet_status`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CollectorRegistry

from kvrouter.config import FleetConfig, ModelsConfig, Settings
from kvrouter.metrics import RouterMetrics
from kvrouter.openai_request import Endpoint, RequestError, parse_request
from kvrouter.server.app import PROXY, create_app
from kvrouter.server.client_limits import EDGE, ClientEdge, EdgeLimits, soft_fd_limit
from kvrouter.server.fleet_status import add_status_routes
from kvrouter.server.model_directory import MODELS, FleetApp, ModelDirectory
from kvrouter.server.proxy import error_response, refuse_request_target
from kvrouter.server.status import StatusEndpoints
from kvrouter.server.streaming import REQUEST_ID_HEADER

log = logging.getLogger(__name__)


FRONT_METRICS = web.AppKey("kvrouter_front_metrics", RouterMetrics)


def build_fleets(
    settings: Settings, config: ModelsConfig, clock: Callable[[], float] = time.monotonic
) -> list[FleetApp]:
    """One application per fleet, each on its own metrics registry; no fleet reloads on SIGHUP (the front
    refuses a reload of a models file, `kvrouter.server.fleet_status`)."""
    fleets = []
    for fleet in config.models:
        own = settings.model_copy(update={"policy": fleet.policy or settings.policy, "replicas": None})
        registry = CollectorRegistry(auto_describe=True)
        app = create_app(own, fleet, registry=registry, clock=clock, reload_on_sighup=False)
        proxy = app[PROXY]
        fleets.append(FleetApp(fleet, app, registry, proxy, StatusEndpoints(proxy)))
    return fleets


def create_models_app(
    settings: Settings, config: ModelsConfig, *, clock: Callable[[], float] = time.monotonic
) -> web.Application:
    """The router for a `models:` replicas.yaml: a front application dispatching to one fleet per model."""
    fleets = build_fleets(settings, config, clock)
    directory = ModelDirectory(fleets)
    metrics = RouterMetrics(CollectorRegistry(auto_describe=True))
    edge = ClientEdge(EdgeLimits.from_settings(settings, soft_fd_limit()), metrics)
    app = web.Application(
        client_max_size=settings.max_body_bytes, handler_args=edge.handler_args(), middlewares=[edge.middleware]
    )
    app[EDGE] = edge
    app.on_response_prepare.append(edge.on_response_prepare)
    app[MODELS] = directory
    app[FRONT_METRICS] = metrics
    dispatch = ModelDispatch(directory, metrics)
    app.router.add_post("/v1/chat/completions", dispatch.chat_completions)
    app.router.add_post("/v1/completions", dispatch.completions)
    app.router.add_post("/debug/route", dispatch.debug_route)
    app.router.add_post("/debug/route/{endpoint}", dispatch.debug_route)
    add_status_routes(app, settings, directory, metrics)
    app.middlewares.append(dispatch.passthrough_unmatched)
    app.middlewares.insert(0, dispatch.origin_form_only)
    for fleet in fleets:
        run_inside(app, fleet.app)
    return app


def run_inside(front: web.Application, fleet: web.Application) -> None:
    """Run `fleet`'s lifecycle (its cleanup_ctx: client session, probes, event ingest, ...) with `front`'s, in the
    order aiohttp's runner uses: signals frozen first, the state once started."""
    fleet.pre_freeze()

    async def startup(_app: web.Application) -> None:
        await fleet.startup()
        fleet.freeze()

    async def shutdown(_app: web.Application) -> None:
        await fleet.shutdown()

    async def cleanup(_app: web.Application) -> None:
        await fleet.cleanup()

    front.on_startup.append(startup)
    front.on_shutdown.append(shutdown)
    front.on_cleanup.append(cleanup)


def _request_id(request: web.Request) -> str | None:
    return request.headers.get(REQUEST_ID_HEADER)


class ModelDispatch:
    """The front's request path: find the fleet, hand the request (and its parsed body) to the fleet's proxy."""

    def __init__(self, directory: ModelDirectory, metrics: RouterMetrics) -> None:
        self.directory = directory
        self.metrics = metrics
        self.first = directory.fleets[0].proxy
        """Settings shared by every fleet (API keys, body limits, pass-through paths) are read from this one."""

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, "completion")

    async def _completion(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        try:
            self.first.check_client(request)
            parsed = parse_request(endpoint, await self.first.read_body(request))
            fleet = self.directory.find(parsed.model)
        except RequestError as error:
            return error_response(error, _request_id(request))
        return await fleet.proxy.completion(request, endpoint, parsed)

    async def debug_route(self, request: web.Request) -> web.StreamResponse:
        try:
            self.first.check_admin(request)
            fleet = self.directory.find(self._model_of(await self.first.read_body(request)))
        except RequestError as error:
            return error_response(error)
        return await fleet.status.debug_route(request)

    @staticmethod
    def _model_of(raw: bytes) -> object:
        """The body's `model`, or None; a body that is not a JSON object is left to the fleet to refuse."""
        try:
            body = json.loads(raw) if raw else None
        except (ValueError, RecursionError):
            return None
        return body.get("model") if isinstance(body, dict) else None

    @web.middleware
    async def origin_form_only(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.raw_path.startswith("/"):
            return await handler(request)
        return refuse_request_target(self.metrics)

    @web.middleware
    async def passthrough_unmatched(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if not isinstance(request.match_info.http_exception, web.HTTPNotFound):
            return await handler(request)
        try:
            self.first.check_client(request)
            if not self.first.passthrough_paths.allows(request.raw_path.partition("?")[0]):
                self.metrics.client_rejections.labels("path_not_allowed").inc()
                raise RequestError(f"no such endpoint: {request.method} {request.path}", status=404, code="not_found")
            raw = await self.first.read_body(request) if request.body_exists else b""
            fleet = self.directory.find(self._model_of(raw))
        except RequestError as error:
            return error_response(error, _request_id(request))
        return await fleet.proxy.passthrough(request)


def build_router_app(
    settings: Settings, config: FleetConfig | ModelsConfig, *, clock: Callable[[], float] = time.monotonic
) -> web.Application:
    """The application for either shape of replicas.yaml: one fleet (`create_app`) or a `models:` list."""
    if isinstance(config, ModelsConfig):
        return create_models_app(settings, config, clock=clock)
    return create_app(settings, config, clock=clock)


__all__ = [
    "MODELS",
    "FleetApp",
    "ModelDirectory",
    "build_fleets",
    "build_router_app",
    "create_models_app",
    "run_inside",
]
