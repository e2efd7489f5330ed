"""The admin API's hands on a running router: `FleetHooks` implemented over the app's own parts.

`AppFleetHooks` adds and removes replicas in the `ReplicaSet` (which the proxy, the prober and the scraper read),
forgets a removed replica's load and index entries and stale metric series, flips drain flags, and asks the
KV-event source (when it can follow replicas one by one: `EventFollower`) to start or stop following a replica.
An event source that cannot leaves new replicas routed on load alone until the next restart; that is logged.
`install_admin` is the one call the app factory makes; an event source with `is_ready()` (the Redis follower,
which must catch up before the index is complete) becomes the "events" readiness check behind GET /ready.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Protocol, runtime_checkable

from aiohttp import web
from prometheus_client import CollectorRegistry

from kvrouter.admin.api import Readiness, replicas_routable, setup_admin
from kvrouter.admin.fleet import AdminMetrics, FleetAdmin
from kvrouter.admin.shared import RedisAdminState
from kvrouter.config import FleetConfig, ReplicaConfig
from kvrouter.index_writer import CountingIndexWriter
from kvrouter.metrics import RouterMetrics
from kvrouter.routing.load import LoadBook
from kvrouter.routing.router import Route
from kvrouter.server.replicas import ReplicaSet
from kvrouter.typedefs import ReplicaName

log = logging.getLogger(__name__)


@runtime_checkable
@runtime_checkable
class ReadinessSource(Protocol):
    """An event source that needs time before the index is complete (Redis catch-up); `is_ready` says when."""

    def is_ready(self) -> bool: ...


@runtime_checkable
class EventFollower(Protocol):
    """An event source that can follow one more replica, or stop following one, while it runs."""

    async def follow(self, fleet: FleetConfig, replica: ReplicaConfig) -> None: ...

    async def unfollow(self, replica: ReplicaName) -> None: ...


class AppFleetHooks:
    def __init__(
        self,
        *,
        replicas: ReplicaSet,
        load: LoadBook,
        metrics: RouterMetrics,
        index: CountingIndexWriter | None = None,
        events: object | None = None,
        forget: Callable[[ReplicaName], None] | None = None,
    ) -> None:
        self.replicas = replicas
        self.forget = forget
        self.load = load
        self.metrics = metrics
        self.index = index
        self.events = events if isinstance(events, EventFollower) else None

    def describe_replicas(self) -> list[dict[str, object]]:
        views: list[dict[str, object]] = []
        for state in self.replicas:
            load = {key: value for key, value in asdict(self.load.snapshot(state.name)).items() if value is not None}
            view: dict[str, object] = {"name": state.name, **state.describe()}
            view["weight"] = state.route.weight
            view["block_size"] = state.route.block_size
            view["in_flight"] = load.get("in_flight", 0)
            view["load"] = load
            if self.index is not None:
                view["cached_blocks"] = self.index.blocks_of(state.name)
            views.append(view)
        return views

    def in_flight(self, name: ReplicaName) -> int:
        return self.load.own_in_flight(name)

    def set_draining(self, name: ReplicaName, draining: bool) -> None:
        if draining:
            self.replicas.draining.add(name)
        else:
            self.replicas.draining.discard(name)

    async def add_replica(self, fleet: FleetConfig, replica: ReplicaConfig) -> None:
        self.replicas.add(replica, fleet.block_size_of(replica), fleet.adapters_of(replica))
        if self.events is not None:
            await self.events.follow(fleet, replica)
        elif replica.kv_events is not None:
            log.warning(
                "replica %s added; this event source cannot follow replicas live, so it is routed on load "
                "only until the router restarts",
                replica.name,
            )

    async def remove_replica(self, name: ReplicaName) -> None:
        self.replicas.remove(name)
        if self.events is not None:
            await self.events.unfollow(name)
        if self.index is not None:
            self.index.clear(name)
        if self.forget is not None:
            self.forget(name)  # the learning overlays forget it too
        self.load.forget(name)
        for gauge in (self.metrics.replica_healthy, self.metrics.in_flight):
            with contextlib.suppress(KeyError):
                gauge.remove(name)

    def reweight_replica(self, fleet: FleetConfig, replica: ReplicaConfig) -> None:
        state = self.replicas.by_name.get(replica.replica)
        if state is not None:
            state.route = Route(
                state.name, fleet.block_size_of(replica), replica.weight, fleet.adapters_of(replica), replica.role
            )
            state.config = replica


def install_admin(
    app: web.Application,
    *,
    fleet: FleetConfig,
    fleet_path: Path | None,
    admin_token: str | None,
    replicas: ReplicaSet,
    load: LoadBook,
    metrics: RouterMetrics,
    registry: CollectorRegistry,
    index: CountingIndexWriter | None = None,
    events: object | None = None,
    redis_url: str | None = None,
    forget: Callable[[ReplicaName], None] | None = None,
    reload_on_sighup: bool = True,
    sync_interval_s: float = 1.0,
) -> tuple[FleetAdmin, Readiness]:
    """Wire the admin API and /ready into `app`; parts of the app add readiness checks to the returned object.
    With `redis_url`, drains and reloads are shared with every other instance using that Redis."""
    hooks = AppFleetHooks(replicas=replicas, load=load, metrics=metrics, index=index, events=events, forget=forget)
    admin = FleetAdmin(
        fleet=fleet,
        fleet_path=fleet_path,
        hooks=hooks,
        metrics=AdminMetrics(registry),
        shared=RedisAdminState(redis_url) if redis_url else None,
    )
    readiness = setup_admin(
        app, admin, token=admin_token, reload_on_sighup=reload_on_sighup, sync_interval_s=sync_interval_s
    )
    readiness.add("replicas", replicas_routable(replicas))
    if isinstance(events, ReadinessSource):
        source = events
        readiness.add("events", lambda: source.is_ready() or "the prefix index is still loading from the event source")
    return admin, readiness
