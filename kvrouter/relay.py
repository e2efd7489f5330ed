"""`kvrouter relay --replicas replicas.yaml --redis-url URL`: vLLM KV events from ZMQ into Redis.

The relay subscribes to each replica's KV-event publisher with the same ZMQ source, decoding, gap replay and
restart detection the router uses in embedded mode, and applies every batch with the same `IndexIngest` — but
into a `RelayBook` (the relay's authoritative block state) instead of a router's index. The ops that produces
(stored blocks with kvrouter's keys, removals, clears) are written to Redis per replica by a `ReplicaWriter`:
a bounded stream plus a periodic snapshot, and a new epoch on engine restart or clear (see redisplane/).

A restarted relay first reads each replica's state back from Redis and resumes the engine's sequence numbers
from there (`ZmqEventSource.resume_from`): at once, without waiting for the engine's next message, vLLM's replay
buffer fills the gap. When the buffer no longer reaches back that far the replica's DP rank is cleared and
rebuilt from what follows, under a new epoch (counted as `kvrouter_relay_lost_clears_total`); if Redis lost its data
the relay rebuilds it from its own state under a new epoch.

Hostile Redis data never sticks the relay: what it finds in a replica's keys that it did not write (garbage
snapshot, foreign stream entries, keys of another type, meta that is not numbers) is counted per reason
(`kvrouter_relay_repairs_total`) and replaced by a new epoch from the relay's own state (see redisplane/writer.py);
an unexpected error in one replica's write is counted (``internal``) and answered the same way, never stopping
the other replicas or the relay.

One relay can serve many replicas (``--only NAME`` picks some, for a sidecar per replica). Knobs:
``--flush-interval`` (how long batches gather before a write), ``--verify-interval`` (how often an idle relay
checks that Redis still holds what it wrote), the snapshot ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import zmq.asyncio
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.asyncio import Redis
from redis.exceptions import RedisError

from kvrouter.config import ConfigError, FleetConfig, load_fleet
from kvrouter.events.ingest import IndexIngest
from kvrouter.events.metrics import EventMetrics
from kvrouter.events.wire import EventBatch
from kvrouter.events.zmq_source import ZmqEventSource
from kvrouter.redisplane.catchup import CatchupError
from kvrouter.redisplane.clients import masked_url
from kvrouter.redisplane.follower import connect_redis
from kvrouter.redisplane.layout import DEFAULT_PREFIX, replica_keys
from kvrouter.redisplane.problems import SESSION_ERRORS
from kvrouter.redisplane.state import RelayBook
from kvrouter.redisplane.writer import ReplicaWriter, WriterKnobs
from kvrouter.typedefs import ReplicaName

log = logging.getLogger("kvrouter.relay")


@dataclass(frozen=True, slots=True)
class RelayKnobs:
    flush_interval_s: float = 0.005
    verify_interval_s: float = 1.0
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 5.0
    writer: WriterKnobs = field(default_factory=WriterKnobs)


class Relay:
    """The relay's core: `accept` is the ZMQ sources' sink; `run` writes to Redis until cancelled."""

    def __init__(
        self,
        redis: Redis,
        fleet: FleetConfig,
        replicas: Iterable[ReplicaName],
        *,
        clock_ms: Callable[[], int],
        prefix: str = DEFAULT_PREFIX,
        knobs: RelayKnobs | None = None,
        metrics: EventMetrics | None = None,
    ) -> None:
        self.redis = redis
        self.metrics = metrics
        self.knobs = knobs or RelayKnobs()
        names = list(replicas)
        self.book = RelayBook(names)
        block_sizes = {r.replica: fleet.block_size_of(r) for r in fleet.replicas if r.replica in self.book.states}
        self.ingest = IndexIngest(
            self.book, block_sizes=block_sizes, seed=fleet.hash_seed, on_event=metrics.count if metrics else None
        )
        self.sources: dict[ReplicaName, ZmqEventSource] = {}
        self.writers = {
            name: ReplicaWriter(
                redis,
                replica_keys(name, prefix),
                self.book[name],
                hash_seed=fleet.hash_seed,
                clock_ms=clock_ms,
                knobs=self.knobs.writer,
            )
            for name in names
        }
        self.engine_seqs: dict[ReplicaName, dict[int, int]] = {name: {} for name in names}
        self.accepted = 0
        self.redis_up = False
        self.opened = False
        self._dirty: set[ReplicaName] = set()
        self._wake = asyncio.Event()

    async def open(self) -> dict[ReplicaName, dict[int, int]]:
        """Read every replica's state back from Redis; the last engine sequence number per replica and DP rank
        (empty when Redis held nothing usable for the replica)."""
        resume: dict[ReplicaName, dict[int, int]] = {}
        for name, writer in self.writers.items():
            seqs = await writer.open()
            resume[name] = seqs or {}
            self.engine_seqs[name] = dict(seqs or {})
            self._dirty.add(name)
        self.redis_up = True
        self.opened = True
        return resume

    def count_problem(self, replica: str, kind: str, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.count(replica, kind, reason)

    def settled(self) -> bool:
        """Everything accepted so far is in Redis."""
        return not self._dirty and all(w.settled() for w in self.writers.values())

    def accept(self, batch: EventBatch) -> None:
        """One decoded engine batch (in order, gaps already replayed by the source)."""
        replica = ReplicaName(batch.replica)
        if replica not in self.writers:
            return
        self.ingest.apply(batch)
        self.engine_seqs[replica][batch.dp_rank] = batch.seq
        if self.metrics is not None:
            self.metrics.index_blocks.labels(replica).set(len(self.book[replica]))
        self.accepted += 1
        self._dirty.add(replica)
        self._wake.set()

    async def flush(self) -> None:
        """Write what is pending for every dirty replica; a replica whose write fails stays dirty."""
        dirty, self._dirty = self._dirty, set()
        failed: BaseException | None = None
        for name in dirty:
            try:
                await self.writers[name].flush(self.engine_seqs[name])
            except (RedisError, OSError) as error:
                self._dirty.add(name)
                failed = error
            except Exception as error:
                self._internal(name, error)
        if failed is not None:
            raise failed

    def _internal(self, name: ReplicaName, error: Exception) -> None:
        """A bug or data no guard foresaw, in one replica's write: count it, rebuild that replica, go on."""
        writer = self.writers[name]
        writer.problems.count(name, "internal", f"{type(error).__name__}: {error}")
        writer.new_epoch()
        self._dirty.add(name)

    async def verify(self) -> None:
        """An idle relay still checks that Redis holds what it wrote (Redis may have restarted empty, or someone
        wrote into its keys)."""
        for name, writer in self.writers.items():
            try:
                if not await writer.verify():
                    self._dirty.add(name)
            except SESSION_ERRORS:
                raise
            except Exception as error:
                self._internal(name, error)
        await self.flush()

    async def run(self) -> None:
        """Open (retrying until Redis answers), then write until cancelled; Redis trouble is retried."""
        delay = self.knobs.backoff_initial_s
        last_verify = time.monotonic()
        while True:
            try:
                if not self.opened:
                    await self.open()
                    log.info("relay: state of %d replicas read back from Redis", len(self.writers))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.knobs.verify_interval_s)
                self._wake.clear()
                if self.knobs.flush_interval_s > 0:
                    await asyncio.sleep(self.knobs.flush_interval_s)
                if time.monotonic() - last_verify >= self.knobs.verify_interval_s:
                    last_verify = time.monotonic()
                    await self.verify()
                else:
                    await self.flush()
                self.redis_up = True
                delay = self.knobs.backoff_initial_s
            except (RedisError, OSError, CatchupError) as error:
                if self.redis_up:
                    log.warning("relay: Redis unavailable (%s); retrying", error)
                self.redis_up = False
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.knobs.backoff_max_s)
            except Exception:
                log.exception("relay: unexpected error; retrying")  # never let the writer task end
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.knobs.backoff_max_s)


