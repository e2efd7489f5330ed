"""The router's side of Redis: load every replica's state, then follow the streams into the prefix index.

`RedisFollower.run` connects, and for each replica either resumes (Redis still holds the epoch and at least the
entries this router applied) or reloads: snapshot plus stream since (`catchup.read_replica`), applied to the
index after clearing what the router had for that replica — so nothing Redis no longer vouches for survives a
reload (large snapshots are applied in chunks, yielding to requests in between). When every replica is loaded,
`loaded` is set (readiness). It then follows with blocking XREAD: an entry is applied only if its id continues
the replica's position (``<epoch>-<n+1>``); any other id (new epoch, a hole) triggers a reload of that replica.

Faults. Any Redis error ends the session; the follower retries with exponential back-off (with jitter from the
injected random source) and resumes or reloads as above. Meanwhile the index keeps the last vouched blocks and
routing goes on (load plus provisional entries); if Redis stays away longer than ``forget_after_s`` the
event-derived blocks are dropped. ``health()`` reports the source's state for metrics and /ready.

Knobs (`FollowerKnobs`): ``block_ms`` (XREAD block time), ``count`` (entries per XREAD), back-off bounds,
``streams_per_read`` (None: one XREAD for all replicas — single Redis or Sentinel; 1 on Redis Cluster, where
keys of different replicas live in different slots), ``forget_after_s``, ``startup_grace_s`` (how long an
unreachable Redis may hold readiness back before the router serves on load alone).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from redis.asyncio import Redis
from redis.exceptions import RedisError

from kvrouter.config import FleetConfig, ReplicaConfig
from kvrouter.redisplane.catchup import Catchup, CatchupError, read_replica
from kvrouter.redisplane.clients import redis_from_url
from kvrouter.redisplane.entries import EntryCodec, Op, Removed, Stored, unpack_u64
from kvrouter.redisplane.layout import DEFAULT_PREFIX, Position, ReplicaKeys, replica_keys
from kvrouter.typedefs import BlockKey, EngineBlockHash, ReplicaName, Tier

log = logging.getLogger(__name__)


class _Resubscribe(Exception):
    """The set of followed replicas changed: start a new session (positions are kept)."""


class BlockSink(Protocol):
    """What the follower writes to; `kvrouter.index.PrefixIndex` is one."""

    def store_keys(
        self,
        replica: ReplicaName,
        engine_hashes: Sequence[EngineBlockHash],
        keys: Sequence[BlockKey],
        tier: Tier = ...,
        *,
        dp_rank: int = ...,
    ) -> None: ...

    def remove_blocks(
        self, replica: ReplicaName, engine_hashes: Iterable[EngineBlockHash], tier: Tier = ..., *, dp_rank: int = ...
    ) -> int: ...

    def clear(self, replica: ReplicaName, *, dp_rank: int | None = ...) -> None: ...


@dataclass(frozen=True, slots=True)
class FollowerKnobs:
    block_ms: int = 1000
    count: int = 1000
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 5.0
    streams_per_read: int | None = None
    forget_after_s: float = 60.0
    startup_grace_s: float = 10.0
    apply_chunk_blocks: int = 65536


@dataclass(slots=True)
class FollowedReplica:
    keys: ReplicaKeys
    position: Position | None = None
    ranks: set[int] = field(default_factory=set)
    vouched: bool = False
    """Redis holds state for this replica (a relay writes it) and the hash seed matches."""
    refused: bool = False
    """Redis holds state written with another hash seed: followed but not applied."""
    reloads: int = 0
    entries: int = 0


@dataclass(frozen=True, slots=True)
class FollowerHealth:
    connected: bool
    loaded: bool
    failures: int
    reloads: int
    entries: int
    vouched: dict[str, bool]
    last_error: str | None


def connect_redis(url: str, *, block_ms: int = 1000, socket_timeout_s: float | None = None) -> Redis:
    """A client for `url` (single, Sentinel or Cluster: `clients.redis_from_url`) whose read timeout outlasts
    a blocking XREAD but still notices a silent peer."""
    timeout = socket_timeout_s if socket_timeout_s is not None else block_ms / 1000 + 5.0
    return redis_from_url(url, socket_timeout_s=timeout)


class RedisFollower:
    def __init__(
        self,
        connect: Callable[[], Redis],
        replicas: Iterable[ReplicaName],
        sink: BlockSink,
        *,
        hash_seed: int,
        clock: Callable[[], float],
        prefix: str = DEFAULT_PREFIX,
        knobs: FollowerKnobs | None = None,
        rng: random.Random | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.connect = connect
        self.sink = sink
        self.hash_seed = hash_seed
        self.clock = clock
        self.knobs = knobs or FollowerKnobs()
        self.rng = rng or random.Random()
        self.sleep = sleep
        self.codec = EntryCodec()
        self.prefix = prefix
        self.replicas = {r: FollowedReplica(replica_keys(r, prefix)) for r in replicas}
        self._by_stream = {f.keys.stream.encode(): f for f in self.replicas.values()}
        self.loaded = asyncio.Event()
        self.connected = False
        self.failures = 0
        self.last_error: str | None = None
        self._started = clock()
        self._down_since: float | None = None
        self._membership_changed = False
        self._task: asyncio.Task[None] | None = None
        self._redis: Redis | None = None
        self._stopping = False
        self.on_stored: Callable[[ReplicaName, Sequence[BlockKey]], None] | None = None
        """Told the keys of every applied store (the feedback overlay clears its suspects there)."""

    # ---- health ---------------------------------------------------------------------------------------------

    def is_ready(self) -> bool:
        """Index loaded, or Redis unreachable for longer than the start-up grace (then routing goes on load)."""
        return self.loaded.is_set() or self.clock() - self._started >= self.knobs.startup_grace_s

    def health(self) -> FollowerHealth:
        return FollowerHealth(
            connected=self.connected,
            loaded=self.loaded.is_set(),
            failures=self.failures,
            reloads=sum(f.reloads for f in self.replicas.values()),
            entries=sum(f.entries for f in self.replicas.values()),
            vouched={r: f.vouched for r, f in self.replicas.items()},
            last_error=self.last_error,
        )

    # ---- the loop -------------------------------------------------------------------------------------------

    async def follow(self, fleet: FleetConfig, replica: ReplicaConfig) -> None:
        """Start following one more replica (live fleet reload); its state loads in the next session."""
        if replica.replica not in self.replicas and replica.kv_events is not None:
            followed = FollowedReplica(replica_keys(replica.replica, self.prefix))
            self.replicas[replica.replica] = followed
            self._by_stream[followed.keys.stream.encode()] = followed
            self._membership_changed = True

    async def unfollow(self, replica: ReplicaName) -> None:
        followed = self.replicas.pop(replica, None)
        if followed is not None:
            self._by_stream.pop(followed.keys.stream.encode(), None)
            self._drop(followed)
            self._membership_changed = True

    async def context(self, app: object) -> AsyncIterator[None]:
        """The application's `cleanup_ctx`: follow while the app runs."""
        self.start()
        yield
        await self.stop()

    def start(self) -> asyncio.Task[None]:
        self._task = asyncio.create_task(self.run(), name="kvrouter-redis-events")
        return self._task

    async def stop(self) -> None:
        """Cancel `run` and wait for it. A cancel that lands as a blocking XREAD starts can be swallowed inside
        the client's read timeout; closing the client's sockets then ends the read at once."""
        task, self._task = self._task, None
        if task is None:
            return
        self._stopping = True
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=1.0)
        if not done and self._redis is not None:
            with contextlib.suppress(Exception):
                await self._redis.connection_pool.disconnect(inuse_connections=True)
            task.cancel()
            await asyncio.wait([task], timeout=5.0)

    async def run(self) -> None:
        """Follow until cancelled; never raises on Redis trouble."""
        delay = self.knobs.backoff_initial_s
        while True:
            redis = self._redis = self.connect()
            try:
                await self._session(redis)
            except _Resubscribe:
                continue
            except (RedisError, OSError, CatchupError) as error:
                self._went_down(error)
            finally:
                await self._close(redis)
            await self.sleep(delay * (0.5 + self.rng.random()))
            delay = min(delay * 2, self.knobs.backoff_max_s)
            if self.connected:
                delay = self.knobs.backoff_initial_s

    @staticmethod
    async def _close(redis: Redis) -> None:
        # Bounded: a command cancelled mid-flight can leave the client waiting on its socket timeout.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(redis.aclose(), 1.0)

    def _went_down(self, error: BaseException) -> None:
        if (self.connected or self.last_error is None) and not self._stopping:
            log.warning("redis event source unavailable: %s", error)
        self.connected = False
        self.failures += 1
        self.last_error = f"{type(error).__name__}: {error}"
        now = self.clock()
        if self._down_since is None:
            self._down_since = now
        elif now - self._down_since >= self.knobs.forget_after_s:
            for followed in self.replicas.values():
                if followed.vouched or followed.ranks:
                    self._drop(followed)
                followed.position = None

    async def _session(self, redis: Redis) -> None:
        self._membership_changed = False
        await redis.ping()
        for followed in self.replicas.values():
            await self._resume_or_reload(redis, followed)
        self.connected = True
        self._down_since = None
        self.last_error = None
        self.loaded.set()
        groups = self._groups()
        if not groups:
            # No replica publishes events (none has kv_events): keep the session until one is followed.
            while not self._membership_changed:
                await redis.ping()
                await self.sleep(self.knobs.block_ms / 1000)
            raise _Resubscribe
        if len(groups) == 1:
            await self._follow(redis, groups[0])
            return
        # Not a TaskGroup: its ExceptionGroup would hide the Redis error `run` retries on.
        tasks = [asyncio.create_task(self._follow(redis, group)) for group in groups]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _groups(self) -> list[list[FollowedReplica]]:
        followed = list(self.replicas.values())
        size = self.knobs.streams_per_read or len(followed) or 1
        return [followed[i : i + size] for i in range(0, len(followed), size)]

    async def _resume_or_reload(self, redis: Redis, followed: FollowedReplica) -> None:
        position = followed.position
        if position is not None:
            epoch, n = cast(list[bytes | None], await redis.hmget(followed.keys.meta, ["epoch", "n"]))
            if epoch is not None and n is not None and int(epoch) == position.epoch and int(n) >= position.n:
                return
        await self._reload(redis, followed)

    async def _reload(self, redis: Redis, followed: FollowedReplica) -> None:
        catchup = await read_replica(redis, followed.keys, self.codec)
        followed.reloads += 1
        await self._replace(followed, catchup)

    async def _replace(self, followed: FollowedReplica, catchup: Catchup | None) -> None:
        """Swap the replica's blocks for what Redis vouches for. The old blocks go first, at once; the new ones
        are applied in chunks of `apply_chunk_blocks`, yielding to requests in between (1M blocks take about a
        second), so meanwhile the replica is under-predicted, never credited with blocks Redis does not vouch for.
        """
        self._drop(followed)
        if catchup is None:
            followed.position = None
            return
        followed.position = catchup.position
        if catchup.hash_seed != self.hash_seed:
            if not followed.refused:
                log.error(
                    "replica %s: Redis holds keys made with hash seed %d, this router uses %d; ignoring them",
                    followed.keys.replica, catchup.hash_seed, self.hash_seed,
                )
            followed.refused = True
            return
        followed.refused = False
        followed.vouched = True
        chunk = self.knobs.apply_chunk_blocks
        for op in catchup.ops:
            if isinstance(op, Stored) and op.count > chunk:
                for start in range(0, op.count, chunk):
                    piece = slice(start * 8, (start + chunk) * 8)
                    self._apply(followed, [Stored(op.rank, op.tier, op.hashes[piece], op.keys[piece])])
                    await asyncio.sleep(0)
            else:
                self._apply(followed, [op])

    def _drop(self, followed: FollowedReplica) -> None:
        for rank in sorted(followed.ranks):
            self.sink.clear(followed.keys.replica, dp_rank=rank)
        followed.ranks.clear()
        followed.vouched = False

    def _apply(self, followed: FollowedReplica, ops: Iterable[Op]) -> None:
        replica = followed.keys.replica
        sink = self.sink
        for op in ops:
            if isinstance(op, Stored):
                followed.ranks.add(op.rank)
                keys = cast(list[BlockKey], unpack_u64(op.keys))
                sink.store_keys(
                    replica, cast(list[EngineBlockHash], unpack_u64(op.hashes)), keys, Tier(op.tier), dp_rank=op.rank
                )
                if self.on_stored is not None:
                    self.on_stored(replica, keys)
            elif isinstance(op, Removed):
                sink.remove_blocks(
                    replica, cast(list[EngineBlockHash], unpack_u64(op.hashes)), Tier(op.tier), dp_rank=op.rank
                )
            elif op.rank is None:
                for rank in sorted(followed.ranks):
                    sink.clear(replica, dp_rank=rank)
                followed.ranks.clear()
            else:
                sink.clear(replica, dp_rank=op.rank)
                followed.ranks.discard(op.rank)

    async def _follow(self, redis: Redis, group: list[FollowedReplica]) -> None:
        while True:
            if self._membership_changed:
                raise _Resubscribe
            streams: dict[Any, Any] = {
                f.keys.stream: f.position.stream_id if f.position is not None else "0-0" for f in group
            }
            reply = await redis.xread(streams, count=self.knobs.count, block=self.knobs.block_ms)
            # RESP2 answers a list of [stream, entries] pairs, RESP3 a map.
            pairs = cast(
                Iterable[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]],
                reply.items() if isinstance(reply, dict) else reply or (),
            )
            for stream, entries in pairs:
                followed = self._by_stream.get(stream)
                if followed is None:
                    continue
                for stream_id, fields in entries:
                    position = Position.parse(stream_id)
                    if followed.position is None or not position.follows(followed.position):
                        await self._reload(redis, followed)
                        break
                    followed.position = position
                    followed.entries += 1
                    if followed.vouched:
                        self._apply(followed, self.codec.entry(fields[b"e"]).ops)
