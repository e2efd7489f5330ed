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

Hostile or broken data (Redis is shared; see docs/reliability.md, "Hostile Redis entries and Redis access").
Every replica is guarded on its own: an entry that does not decode (or lacks its field, or fails the range checks
in `entries`) is skipped, counted per reason in `problems` and logged once per minute; the replica is then
*tainted* and reloads as soon as the relay writes a newer snapshot. An op the index refuses, a new epoch or a gap
in the numbering reloads the replica at once. A replica whose snapshot does not decode, whose keys hold another
Redis type, whose meta is not numbers or whose snapshot and stream never line up is *quarantined*: its blocks are
dropped (never credited without a voucher), it leaves the XREAD, and its reload is retried with back-off
(``resync_initial_s`` .. ``resync_max_s``) while the other replicas keep flowing. Only Redis itself going away
(connection, timeout, authentication, TLS) ends a session. Any other exception ends the session too, is counted
(``internal``), marks the follower unready until a session is up again, and the loop goes on with back-off; if
the task itself ends, it is restarted with back-off and /ready says not ready meanwhile. A router whose Redis
refuses its credentials before the index was ever loaded stays not ready (a misconfiguration, not an outage).

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
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from kvrouter.config import FleetConfig, ReplicaConfig
from kvrouter.index_writer import IndexWriter
from kvrouter.redisplane.catchup import ENTRY_ERRORS, Catchup, CatchupError, decode_entry, read_replica
from kvrouter.redisplane.clients import redis_from_url
from kvrouter.redisplane.entries import EntryCodec, Op, Removed, Stored, unpack_u64
from kvrouter.redisplane.layout import DEFAULT_PREFIX, Position, ReplicaKeys, replica_keys
from kvrouter.redisplane.problems import SESSION_ERRORS, ApplyFailed, ProblemLog, replica_reason, session_reason
from kvrouter.redisplane.stopping import cancel_requested, stop_task
from kvrouter.routing.lifecycle import EventListener, tell_cleared
from kvrouter.typedefs import BlockKey, EngineBlockHash, ReplicaName, Tier

log = logging.getLogger(__name__)


class _Resubscribe(Exception):
    """The set of followed replicas changed: start a new session (positions are kept)."""


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
    resync_initial_s: float = 0.5
    """First retry of a quarantined replica's reload; doubles up to `resync_max_s`."""
    resync_max_s: float = 10.0
    taint_check_s: float = 1.0
    """How often a replica that skipped entries checks (one HGET) whether a newer snapshot covers them."""


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
    resync: bool = False
    """Reload before the next read (new epoch, gap, an op the index refused)."""
    broken_until: float | None = None
    """Quarantined: Redis holds data for it that cannot be loaded; retried at this time (the follower's clock)."""
    broken_delay: float = 0.0
    snapshot_id: str = ""
    tainted: bool = False
    """Entries were skipped since the snapshot loaded: reload once a newer snapshot is written."""
    taint_checked: float = 0.0


