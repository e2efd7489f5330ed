"""The fleet an operator steers: drain flags, live reloads of replicas.yaml, and their sharing between instances.

`plan_reload(current, new)` compares two fleets purely: added, removed, replaced (same name, different URL,
events endpoint or block size — a different engine as far as the index knows) and reweighted replicas. Fleet-wide
fields (tokenizer, block_size, hash_seed, lora_adapters) change every block key, so a plan that changes them is
refused (`ReloadRefused`): restart instead.

`FleetAdmin` holds the loaded fleet and the drain flags and applies plans through `FleetHooks`, which the app
factory implements over its replica set, load book, index and event sources (`kvrouter.admin.control`). Reloads
are serialised. Removed replicas take no new requests at once; their in-flight requests finish on the objects
they already hold. Drain flags survive a reload. With a `SharedState` (Redis, `kvrouter.admin.shared`) every
drain, undrain and reload is also published, and `run_sync` polls what other instances published, so one call
reaches every router instance within a poll interval; the HTTP shell is `kvrouter.admin.api`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvrouter.admin.shared import RELOAD_CATCH_UP_S, SharedView, file_digest
from kvrouter.config import ConfigError, FleetConfig, ReplicaConfig, load_fleet
from kvrouter.redisplane.stopping import cancel_requested
from kvrouter.typedefs import ReplicaName

log = logging.getLogger(__name__)

FLEET_WIDE_FIELDS = ("tokenizer", "block_size", "hash_seed", "lora_adapters")
"""replicas.yaml fields every block key depends on: changing them live would silently empty the index."""

DRAIN_POLL_S = 0.05


class ReloadRefused(Exception):
    """The new replicas.yaml cannot be applied live; the message says why and what to do instead."""


@dataclass(frozen=True, slots=True)
class ReloadPlan:
    """What a reload changes, by replica name, in replicas.yaml order."""

    added: tuple[ReplicaConfig, ...] = ()
    removed: tuple[ReplicaName, ...] = ()
    replaced: tuple[ReplicaConfig, ...] = ()
    """Same name, different URL, events endpoint, block size or LoRA adapters: a different engine as far as the
    index knows."""
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
    if current.all_adapters != new.all_adapters:
        # A request naming an adapter is keyed by it: which names are adapters is fixed when the router starts.
        raise ReloadRefused("the set of LoRA adapter names changed; restart the router to apply this file")
    if current.flow != new.flow:
        # Bands and tenants key the requests waiting now; the queue is built once, at start.
        raise ReloadRefused("the flow section changed; restart the router to apply it (docs/flow-control.md)")
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
        elif (
            current.block_size_of(before) != new.block_size_of(replica)
            or before.url != replica.url
            or (before.kv_events != replica.kv_events)
            or before.lora_adapters != replica.lora_adapters
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
            "kvrouter_fleet_reloads",
            "replicas.yaml reloads, by result (applied, unchanged, invalid, refused).",
            ["result"],
            registry=registry,
        )
        self.draining = Gauge(
            "kvrouter_replica_draining",
            "1 while an operator has drained the replica on this router.",
            ["replica"],
            registry=registry,
        )
        self.fleet_replicas = Gauge(
            "kvrouter_fleet_replicas",
            "Replicas in the loaded replicas.yaml.",
            registry=registry,
        )


class SharedState(Protocol):
    """Drain flags and reloads shared by all router instances (`kvrouter.admin.shared`); never raises."""

    async def set_draining(self, replica: str, draining: bool) -> bool: ...

    async def publish_reload(self, sha256: str) -> int | None: ...

    async def read(self) -> SharedView | None: ...

    async def close(self) -> None: ...


class FleetAdmin:
    """Holds the loaded fleet and the drain flags; serialises reloads; follows the shared state when there is one."""

    def __init__(
        self,
        *,
        fleet: FleetConfig,
        fleet_path: Path | None,
        hooks: FleetHooks,
        metrics: AdminMetrics,
        load: Callable[[Path], FleetConfig] = load_fleet,
        shared: SharedState | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fleet = fleet
        self.fleet_path = fleet_path
        self.hooks = hooks
        self.metrics = metrics
        self.shared = shared
        self.draining: set[ReplicaName] = set()
        self._load = load
        self._clock = clock
        self._lock = asyncio.Lock()
        self._loaded_sha256 = file_digest(fleet_path) if fleet_path is not None else None
        self._unshared: dict[ReplicaName, bool] = {}
        """Drain changes made here that Redis has not taken yet; retried on every poll."""
        self._generation: int | None = None
        self._owed: tuple[str, float] | None = None
        """(digest, give-up time) of a reload another instance applied and this one has not yet."""
        metrics.fleet_replicas.set(len(fleet.replicas))

    def has(self, name: str) -> bool:
        return any(r.name == name for r in self.fleet.replicas)

    async def drain(self, name: ReplicaName) -> bool | None:
        """Drain here at once; True/False: shared with the other instances or not (None: nothing to share with)."""
        self._set_draining(name, True)
        return await self._share_drain(name, True)

    async def undrain(self, name: ReplicaName) -> bool | None:
        self._set_draining(name, False)
        return await self._share_drain(name, False)

    def _set_draining(self, name: ReplicaName, draining: bool) -> None:
        if draining == (name in self.draining):
            return
        if draining:
            self.draining.add(name)
        else:
            self.draining.discard(name)
        self.hooks.set_draining(name, draining)
        self.metrics.draining.labels(name).set(1 if draining else 0)
        log.info("replica %s %s", name, "drained: no new requests" if draining else "undrained")

    async def _share_drain(self, name: ReplicaName, draining: bool) -> bool | None:
        if self.shared is None:
            return None
        if await self.shared.set_draining(name, draining):
            self._unshared.pop(name, None)
            return True
        self._unshared[name] = draining
        return False

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

    async def reload(self) -> tuple[ReloadPlan, bool | None]:
        """Re-read replicas.yaml, apply it, tell the other instances; raises ConfigError or ReloadRefused (and
        then changes nothing). Returns the plan and whether the reload was shared (None: no shared state)."""
        plan, digest = await self._reload_local()
        if self.shared is None or digest is None:
            return plan, None
        generation = await self.shared.publish_reload(digest)
        if generation is not None:
            self._generation = generation
        return plan, generation is not None

    async def _reload_local(self) -> tuple[ReloadPlan, str | None]:
        if self.fleet_path is None:
            raise ReloadRefused("this router was started without a replicas.yaml path; nothing to re-read")
        path = self.fleet_path
        async with self._lock:
            try:
                digest = await asyncio.to_thread(file_digest, path)
                new = await asyncio.to_thread(self._load, path)
                plan = plan_reload(self.fleet, new)
            except ConfigError:
                self.metrics.reloads.labels("invalid").inc()
                raise
            except ReloadRefused:
                self.metrics.reloads.labels("refused").inc()
                raise
            await self._apply(new, plan)
            self.fleet = new
            self._loaded_sha256 = digest
            self.metrics.fleet_replicas.set(len(new.replicas))
            self.metrics.reloads.labels("unchanged" if plan.empty else "applied").inc()
            if not plan.empty:
                log.info("replicas.yaml reloaded: %s", plan.as_json())
            return plan, digest

    async def sync_once(self) -> bool:
        """One poll of the shared state: push what Redis missed, apply what other instances did. False: unreachable."""
        if self.shared is None:
            return False
        for name, draining in list(self._unshared.items()):
            if await self.shared.set_draining(name, draining):
                self._unshared.pop(name, None)
        view = await self.shared.read()
        if view is None:
            return False
        known = {r.replica for r in self.fleet.replicas}
        for name in known - self.draining - self._unshared.keys():
            if name in view.draining:
                self._set_draining(name, True)
        for name in self.draining - self._unshared.keys():
            if name not in view.draining:
                self._set_draining(name, False)
        await self._follow_reloads(view)
        return True

    async def _follow_reloads(self, view: SharedView) -> None:
        if self._generation is None:
            # The file this instance started with is as new as anything announced before it started.
            self._generation = view.reload_generation
        elif view.reload_generation > self._generation:
            self._generation = view.reload_generation
            if view.reload_sha256 is not None:
                self._owed = (view.reload_sha256, self._clock() + RELOAD_CATCH_UP_S)
        if self._owed is None:
            return
        digest, give_up = self._owed
        if digest == self._loaded_sha256:
            self._owed = None
            return
        current = await asyncio.to_thread(file_digest, self.fleet_path) if self.fleet_path else None
        if current == digest:
            self._owed = None
            try:
                await self._reload_local()
            except (ConfigError, ReloadRefused) as error:
                log.error("reload announced by another instance not applied here: %s", error)
        elif self._clock() >= give_up:
            self._owed = None
            log.warning(
                "another instance applied a replicas.yaml this instance never saw (sha256 %s); reload here by hand",
                digest[:12],
            )

    async def run_sync(self, interval_s: float) -> None:
        """Poll the shared state until cancelled."""
        unreachable = False
        while True:
            try:
                reached = await self.sync_once()
            except Exception:  # the admin plane must never take the router down
                log.exception("shared admin state: poll failed")
                reached = False
            if reached == unreachable:
                unreachable = not reached
                if unreachable:
                    log.warning("shared admin state unreachable: drains and reloads apply to this instance only")
            if cancel_requested():  # a cancel the Redis client swallowed (kvrouter/redisplane/stopping.py)
                raise asyncio.CancelledError
            await asyncio.sleep(interval_s)

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
