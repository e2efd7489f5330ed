"""The router's own KV-event plane: one ZMQ source per replica feeding the prefix index in this process.

`EmbeddedEvents` follows every replica of the fleet that names a `kv_events` publisher, applies each batch to
the index through `IndexIngest`, and keeps the event metrics (per-event status counts, ingest lag) current; the
blocks per replica are read from the index when scraped (`held_blocks`). It follows and unfollows replicas while
running (the admin API's reload calls `follow` / `unfollow`), and `context` is the `cleanup_ctx` that starts and
stops it with the application. What the ingest applies reaches the `listeners`
(`kvrouter.routing.lifecycle.EventListener`: the learning overlays), and so does a replica unfollowed for good
(its cache is gone for this router).

It also watches for a replica that never speaks: an engine publishes only when its blocks change, so silence
alone means nothing, but a replica that has been sent requests (their blocks are provisional marks in the index)
and has not published a single batch `silent_after_s` after the router began following it has a wrong or
unreachable `kv_events` endpoint — routing there runs on provisional guesses only. That is logged once as a
warning; the age of every replica's last batch is exported (`kvrouter_kv_event_age_seconds`) and shown in /health
(`describe`).

Knobs: `replay_timeout_s` and `rcv_hwm` of each source (`zmq_source`); `silent_after_s`; clocks are parameters
(`wall_clock` is compared with the engines' batch timestamps for the lag gauge).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence

import zmq.asyncio
from aiohttp import web

from kvrouter.config import FleetConfig, ReplicaConfig
from kvrouter.events.ingest import IndexIngest
from kvrouter.events.metrics import EventMetrics
from kvrouter.events.wire import EventBatch
from kvrouter.events.zmq_source import ZmqEventSource
from kvrouter.index import PrefixIndex
from kvrouter.routing.lifecycle import EventListener, tell_cleared
from kvrouter.typedefs import ReplicaName

log = logging.getLogger(__name__)


class EmbeddedEvents:
    def __init__(
        self,
        fleet: FleetConfig,
        index: PrefixIndex,
        metrics: EventMetrics,
        *,
        replay_timeout_s: float = 1.0,
        rcv_hwm: int = 1000,
        silent_after_s: float = 60.0,
        listeners: Sequence[EventListener] = (),
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.fleet = fleet
        self.index = index
        self.metrics = metrics
        self.replay_timeout_s = replay_timeout_s
        self.rcv_hwm = rcv_hwm
        self.silent_after_s = silent_after_s
        self.clock = clock
        self.wall_clock = wall_clock
        self.ingest = IndexIngest(
            index,
            block_sizes={r.replica: fleet.block_size_of(r) for r in fleet.replicas},
            seed=fleet.hash_seed,
            on_event=metrics.count,
            listeners=listeners,
            clock=clock,
        )
        self.sources: dict[ReplicaName, ZmqEventSource] = {}
        self._tasks: dict[ReplicaName, asyncio.Task[None]] = {}
        self._context: zmq.asyncio.Context | None = None
        self._followed_since: dict[ReplicaName, float] = {}
        self._last_batch: dict[ReplicaName, float] = {}
        self._warned_silent: set[ReplicaName] = set()
        self._watch: asyncio.Task[None] | None = None
        metrics.read_index_blocks(self.held_blocks)
        metrics.read_event_ages(self.event_ages)

    def apply(self, batch: EventBatch) -> None:
        """The sink of every source: index, then the lag gauge."""
        self._last_batch[ReplicaName(batch.replica)] = self.clock()
        self.ingest.apply(batch)
        self.metrics.lag(batch.replica, max(0.0, self.wall_clock() - batch.ts))

    def held_blocks(self) -> dict[str, int]:
        """Blocks the index holds per followed replica (a scan of the index: at scrape time, not per batch)."""
        held = self.index.held_counts()
        return {name: held.get(name, 0) for name in self.sources}

    def event_ages(self) -> dict[str, float]:
        """Seconds since each followed replica's last batch (since following began, when none has arrived)."""
        now = self.clock()
        return {
            name: round(now - self._last_batch.get(name, self._followed_since.get(name, now)), 3)
            for name in self.sources
        }

    def describe(self, replica: ReplicaName) -> dict[str, object] | None:
        """The replica's event stream for /health; None when it names no publisher."""
        source = self.sources.get(replica)
        if source is None:
            return None
        last = self._last_batch.get(replica)
        return {
            "endpoint": source.config.endpoint,
            "last_event_age_s": None if last is None else round(self.clock() - last, 3),
            "silent": replica in self._warned_silent,
        }

    def check_silent(self) -> list[ReplicaName]:
        """Warn (once per follow) about replicas sent requests that have never published; returns them."""
        now = self.clock()
        found = []
        for name, since in self._followed_since.items():
            if name in self._last_batch or name in self._warned_silent or now - since < self.silent_after_s:
                continue
            if self.index.provisional_marks(name) == 0:
                continue  # nothing sent there lately: an idle engine publishes nothing, and that is fine
            self._warned_silent.add(name)
            found.append(name)
            source = self.sources.get(name)
            log.warning(
                "replica %s has been sent requests but published no KV event in %.0fs since the router began "
                "following %s: check its kv_events endpoint and vLLM's --kv-events-config; until events arrive it "
                "is routed on provisional guesses only",
                name,
                now - since,
                source.config.endpoint if source is not None else "its publisher",
            )
        return found

    async def _watch_silence(self) -> None:
        period = max(1.0, min(10.0, self.silent_after_s / 4))
        while True:
            await asyncio.sleep(period)
            self.check_silent()

    async def follow(self, fleet: FleetConfig, replica: ReplicaConfig) -> None:
        name = replica.replica
        await self.unfollow(name, forget=False)
        self.ingest.block_sizes[name] = fleet.block_size_of(replica)
        if replica.kv_events is None or self._context is None:
            return
        source = ZmqEventSource(
            name,
            replica.kv_events,
            self.apply,
            context=self._context,
            on_problem=self.metrics.count,
            data_parallel_size=replica.kv_events.data_parallel_size,
            replay_timeout_s=self.replay_timeout_s,
            rcv_hwm=self.rcv_hwm,
            clock=self.clock,
        )
        self.sources[name] = source
        self._followed_since[name] = self.clock()
        self._last_batch.pop(name, None)
        self._warned_silent.discard(name)
        self._tasks[name] = asyncio.create_task(source.run(), name=f"kvrouter-kv-events-{name}")
        log.info("following KV events of %s at %s", name, replica.kv_events.endpoint)

    async def unfollow(self, replica: ReplicaName, *, forget: bool = True) -> None:
        task = self._tasks.pop(replica, None)
        self.sources.pop(replica, None)
        self._followed_since.pop(replica, None)
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:  # a failed source must not stop the others (nor `stop` destroying the context)
                log.exception("the KV-event source of %s had failed", replica)
        if forget:
            self.index.clear(replica)
            tell_cleared(self.ingest.listeners, replica, self.clock())
            self.ingest.block_sizes.pop(replica, None)
            self.metrics.forget(replica)

    async def start(self) -> None:
        self._context = zmq.asyncio.Context()
        self._context.setsockopt(zmq.LINGER, 0)  # a socket left open must never block term()
        for replica in self.fleet.replicas:
            await self.follow(self.fleet, replica)
        self._watch = asyncio.create_task(self._watch_silence(), name="kvrouter-kv-events-silence")

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None
        try:
            for name in list(self._tasks):
                await self.unfollow(name, forget=False)
        finally:
            # Never left to the garbage collector: pyzmq's finalizer of a context collected together with one of
            # its open sockets blocks the collecting thread in term() for good.
            if self._context is not None:
                self._context.destroy(linger=0)
                self._context = None

    async def context(self, app: web.Application) -> AsyncIterator[None]:
        await self.start()
        yield
        await self.stop()


__all__ = ["EmbeddedEvents"]