@dataclass(frozen=True, slots=True)
class FollowerHealth:
    connected: bool
    loaded: bool
    failures: int
    reloads: int
    entries: int
    vouched: dict[str, bool]
    last_error: str | None
    problems: dict[tuple[str, str], int] = field(default_factory=dict)
    quarantined: dict[str, bool] = field(default_factory=dict)
    session_errors: dict[str, int] = field(default_factory=dict)
    loop_restarts: int = 0


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
        sink: IndexWriter,
        *,
        hash_seed: int,
        clock: Callable[[], float],
        prefix: str = DEFAULT_PREFIX,
        knobs: FollowerKnobs | None = None,
        rng: random.Random | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        listeners: Sequence[EventListener] = (),
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
        self.replicas = {r: self._followed(r) for r in replicas}
        self._by_stream = {f.keys.stream.encode(): f for f in self.replicas.values()}
        self.loaded = asyncio.Event()
        self.connected = False
        self.failures = 0
        self.last_error: str | None = None
        self.problems = ProblemLog(log, clock)
        self.session_errors: Counter[str] = Counter()
        self.auth_failed = False
        self.crashed = False
        """The loop hit an unexpected error (or its task ended) and no session is up since: not ready."""
        self.loop_restarts = 0
        self._restart_delay = self.knobs.backoff_initial_s
        self._started = clock()
        self._down_since: float | None = None
        self._membership_changed = False
        self._task: asyncio.Task[None] | None = None
        self._redis: Redis | None = None
        self._stopping = False
        self.listeners = tuple(listeners)
        """Told what the stream applies (`kvrouter.routing.lifecycle.EventListener`: the learning overlays): stores,
        removals, clears; and a replica unfollowed. A reload's drop-and-replace is not a clear: the engine kept
        its cache, Redis only re-vouches for it."""

    # ---- health ---------------------------------------------------------------------------------------------

    def _followed(self, replica: ReplicaName) -> FollowedReplica:
        return FollowedReplica(replica_keys(replica, self.prefix), broken_delay=self.knobs.resync_initial_s)

    def is_ready(self) -> bool:
        """Index loaded, or Redis unreachable for longer than the start-up grace (then routing goes on load) —
        but never while the loop is broken, nor while Redis refuses our credentials before anything loaded."""
        if self.crashed or (self._task is not None and self._task.done() and not self._stopping):
            return False
        if self.loaded.is_set():
            return True
        if self.auth_failed:
            return False
        return self.clock() - self._started >= self.knobs.startup_grace_s

    def health(self) -> FollowerHealth:
        return FollowerHealth(
            connected=self.connected,
            loaded=self.loaded.is_set(),
            failures=self.failures,
            reloads=sum(f.reloads for f in self.replicas.values()),
            entries=sum(f.entries for f in self.replicas.values()),
            vouched={r: f.vouched for r, f in self.replicas.items()},
            last_error=self.last_error,
            problems=dict(self.problems.counts),
            quarantined={r: f.broken_until is not None for r, f in self.replicas.items()},
            session_errors=dict(self.session_errors),
            loop_restarts=self.loop_restarts,
        )

    # ---- the loop -------------------------------------------------------------------------------------------

    async def follow(self, fleet: FleetConfig, replica: ReplicaConfig) -> None:
        """Start following one more replica (live fleet reload); its state loads in the next session."""
        if replica.replica not in self.replicas and replica.kv_events is not None:
            followed = self._followed(replica.replica)
            self.replicas[replica.replica] = followed
            self._by_stream[followed.keys.stream.encode()] = followed
            self._membership_changed = True

    async def unfollow(self, replica: ReplicaName) -> None:
        followed = self.replicas.pop(replica, None)
        if followed is not None:
            self._by_stream.pop(followed.keys.stream.encode(), None)
            self._drop(followed)
            tell_cleared(self.listeners, replica, self.clock())
            self._membership_changed = True

    async def context(self, app: object) -> AsyncIterator[None]:
        """The application's `cleanup_ctx`: follow while the app runs."""
        self.start()
        yield
        await self.stop()

    def start(self) -> asyncio.Task[None]:
        self._stopping = False
        self._task = asyncio.create_task(self.run(), name="kvrouter-redis-events")
        self._task.add_done_callback(self._ended)
        return self._task

    def _ended(self, task: asyncio.Task[None]) -> None:
        """`run` never returns; if its task ends anyway (cancelled by someone else, a BaseException), restart it
        with back-off. Until then `is_ready` is False."""
        if self._stopping or task is not self._task:
            return
        error = None if task.cancelled() else task.exception()
        self.loop_restarts += 1
        self._distrust()
        log.error("redis event follower stopped (%r); restarting in %.1fs", error, self._restart_delay)
        delay, self._restart_delay = self._restart_delay, min(self._restart_delay * 2, self.knobs.backoff_max_s)
        asyncio.get_running_loop().call_later(delay, self._restart, task)

    def _distrust(self) -> None:
        """The loop broke somewhere unknown (perhaps mid-entry): not ready, and every replica reloads."""
        self.crashed = True
        for followed in self.replicas.values():
            followed.position = None

    def _restart(self, ended: asyncio.Task[None]) -> None:
        if not self._stopping and self._task is ended:
            self.start()

    async def stop(self) -> None:
        """Cancel `run` and wait for it. A cancel that lands as a blocking XREAD starts can be swallowed inside
        the client's read timeout; closing the client's sockets then ends the read at once."""
        self._stopping = True
        task, self._task = self._task, None
        if task is None:
            return
        await stop_task(task, "redis event follower", self._disconnect)

    async def _disconnect(self) -> None:
        if self._redis is not None:
            await self._redis.connection_pool.disconnect(inuse_connections=True)

    async def run(self) -> None:
        """Follow until cancelled; never raises on Redis trouble."""
        delay = self.knobs.backoff_initial_s
        while True:
            redis: Redis | None = None
            try:
                redis = self._redis = self.connect()
                await self._session(redis)
            except _Resubscribe:
                continue
            except (RedisError, OSError, CatchupError) as error:
                self._went_down(error)
            except Exception as error:
                # A bug, or data that slipped past every guard: never end following over it.
                log.exception("redis event follower: unexpected error; the session restarts")
                self._distrust()
                self._went_down(error)
            finally:
                if redis is not None:
                    await self._close(redis)
            if cancel_requested():  # a cancel the Redis client swallowed: stop, do not reconnect
                raise asyncio.CancelledError
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
        reason = session_reason(error)
        if (self.connected or self.last_error is None) and not self._stopping:
            if reason == "auth":
                log.error("redis event source refused our credentials (check the password in the Redis URL): %s", error)
            else:
                log.warning("redis event source unavailable (%s): %s", reason, error)
        self.auth_failed = reason == "auth"
        self.session_errors[reason] += 1
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
        for followed in list(self.replicas.values()):
            await self._resync(redis, followed, resume=True)
        self.connected = True
        self._down_since = None
        self.last_error = None
        self.auth_failed = False
        self.crashed = False
        self._restart_delay = self.knobs.backoff_initial_s
        self.loaded.set()
        groups = self._groups()
        if not groups:
            # No replica publishes events (none has kv_events): keep the session until one is followed.
            while not self._membership_changed:
                await redis.ping()
                await self.sleep(self.knobs.block_ms / 1000)
            raise _Resubscribe
        if len(groups) == 1:
            await self._follow_guarded(redis, groups[0])
            return
        # Not a TaskGroup: its ExceptionGroup would hide the Redis error `run` retries on.
        tasks = [asyncio.create_task(self._follow_guarded(redis, group)) for group in groups]
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

    async def _resync(self, redis: Redis, followed: FollowedReplica, *, resume: bool = False) -> None:
        """Resume or reload one replica; a failure confined to its data quarantines it (counted, logged, its
        blocks dropped, retried with back-off) instead of ending the session for every replica."""
        followed.resync = False
        try:
            if resume:
                await self._resume_or_reload(redis, followed)
            else:
                await self._reload(redis, followed)
        except SESSION_ERRORS:
            raise
        except Exception as error:
            self._quarantine(followed, replica_reason(error), error)
        else:
            followed.broken_until = None
            followed.broken_delay = self.knobs.resync_initial_s

    def _quarantine(self, followed: FollowedReplica, reason: str, error: BaseException) -> None:
        self.problems.count(followed.keys.replica, reason, f"{type(error).__name__}: {error}")
        self._drop(followed)
        followed.position = None
        followed.tainted = False
        followed.broken_until = self.clock() + followed.broken_delay
        followed.broken_delay = min(followed.broken_delay * 2, self.knobs.resync_max_s)

    async def _reload(self, redis: Redis, followed: FollowedReplica) -> None:
        catchup = await read_replica(redis, followed.keys, self.codec, skip_bad_entries=True)
        followed.reloads += 1
        await self._replace(followed, catchup)
        followed.snapshot_id = catchup.snapshot_id if catchup is not None else ""
        followed.tainted = catchup is not None and catchup.skipped > 0
        followed.taint_checked = self.clock()
        if followed.tainted:
            assert catchup is not None
            self.problems.count(followed.keys.replica, "undecodable", f"{catchup.skipped} entries skipped on reload")

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
                    followed.keys.replica,
                    catchup.hash_seed,
                    self.hash_seed,
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
                    self._apply_checked(followed, [Stored(op.rank, op.tier, op.hashes[piece], op.keys[piece])])
                    await asyncio.sleep(0)
            else:
                self._apply_checked(followed, [op])

    def _apply_checked(self, followed: FollowedReplica, ops: Iterable[Op]) -> None:
        try:
            self._apply(followed, ops)
        except Exception as error:
            raise ApplyFailed(f"{type(error).__name__}: {error}") from error

    def _drop(self, followed: FollowedReplica) -> None:
        for rank in sorted(followed.ranks):
            self.sink.clear(followed.keys.replica, dp_rank=rank)
        followed.ranks.clear()
        followed.vouched = False

    def _apply(self, followed: FollowedReplica, ops: Iterable[Op]) -> None:
        replica = followed.keys.replica
        sink = self.sink
        listeners = self.listeners
        for op in ops:
            if isinstance(op, Stored):
                followed.ranks.add(op.rank)
                keys = cast(list[BlockKey], unpack_u64(op.keys))
                sink.store_keys(
                    replica, cast(list[EngineBlockHash], unpack_u64(op.hashes)), keys, Tier(op.tier), dp_rank=op.rank
                )
                for listener in listeners:
                    listener.on_stored(replica, keys, self.clock())
            elif isinstance(op, Removed):
                hashes = cast(list[EngineBlockHash], unpack_u64(op.hashes))
                removed = self._keys_of(replica, hashes, op.rank) if listeners else []
                sink.remove_blocks(replica, hashes, Tier(op.tier), dp_rank=op.rank)
                for listener in listeners if removed else ():
                    listener.on_removed(replica, removed, self.clock())
            elif op.rank is None:
                for rank in sorted(followed.ranks):
                    sink.clear(replica, dp_rank=rank)
                followed.ranks.clear()
                tell_cleared(listeners, replica, self.clock())
            else:
                sink.clear(replica, dp_rank=op.rank)
                followed.ranks.discard(op.rank)
                tell_cleared(listeners, replica, self.clock())

    def _keys_of(self, replica: ReplicaName, hashes: Sequence[EngineBlockHash], rank: int) -> list[BlockKey]:
        """The router's keys of blocks about to be removed (those the index knows)."""
        found = (self.sink.key_of(replica, block_hash, dp_rank=rank) for block_hash in hashes)
        return [key for key in found if key is not None]

    async def _follow_guarded(self, redis: Redis, group: list[FollowedReplica]) -> None:
        """`_follow`, restarted after anything but a session error: a failure of one group's task is counted
        (``internal``) for its replicas, which reload, and never ends following silently."""
        delay = self.knobs.backoff_initial_s
        while True:
            try:
                await self._follow(redis, group)
            except (_Resubscribe, *SESSION_ERRORS):
                raise
            except Exception as error:
                log.exception("redis event follower: reading %d replica(s) failed", len(group))
                for followed in group:
                    self.problems.count(followed.keys.replica, "internal", f"{type(error).__name__}: {error}")
                    followed.resync = True
                await self.sleep(delay)
                delay = min(delay * 2, self.knobs.backoff_max_s)

    async def _follow(self, redis: Redis, group: list[FollowedReplica]) -> None:
        while True:
            if self._membership_changed:
                raise _Resubscribe
            await self._repair(redis, group)
            live = [f for f in group if f.broken_until is None and f.keys.replica in self.replicas]
            if not live:
                # Every replica of the group is quarantined: still notice Redis going away, then retry them.
                await redis.ping()
                await self.sleep(min(self.knobs.block_ms / 1000, self.knobs.resync_initial_s))
                continue
            streams: dict[Any, Any] = {
                f.keys.stream: f.position.stream_id if f.position is not None else "0-0" for f in live
            }
            try:
                reply = await redis.xread(streams, count=self.knobs.count, block=self.knobs.block_ms)
            except ResponseError as error:
                # One key of the XREAD is not a stream (or the ACL denies it): find it, quarantine it alone.
                await self._find_unreadable(redis, live, error)
                continue
            # RESP2 answers a list of [stream, entries] pairs, RESP3 a map.
            pairs = cast(
                Iterable[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]],
                reply.items() if isinstance(reply, dict) else reply or (),
            )
            for stream, entries in pairs:
                followed = self._by_stream.get(stream)
                if followed is not None:
                    self._take(followed, entries)

    async def _repair(self, redis: Redis, group: list[FollowedReplica]) -> None:
        """Reload the group's replicas that asked for it, whose quarantine ended, or whose skipped entries a
        newer snapshot now covers."""
        now = self.clock()
        for followed in group:
            if followed.resync or (followed.broken_until is not None and now >= followed.broken_until):
                await self._resync(redis, followed)
            elif followed.tainted and now - followed.taint_checked >= self.knobs.taint_check_s:
                followed.taint_checked = now
                try:
                    snapshot_id = await redis.hget(followed.keys.meta, "snapshot_id")
                except ResponseError:
                    snapshot_id = b"?"
                text = snapshot_id.decode(errors="replace") if isinstance(snapshot_id, bytes) else snapshot_id
                if text is not None and text != followed.snapshot_id:
                    await self._resync(redis, followed)

    async def _find_unreadable(self, redis: Redis, live: list[FollowedReplica], error: ResponseError) -> None:
        found = False
        for followed in live:
            try:
                await redis.xread({followed.keys.stream: "0-0"}, count=1)
            except ResponseError as own:
                self._quarantine(followed, replica_reason(own), own)
                found = True
        if not found:
            # Not one key's fault (a transient refusal): wait a little rather than spin.
            log.warning("redis event follower: XREAD refused (%s); retrying", error)
            await self.sleep(self.knobs.block_ms / 1000)

    def _take(self, followed: FollowedReplica, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        """Apply one replica's new entries in order; stop at the first that asks for a reload."""
        replica = followed.keys.replica
        for stream_id, fields in entries:
            position = Position.parse(stream_id)
            if followed.position is None or not position.follows(followed.position):
                followed.resync = True  # a new epoch or a hole: reload from the snapshot
                return
            followed.position = position
            followed.entries += 1
            if not followed.vouched:
                continue
            try:
                entry = decode_entry(self.codec, fields)
            except ENTRY_ERRORS as error:
                reason = "missing_field" if isinstance(error, KeyError) else "undecodable"
                self.problems.count(replica, reason, f"entry {position.stream_id}: {error!r}")
                followed.tainted = True  # its ops are lost until a newer snapshot: reload then
                continue
            try:
                self._apply(followed, entry.ops)
            except Exception as error:
                self.problems.count(replica, "apply_failed", f"entry {position.stream_id}: {error!r}")
                followed.resync = True
                return
