"""The router's own KV-event plane: one ZMQ source per replica feeding the prefix index in this process.

`EmbeddedEvents` follows every replica of the fleet that names a `kv_events` publisher, applies each batch to
the index through `IndexIngest`, and keeps the event metrics (per-event status counts, ingest lag) current; the
blocks per replica are read from the index when scraped (`held_blocks`). It follows and unfollows replicas while
running (the admin API's reload calls `follow` / `unfollow`), and `context` is the `cleanup_ctx` that starts and
stops it with the application.

Knobs: `replay_timeout_s` and `rcv_hwm` of each source (`zmq_source`); clocks are parameters (`wall_clock` is
compared with the engines' batch timestamps for the lag gauge).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

import zmq.asyncio
from aiohttp import web

from kvrouter.config import FleetConfig, ReplicaConfig
from kvrouter.events.ingest import IndexIngest
from kvrouter.events.metrics import EventMetrics
from kvrouter.events.wire import EventBatch
from kvrouter.events.zmq_source import ZmqEventSource
from kvrouter.index import PrefixIndex
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
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.fleet = fleet
        self.index = index
        self.metrics = metrics
        self.replay_timeout_s = replay_timeout_s
        self.rcv_hwm = rcv_hwm
        self.clock = clock
        self.wall_clock = wall_clock
        self.ingest = IndexIngest(
            index,
            block_sizes={r.replica: fleet.block_size_of(r) for r in fleet.replicas},
            seed=fleet.hash_seed,
            on_event=metrics.count,
        )
        self.sources: dict[ReplicaName, ZmqEventSource] = {}
        self._tasks: dict[ReplicaName, asyncio.Task[None]] = {}
        self._context: zmq.asyncio.Context | None = None
        metrics.read_index_blocks(self.held_blocks)

    def apply(self, batch: EventBatch) -> None:
        """The sink of every source: index, then the lag gauge."""
        self.ingest.apply(batch)
        self.metrics.ingest_lag.labels(batch.replica).set(max(0.0, self.wall_clock() - batch.ts))

    def held_blocks(self) -> dict[str, int]:
        """Blocks the index holds per followed replica (a scan of the index: at scrape time, not per batch)."""
        held = self.index.held_counts()
        return {name: held.get(name, 0) for name in self.sources}

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
        self._tasks[name] = asyncio.create_task(source.run(), name=f"kvrouter-kv-events-{name}")
        log.info("following KV events of %s at %s", name, replica.kv_events.endpoint)

    async def unfollow(self, replica: ReplicaName, *, forget: bool = True) -> None:
        task = self._tasks.pop(replica, None)
        self.sources.pop(replica, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if forget:
            self.index.remove_replica(replica)
            self.ingest.block_sizes.pop(replica, None)
            self.metrics.forget(replica)

    async def start(self) -> None:
        self._context = zmq.asyncio.Context()
        self._context.setsockopt(zmq.LINGER, 0)  # a socket left open must never block term()
        for replica in self.fleet.replicas:
            await self.follow(self.fleet, replica)

    async def stop(self) -> None:
        for name in list(self._tasks):
            await self.unfollow(name, forget=False)
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None

    async def context(self, app: web.Application) -> AsyncIterator[None]:
        await self.start()
        yield
        await self.stop()


__all__ = ["EmbeddedEvents"]
