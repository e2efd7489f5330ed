"""The router's side of the Redis event plane, as the app factory builds it: a follower over the app's prefix
index, and Prometheus metrics read from the follower's health at scrape time (no second copy of its state).

Metrics: ``kvrouter_redis_events_up`` (1 while Redis answers and the streams are followed),
``kvrouter_redis_events_loaded`` (1 once every replica's state was loaded: the index is complete),
``kvrouter_redis_events_failures_total`` (sessions ended by a Redis error), and per replica
``kvrouter_redis_events_vouched`` (Redis holds state for it), ``kvrouter_redis_events_reloads_total`` and
``kvrouter_redis_events_entries_total``. Hostile or broken data and access: per replica
``kvrouter_redis_events_problems_total{replica,reason}`` (entries or keys skipped, see `problems`) and
``kvrouter_redis_events_quarantined`` (1 while its Redis data cannot be loaded and its reload is retried),
``kvrouter_redis_events_session_errors_total{reason}`` (``connection``, ``auth``, ``tls``, ``internal``) and
``kvrouter_redis_events_loop_restarts_total``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvrouter.config import FleetConfig
from kvrouter.index_writer import IndexWriter
from kvrouter.redisplane.clients import is_cluster, masked_url
from kvrouter.redisplane.follower import FollowerHealth, FollowerKnobs, RedisFollower, connect_redis
from kvrouter.routing.lifecycle import EventListener

log = logging.getLogger(__name__)


class FollowerCollector(Collector):
    def __init__(self, follower: RedisFollower) -> None:
        self.follower = follower

    def collect(self) -> Iterator[Metric]:
        health = self.follower.health()
        yield GaugeMetricFamily(
            "kvrouter_redis_events_up",
            "1 while Redis answers and the event streams are followed.",
            value=1.0 if health.connected else 0.0,
        )
        yield GaugeMetricFamily(
            "kvrouter_redis_events_loaded",
            "1 once every replica's state was loaded from Redis (index complete).",
            value=1.0 if health.loaded else 0.0,
        )
        yield CounterMetricFamily(
            "kvrouter_redis_events_failures", "Follower sessions ended by a Redis error.", value=health.failures
        )
        vouched = GaugeMetricFamily(
            "kvrouter_redis_events_vouched",
            "1 when Redis holds state for the replica (a relay writes it).",
            labels=["replica"],
        )
        reloads = CounterMetricFamily(
            "kvrouter_redis_events_reloads",
            "Full reloads of a replica's state (start, new epoch, gap).",
            labels=["replica"],
        )
        entries = CounterMetricFamily(
            "kvrouter_redis_events_entries", "Stream entries applied per replica.", labels=["replica"]
        )
        quarantined = GaugeMetricFamily(
            "kvrouter_redis_events_quarantined",
            "1 while the replica's data in Redis cannot be loaded (its blocks dropped, reload retried).",
            labels=["replica"],
        )
        for name, followed in self.follower.replicas.items():
            vouched.add_metric([name], 1.0 if followed.vouched else 0.0)
            reloads.add_metric([name], followed.reloads)
            entries.add_metric([name], followed.entries)
            quarantined.add_metric([name], 1.0 if health.quarantined.get(name) else 0.0)
        yield vouched
        yield reloads
        yield entries
        yield quarantined
        yield from self._problems(health)

    @staticmethod
    def _problems(health: FollowerHealth) -> Iterator[Metric]:
        problems = CounterMetricFamily(
            "kvrouter_redis_events_problems",
            "Entries or keys in Redis the follower skipped, per replica and reason (undecodable, missing_field, "
            "apply_failed, snapshot, wrong_type, bad_meta, gap, internal ...).",
            labels=["replica", "reason"],
        )
        for (replica, reason), count in sorted(health.problems.items()):
            problems.add_metric([replica, reason], count)
        yield problems
        errors = CounterMetricFamily(
            "kvrouter_redis_events_session_errors",
            "Follower sessions ended, by reason (connection, auth, tls, internal).",
            labels=["reason"],
        )
        for reason, count in sorted(health.session_errors.items()):
            errors.add_metric([reason], count)
        yield errors
        yield CounterMetricFamily(
            "kvrouter_redis_events_loop_restarts",
            "Times the follower's task ended unexpectedly and was restarted.",
            value=health.loop_restarts,
        )


def build_follower(
    redis_url: str,
    fleet: FleetConfig,
    index: IndexWriter,
    registry: CollectorRegistry,
    *,
    clock: Callable[[], float] = time.monotonic,
    listeners: Sequence[EventListener] = (),
) -> RedisFollower:
    follower = RedisFollower(
        lambda: connect_redis(redis_url),
        [r.replica for r in fleet.replicas if r.kv_events is not None],
        index,
        hash_seed=fleet.hash_seed,
        clock=clock,
        # On a Cluster each replica's stream lives in its own slot: one XREAD per replica.
        knobs=FollowerKnobs(streams_per_read=1 if is_cluster(redis_url) else None),
        listeners=listeners,
    )
    registry.register(FollowerCollector(follower))
    log.info("relay mode: following KV events in Redis at %s", masked_url(redis_url))  # never the password
    return follower
