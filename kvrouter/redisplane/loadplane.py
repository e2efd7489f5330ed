"""The load plane: router instances share their load through the Redis the event plane already uses.

Every instance publishes `LoadShare.report()` (kvrouter/routing/sharing.py: its own counts per replica and the
prefixes it routed) on one pub/sub channel, `kvrouter:load`, and subscribes to the same channel, folding every
other instance's report into its load book. Two tasks share one session: the receiver, and the publisher, which
sleeps until `LoadShare.notify` wakes it — a dispatch committed, a prefill done, a request finished — and then
publishes one report with everything that changed meanwhile. It never has more than one PUBLISH outstanding:
changes made while one is on its way are coalesced into the next, so under load the reports follow one Redis round
trip apart and at rest each change goes out at once. The receiver's tick (`interval_s`) expires silent peers,
sends a change no listener signalled, and the heartbeat every `heartbeat_s`. Nothing here is on a request's path:
the request only sets a flag and routing reads the load book, which these tasks update in the background, so a
slow or absent Redis makes the shared part stale, never a request slower. Staleness is one or two Redis round
trips (a change may wait for the publish ahead of it); the plane measures it as the delay of its own echo
(`LoadShare.staleness_s`, `kvrouter_load_share_staleness_seconds`). A peer that stops publishing expires
`expiry_s` after its last report; a new instance knows every live peer's load within one heartbeat.

Why pub/sub and not a stream or a hash: a report is absolute and superseded by the next one, so there is nothing
to replay and nothing to keep — a lost message costs one interval of staleness; pub/sub costs no Redis memory and
one fan-out per report. On Redis Cluster a PUBLISH reaches every node's subscribers, so one connection to any
node serves (the plane uses the first seed).

Faults: a lost connection is retried with back-off (`kvrouter_load_share_up 0` meanwhile); peers then expire as
usual, so a partitioned instance falls back to its own load and the engines' gauges. A report that does not decode
or carries absurd values is ignored and counted (`kvrouter_load_share_problems_total{reason}`).

Metrics: `kvrouter_load_share_up`, `kvrouter_load_share_peers`, `kvrouter_load_share_published_total`,
`kvrouter_load_share_published_bytes_total`, `kvrouter_load_share_received_total`,
`kvrouter_load_share_received_bytes_total`, `kvrouter_load_share_expired_total`,
`kvrouter_load_share_problems_total{reason}`, `kvrouter_load_share_peer_in_flight`,
`kvrouter_load_share_staleness_seconds`, and with the blind group
(kvrouter/routing/herding.py) `kvrouter_load_share_blind_peer_decisions`,
`kvrouter_load_share_blind_placeholders_total`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import random
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import RedisError

from kvrouter.redisplane.clients import CLUSTER_SCHEMES, masked_url, redis_from_url
from kvrouter.redisplane.stopping import cancel_requested, stop_task
from kvrouter.routing.sharing import LoadShare

log = logging.getLogger(__name__)

CHANNEL = "kvrouter:load"


def instance_name() -> str:
    """Unique per process and start: host, pid and a random tail (a restarted instance is a new peer)."""
    return f"{socket.gethostname()[:64]}-{os.getpid()}-{random.getrandbits(32):08x}"


def load_plane_client(url: str) -> Redis:
    """A plain client for pub/sub: on a Cluster, the first seed node (PUBLISH reaches every node)."""
    scheme, sep, rest = url.partition("://")
    if scheme.lower() in CLUSTER_SCHEMES:
        plain = scheme.lower().replace("+cluster", "")
        credentials, at, hosts = rest.rpartition("@")
        first = hosts.split(",")[0].split("/")[0].split("?")[0]
        query = rest.partition("?")[2]
        url = f"{plain}{sep}{credentials}{at}{first}" + (f"?{query}" if query else "")
    return redis_from_url(url, socket_timeout_s=5.0)


@dataclass(slots=True)
class PlaneStats:
    connected: bool = False
    published: int = 0
    published_bytes: int = 0
    received: int = 0
    received_bytes: int = 0
    session_errors: int = 0


class RedisLoadPlane:
    def __init__(
        self,
        share: LoadShare,
        connect: Callable[[], Redis],
        *,
        interval_s: float = 0.02,
        heartbeat_s: float = 0.5,
        channel: str = CHANNEL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.share = share
        self.connect = connect
        self.interval_s = interval_s
        self.heartbeat_s = heartbeat_s
        self.channel = channel
        self.clock = clock
        self.stats = PlaneStats()
        self._wake = asyncio.Event()
        share.notify = self._wake.set
        self._last_sent = 0.0
        self._client: Redis | None = None

    async def run(self) -> None:
        """Until cancelled: publish, receive, expire; reconnect with back-off when Redis goes away."""
        backoff = 0.1
        while True:
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as error:
                self.stats.session_errors += 1
                log.warning("load plane: Redis session ended (%s); peers' load expires meanwhile", type(error).__name__)
            except Exception:
                self.stats.session_errors += 1
                log.exception("load plane: unexpected error; restarting the session")
            self.stats.connected = False
            self.share.expire(self.clock())
            if cancel_requested():  # a cancel the Redis client swallowed: stop, do not reconnect
                raise asyncio.CancelledError
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _session(self) -> None:
        client = self._client = self.connect()
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        tasks: list[asyncio.Task[None]] = []
        try:
            await pubsub.subscribe(self.channel)
            self.stats.connected = True
            # A newcomer announces itself at once, so peers count it (and it hears them within a heartbeat).
            await self._publish(client)
            # Not a TaskGroup: its ExceptionGroup would hide the Redis error `run` retries on.
            tasks = [
                asyncio.create_task(self._receiver(pubsub), name="kvrouter-load-plane-receiver"),
                asyncio.create_task(self._publisher(client), name="kvrouter-load-plane-publisher"),
                asyncio.create_task(self._ticker(), name="kvrouter-load-plane-tick"),
            ]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()
        finally:
            self.stats.connected = False
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]
            with contextlib.suppress(Exception):
                await client.aclose()

    async def _receiver(self, pubsub: PubSub) -> None:
        while True:
            message = await pubsub.get_message(timeout=None)
            if message is not None:
                self._receive(message)

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            now = self.clock()
            self.share.expire(now)
            if self.share.due(now, self._last_sent, self.heartbeat_s):
                self._wake.set()

    async def _publisher(self, client: Redis) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            # Changes made while this publish is on its way set the flag again: one more report carries them all.
            if self.share.due(self.clock(), self._last_sent, self.heartbeat_s):
                await self._publish(client)

    async def _publish(self, client: Redis) -> None:
        self._last_sent = now = self.clock()
        payload = self.share.report(now=now)
        await client.publish(self.channel, payload)
        self.stats.published += 1
        self.stats.published_bytes += len(payload)

    def _receive(self, message: dict[str, object]) -> None:
        data = message.get("data")
        if not isinstance(data, bytes):
            self.share.problems["undecodable"] += 1
            return
        self.stats.received += 1
        self.stats.received_bytes += len(data)
        self.share.receive(data, self.clock())

    async def context(self, app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(self.run(), name="kvrouter-load-plane")
        yield
        await self.stop(task)

    async def stop(self, task: asyncio.Task[None]) -> None:
        """Cancel `run` and wait for it, never forever (kvrouter/redisplane/stopping.py): the receiver blocks on the
        channel until a message comes, and redis-py can swallow a cancel that lands as that read starts (a worker
        hung on SIGTERM in 2 runs of ~47 of tests/test_redis_workers.py's restart test); closing the client's
        sockets ends such a read at once."""
        await stop_task(task, "load plane", self._disconnect)

    async def _disconnect(self) -> None:
        if self._client is not None:
            await self._client.connection_pool.disconnect(inuse_connections=True)


class SharingPlane(Protocol):
    """What the collector reads: this plane or the local one of `--workers` (kvrouter/server/local_loadplane.py)."""

    share: LoadShare
    stats: PlaneStats


class LoadPlaneCollector(Collector):
    def __init__(self, plane: SharingPlane) -> None:
        self.plane = plane

    def collect(self) -> Iterator[Metric]:
        stats, share = self.plane.stats, self.plane.share
        yield GaugeMetricFamily(
            "kvrouter_load_share_up",
            "1 while this instance shares load (Redis, or the --workers channel).",
            value=float(stats.connected),
        )
        yield GaugeMetricFamily(
            "kvrouter_load_share_peers", "Other router instances whose load is counted now.", value=len(share.peers())
        )
        yield GaugeMetricFamily(
            "kvrouter_load_share_peer_in_flight",
            "Requests in flight that other router instances reported (counted in this instance's load picture).",
            value=share.load.peer_in_flight(),
        )
        staleness = share.staleness_s
        yield GaugeMetricFamily(
            "kvrouter_load_share_staleness_seconds",
            "How late this instance's load reports reach its peers: the largest delay of its own recent reports "
            "coming back through the channel (NaN before the first).",
            value=math.nan if staleness is None else staleness,
        )
        blind = share.blind_group
        if blind is not None:
            yield GaugeMetricFamily(
                "kvrouter_load_share_blind_peer_decisions",
                "Peers' decisions expected unseen by this instance's next one (mean over recent decisions; "
                "kvrouter/routing/herding.py).",
                value=blind.measured_unseen,
            )
            yield CounterMetricFamily(
                "kvrouter_load_share_blind_placeholders",
                "Placeholders for peers' unseen requests placed before this instance's decisions.",
                value=blind.placed,
            )
            yield CounterMetricFamily(
                "kvrouter_load_share_staggered_decisions",
                "Decisions that waited this instance's stagger (its rank times the blind group's horizon, twice "
                "the staleness; the last rank at most load_share_stagger_max_s) so a burst is decided in rank order.",
                value=blind.staggered,
            )
            yield CounterMetricFamily(
                "kvrouter_load_share_stagger_seconds",
                "Seconds this instance's decisions waited for their stagger, in all.",
                value=blind.stagger_seconds,
            )
        counters = (
            ("published", "Load reports this instance published.", stats.published),
            ("published_bytes", "Bytes of load reports this instance published.", stats.published_bytes),
            ("received", "Load reports received from the channel (own echo included).", stats.received),
            ("received_bytes", "Bytes of load reports received.", stats.received_bytes),
            ("expired", "Peers dropped because their reports stopped (their load no longer counts).", share.expired),
            ("session_errors", "Load-plane sessions ended by an error (Redis gone, ...).", stats.session_errors),
        )
        for name, help_text, value in counters:
            yield CounterMetricFamily(f"kvrouter_load_share_{name}", help_text, value=value)
        problems = CounterMetricFamily(
            "kvrouter_load_share_problems",
            "Peer load reports ignored, by reason (undecodable, negative, absurd_tokens, stale, unknown_replica ...).",
            labels=["reason"],
        )
        for reason, count in sorted(share.problems.items()):
            problems.add_metric([reason], count)
        yield problems


def build_load_plane(
    redis_url: str,
    share: LoadShare,
    registry: CollectorRegistry,
    *,
    interval_s: float,
    heartbeat_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> RedisLoadPlane:
    plane = RedisLoadPlane(
        share, lambda: load_plane_client(redis_url), interval_s=interval_s, heartbeat_s=heartbeat_s, clock=clock
    )
    registry.register(LoadPlaneCollector(plane))
    log.info("sharing load with the other router instances through Redis at %s", masked_url(redis_url))
    return plane


__all__ = [
    "CHANNEL",
    "LoadPlaneCollector",
    "PlaneStats",
    "RedisLoadPlane",
    "SharingPlane",
    "build_load_plane",
    "instance_name",
]