class RelayCollector(Collector):
    """The relay's own health, read at scrape time: Redis reachable, and per replica the entries, snapshots and
    epochs written (an epoch per engine restart, cache reset or Redis data loss)."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay

    def collect(self) -> Iterator[Metric]:
        up = 1.0 if self.relay.redis_up else 0.0
        yield GaugeMetricFamily("kvrouter_relay_redis_up", "1 while the relay's writes reach Redis.", value=up)
        families = {
            "entries": CounterMetricFamily("kvrouter_relay_entries", "Stream entries written.", labels=["replica"]),
            "snapshots": CounterMetricFamily("kvrouter_relay_snapshots", "Snapshots written.", labels=["replica"]),
            "epochs": CounterMetricFamily("kvrouter_relay_epochs", "Epochs started.", labels=["replica"]),
            "lost_clears": CounterMetricFamily(
                "kvrouter_relay_lost_clears",
                "DP ranks cleared because engine events were lost beyond its replay buffer.",
                labels=["replica"],
            ),
        }
        for name, writer in self.relay.writers.items():
            families["entries"].add_metric([name], writer.stats.entries)
            families["snapshots"].add_metric([name], writer.stats.snapshots)
            families["epochs"].add_metric([name], writer.stats.epochs)
            source = self.relay.sources.get(name)
            families["lost_clears"].add_metric([name], source.lost_clears if source is not None else 0)
        yield from families.values()
        repairs = CounterMetricFamily(
            "kvrouter_relay_repairs",
            "Replica keys found holding what the relay did not write, per reason (snapshot, foreign_entry, "
            "wrong_type, bad_meta, gap, internal); each answered by a new epoch from the relay's state.",
            labels=["replica", "reason"],
        )
        for writer in self.relay.writers.values():
            for (replica, reason), count in sorted(writer.problems.counts.items()):
                repairs.add_metric([replica, reason], count)
        yield repairs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", required=True, help="path of replicas.yaml")
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("KVROUTER_REDIS_URL"),
        help="Redis to write to, e.g. redis://:PASSWORD@127.0.0.1:6379/0 (default: $KVROUTER_REDIS_URL, which keeps "
        "the password off the command line)",
    )
    parser.add_argument(
        "--only", action="append", default=None, metavar="NAME", help="relay only this replica (repeatable)"
    )
    parser.add_argument("--key-prefix", default=DEFAULT_PREFIX, help="prefix of the Redis keys (default kvrouter)")
    parser.add_argument("--flush-interval", type=float, default=0.005, help="seconds batches gather per write")
    parser.add_argument("--verify-interval", type=float, default=1.0, help="seconds between idle checks of Redis")
    parser.add_argument(
        "--snapshot-ratio", type=float, default=0.5, help="snapshot when blocks touched reach this × state size"
    )
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    parser.add_argument("--metrics-host", default="0.0.0.0", help="address of the metrics server")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def selected_replicas(fleet: FleetConfig, only: list[str] | None) -> list[ReplicaName]:
    with_events = [r.replica for r in fleet.replicas if r.kv_events is not None]
    if not only:
        return with_events
    unknown = sorted(set(only) - {r.name for r in fleet.replicas})
    if unknown:
        raise ConfigError(f"--only: no replica named {', '.join(unknown)} in replicas.yaml")
    return [r for r in with_events if r in set(only)]


def run(args: argparse.Namespace) -> int:
    try:
        fleet = load_fleet(args.replicas)
        replicas = selected_replicas(fleet, args.only)
    except ConfigError as error:
        print(f"kvrouter relay: {error}", file=sys.stderr)
        return 2
    if not replicas:
        print("kvrouter relay: no replica has kv_events configured; nothing to relay", file=sys.stderr)
        return 2
    if not args.redis_url:
        print("kvrouter relay: no Redis URL: pass --redis-url or set KVROUTER_REDIS_URL", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    knobs = RelayKnobs(
        flush_interval_s=args.flush_interval,
        verify_interval_s=args.verify_interval,
        writer=WriterKnobs(snapshot_ratio=args.snapshot_ratio),
    )
    registry = CollectorRegistry(auto_describe=True)
    metrics = EventMetrics(registry)
    if args.metrics_port is not None:
        start_http_server(args.metrics_port, addr=args.metrics_host, registry=registry)
    redis = connect_redis(args.redis_url, socket_timeout_s=10.0)
    log.info("relay: writing to Redis at %s", masked_url(args.redis_url))  # never the password
    relay = Relay(
        redis,
        fleet,
        replicas,
        clock_ms=lambda: time.time_ns() // 1_000_000,
        prefix=args.key_prefix,
        knobs=knobs,
        metrics=metrics,
    )
    registry.register(RelayCollector(relay))
    with asyncio.Runner() as runner:
        runner.run(_serve(relay, fleet))
    return 0


async def _serve(relay: Relay, fleet: FleetConfig) -> None:
    """Run until SIGTERM/SIGINT; then one last flush so what was applied reaches Redis."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    context = zmq.asyncio.Context()
    context.setsockopt(zmq.LINGER, 0)  # a socket left open must never block term()
    try:
        task = asyncio.create_task(serve_relay(relay, fleet, context=context))
        await asyncio.wait([task, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        with contextlib.suppress(RedisError, OSError):
            await asyncio.wait_for(relay.flush(), 5.0)
    finally:
        context.destroy(linger=0)  # on every way out: never term()ed by the garbage collector
    await relay.redis.aclose()


async def serve_relay(relay: Relay, fleet: FleetConfig, *, context: zmq.asyncio.Context) -> None:
    """Read the state back (retrying until Redis answers), then follow every replica's publisher; until cancelled.

    Each source resumes from the sequence numbers Redis holds: it asks the engine's replay socket for what was
    published since the relay stopped as soon as it subscribes, so an idle engine's gap is filled too.
    """
    delay = relay.knobs.backoff_initial_s
    while not relay.opened:
        try:
            await relay.open()
        except Exception as error:
            log.warning("relay: cannot read the state back from Redis (%r); retrying", error)
            await asyncio.sleep(delay)
            delay = min(delay * 2, relay.knobs.backoff_max_s)
    by_name = {r.replica: r for r in fleet.replicas}
    tasks = [asyncio.create_task(relay.run(), name="kvrouter-relay-writer")]
    for name in relay.writers:
        events = by_name[name].kv_events
        assert events is not None
        source = ZmqEventSource(
            name,
            events,
            relay.accept,
            context=context,
            on_problem=relay.count_problem,
            data_parallel_size=events.data_parallel_size,
        )
        source.resume_from(relay.engine_seqs[name])
        relay.sources[name] = source
        tasks.append(asyncio.create_task(source.run(), name=f"kvrouter-relay-source-{name}"))
        log.info("relay: following %s at %s (resuming after %s)", name, events.endpoint, relay.engine_seqs[name])
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
