"""The relay's side of Redis: append each replica's ops, keep its snapshot fresh, start new epochs.

Three Lua scripts, each touching only one replica's keys (one hash slot), keep the keys consistent:

* append — checks that Redis still holds exactly what this writer last wrote (meta ``epoch`` and ``n``), then
  XADDs the entries with explicit ids ``<epoch>-<n>`` and moves ``n`` and ``engine_seq`` in the same step. A
  mismatch (Redis restarted empty or from an older file, another relay wrote) answers ``STALE``.
* snapshot — same check, then replaces the snapshot and trims the stream to the *previous* snapshot's id, so a
  reader that just fetched the previous snapshot still finds every entry after it.
* create — starts a new epoch: the stream restarts with ``<epoch>-0`` and the snapshot holds the whole state.

Catch-up state: a periodic compact snapshot plus the stream since, not a Redis hash updated with each append.
Measured (docs/benchmarks.md, "Redis event plane"): at 1M blocks a snapshot costs 16.8 bytes of Redis memory
per block and reads back in 0.2-0.4 s (one GET); a hash of engine hash -> key+tier costs 64 bytes per block and
takes 11 s to read back with HSCAN. A snapshot is written when the blocks touched since the last one reach
``snapshot_ratio`` × the state's size (at least ``snapshot_min_blocks``), which bounds both the stream a new
router replays (≤ 2 × ratio × size ops) and the write amplification (≤ 16 / ratio bytes per block touched).

On ``STALE`` the writer starts a new epoch from its in-memory state: that state is what the engine told the relay,
and the epoch bump tells every follower to reload. On a connection error the entries are kept and retried.

Hostile or broken keys (Redis is shared): the relay never stays stuck on what someone else wrote. `verify` (each
``--verify-interval`` of an idle relay) checks in one O(1) script that the meta hash, the stream's last id and the
snapshot's length and first bytes are still exactly what this writer wrote; an append refused because the stream
holds a foreign entry (``XADD`` id order) or a key holds another type (``WRONGTYPE``); a state read back at start
that does not decode or does not line up — each is counted in `problems` per reason and answered by a new epoch
from the relay's own authoritative state (the create script deletes whatever the keys held).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from kvrouter.redisplane.catchup import Catchup, CatchupError, read_replica
from kvrouter.redisplane.entries import SNAPSHOT_VERSION, Cleared, Entry, EntryCodec, Op, Snapshot
from kvrouter.redisplane.layout import MAX_EPOCH, Position, ReplicaKeys
from kvrouter.redisplane.problems import ProblemLog
from kvrouter.redisplane.state import ReplicaState

log = logging.getLogger(__name__)

_APPEND = """
local meta = redis.call('HMGET', KEYS[1], 'epoch', 'n')
if meta[1] ~= ARGV[1] or meta[2] ~= ARGV[2] then
  return redis.error_reply('STALE epoch=' .. tostring(meta[1]) .. ' n=' .. tostring(meta[2]))
end
local n = tonumber(ARGV[2])
for i = 5, #ARGV do
  n = n + 1
  redis.call('XADD', KEYS[2], ARGV[1] .. '-' .. n, 'e', ARGV[i])
end
redis.call('HSET', KEYS[1], 'n', n, 'engine_seq', ARGV[3], 'updated_ms', ARGV[4])
return n
"""

_SNAPSHOT = """
local meta = redis.call('HMGET', KEYS[1], 'epoch', 'n', 'snapshot_id')
if meta[1] ~= ARGV[1] or meta[2] ~= ARGV[2] then
  return redis.error_reply('STALE epoch=' .. tostring(meta[1]) .. ' n=' .. tostring(meta[2]))
end
redis.call('SET', KEYS[3], ARGV[3])
if meta[3] then
  redis.call('XTRIM', KEYS[2], 'MINID', meta[3])
end
redis.call('HSET', KEYS[1], 'snapshot_id', ARGV[1] .. '-' .. ARGV[2], 'updated_ms', ARGV[4])
return 1
"""

_CREATE = """
redis.call('DEL', KEYS[2])
redis.call('XADD', KEYS[2], ARGV[1] .. '-0', 'e', ARGV[6])
redis.call('SET', KEYS[3], ARGV[3])
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'epoch', ARGV[1], 'n', 0, 'engine_seq', ARGV[2], 'snapshot_id', ARGV[1] .. '-0',
  'updated_ms', ARGV[4], 'hash_seed', ARGV[5])
return 1
"""

_VERIFY = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'none' then return 'stale' end
if kind ~= 'hash' then return 'wrong_type' end
local meta = redis.call('HMGET', KEYS[1], 'epoch', 'n')
if (meta[1] and not tonumber(meta[1])) or (meta[2] and not tonumber(meta[2])) then return 'bad_meta' end
if meta[1] ~= ARGV[1] or meta[2] ~= ARGV[2] then return 'stale' end
if redis.call('TYPE', KEYS[2])['ok'] ~= 'stream' then return 'wrong_type' end
local top = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
if #top == 0 or top[1][1] ~= ARGV[1] .. '-' .. ARGV[2] then return 'foreign_entry' end
if ARGV[3] == '' then return 'ok' end
if redis.call('TYPE', KEYS[3])['ok'] ~= 'string' then return 'wrong_type' end
if redis.call('STRLEN', KEYS[3]) ~= tonumber(ARGV[3]) or redis.call('GETRANGE', KEYS[3], 0, 63) ~= ARGV[4] then
  return 'snapshot'
end
return 'ok'
"""

_REPAIRABLE = ("WRONGTYPE", "XADD")
"""Refusals caused by what the keys hold (another type, a foreign entry above ours), answered by a new epoch.
Others (out of memory, read-only replica) are Redis's state and are retried like a connection error."""


@dataclass(frozen=True, slots=True)
class WriterKnobs:
    snapshot_ratio: float = 0.5
    snapshot_min_blocks: int = 4096
    entry_max_blocks: int = 16384
    """Ops of one flush are split into entries of at most this many blocks."""
    unwritten_max_blocks: int = 1_000_000
    """Past this backlog (Redis away) the entries are dropped and the next write starts a new epoch."""


@dataclass(slots=True)
class WriterStats:
    entries: int = 0
    snapshots: int = 0
    epochs: int = 0
    stale: int = 0


class ReplicaWriter:
    """Writes one replica's `ReplicaState` changes to Redis. Single writer per replica."""

    def __init__(
        self,
        redis: Redis,
        keys: ReplicaKeys,
        state: ReplicaState,
        *,
        hash_seed: int,
        clock_ms: Callable[[], int],
        knobs: WriterKnobs | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.state = state
        self.hash_seed = hash_seed
        self.clock_ms = clock_ms
        self.knobs = knobs or WriterKnobs()
        self.codec = EntryCodec()
        self.position: Position | None = None
        self.engine_seqs: dict[int, int] = {}
        self.stats = WriterStats()
        self._unwritten: list[bytes] = []
        self._unwritten_blocks = 0
        self._since_snapshot = 0
        self._rebuild = True
        self._append = redis.register_script(_APPEND)
        self._snapshot = redis.register_script(_SNAPSHOT)
        self._create = redis.register_script(_CREATE)
        self._verify = redis.register_script(_VERIFY)
        self.problems = ProblemLog(log, lambda: clock_ms() / 1000)
        self._snapshot_mark: tuple[int, bytes] | None = None
        """Length and first 64 bytes of the snapshot this writer last wrote (what `verify` compares)."""

    async def open(self) -> dict[int, int] | None:
        """Load what Redis holds for this replica into the state; the last engine sequence number per DP rank.

        Returns None (and plans a new epoch) when Redis has nothing usable: no keys, or another hash seed.
        """
        catchup = await self._read_back()
        self.state.reset()
        self._unwritten.clear()
        self._unwritten_blocks = 0
        if catchup is None or catchup.hash_seed != self.hash_seed:
            self.position = catchup.position if catchup is not None else None
            self._rebuild = True
            return None
        self.state.load(catchup.ops)
        self.position = catchup.position
        self.engine_seqs = dict(catchup.engine_seqs)
        self._since_snapshot = catchup.stream_blocks
        self._rebuild = False
        return dict(catchup.engine_seqs)

    async def _read_back(self) -> Catchup | None:
        """What Redis holds, or None (and a problem counted) when it is garbage: the relay rebuilds it."""
        try:
            catchup = await read_replica(self.redis, self.keys, self.codec)
        except (CatchupError, ValueError) as error:
            self.problems.count(self.keys.replica, getattr(error, "reason", "bad_meta"), error)
            return None
        except ResponseError as error:
            if "WRONGTYPE" not in str(error):
                raise
            self.problems.count(self.keys.replica, "wrong_type", error)
            return None
        if catchup is not None and catchup.position.epoch >= MAX_EPOCH:
            self.problems.count(self.keys.replica, "bad_meta", f"epoch {catchup.position.epoch}")
            return None
        return catchup

    def settled(self) -> bool:
        """Nothing recorded or encoded is waiting to be written."""
        return not self._rebuild and not self._unwritten and not self.state.pending_weight and not self.state.cleared

    def new_epoch(self) -> None:
        """The replica's state restarted (engine restart or clear): the next flush starts a new epoch."""
        self._rebuild = True
        self._unwritten.clear()
        self._unwritten_blocks = 0

    async def verify(self) -> bool:
        """Whether Redis still holds exactly what this writer wrote; if not, the next flush starts a new epoch."""
        if self._rebuild:
            return False
        if self.position is None:
            self._rebuild = True
            return False
        length, head = self._snapshot_mark or (None, b"")
        verdict = await self._verify(
            keys=[self.keys.meta, self.keys.stream, self.keys.snapshot],
            args=[self.position.epoch, self.position.n, "" if length is None else length, head],
        )
        verdict = verdict.decode() if isinstance(verdict, bytes) else str(verdict)
        if verdict == "ok":
            return True
        if verdict == "stale":
            self.stats.stale += 1
        else:
            self.problems.count(self.keys.replica, verdict, "Redis no longer holds what this relay wrote")
        self._rebuild = True
        return False

    async def flush(self, engine_seqs: dict[int, int]) -> None:
        """Write every pending op; `engine_seqs` is the last engine sequence number applied per DP rank.
        Raises on I/O errors; nothing is lost then: the next flush retries."""
        self.engine_seqs = dict(engine_seqs)
        if self.state.cleared:
            self.state.cleared = False
            self._rebuild = True
        self._encode_pending()
        if self._rebuild:
            await self._start_epoch()
            return
        if self._unwritten:
            await self._write_unwritten()
        if self._since_snapshot >= max(self.knobs.snapshot_min_blocks, self.knobs.snapshot_ratio * len(self.state)):
            await self._write_snapshot()

    def _encode_pending(self) -> None:
        ops = self.state.take_pending()
        if not ops:
            return
        chunk: list[Op] = []
        weight = 0
        for op in ops:
            chunk.append(op)
            weight += op.count
            if weight >= self.knobs.entry_max_blocks:
                self._queue(chunk, weight)
                chunk, weight = [], 0
        if chunk:
            self._queue(chunk, weight)
        if self._unwritten_blocks > self.knobs.unwritten_max_blocks:
            self.new_epoch()

    def _queue(self, ops: list[Op], weight: int) -> None:
        self._unwritten.append(self.codec.encode(Entry(self.engine_seqs, ops)))
        self._unwritten_blocks += weight

    async def _write_unwritten(self) -> None:
        assert self.position is not None
        try:
            n = await self._append(
                keys=[self.keys.meta, self.keys.stream],
                args=[self.position.epoch, self.position.n, self._seqs_text(), self.clock_ms(), *self._unwritten],
            )
        except ResponseError as error:
            await self._refused(error)
            return
        self.stats.entries += len(self._unwritten)
        self.position = Position(self.position.epoch, int(n))
        self._since_snapshot += self._unwritten_blocks
        self._unwritten.clear()
        self._unwritten_blocks = 0

    async def _write_snapshot(self) -> None:
        assert self.position is not None
        blob = self._snapshot_blob(self.position)
        try:
            await self._snapshot(
                keys=[self.keys.meta, self.keys.stream, self.keys.snapshot],
                args=[self.position.epoch, self.position.n, blob, self.clock_ms()],
            )
        except ResponseError as error:
            await self._refused(error)
            return
        self.stats.snapshots += 1
        self._since_snapshot = 0
        self._snapshot_mark = self._mark(blob)

    async def _refused(self, error: ResponseError) -> None:
        """A script refused: Redis lost or changed what we wrote (``STALE``), or the keys hold foreign data."""
        text = str(error)
        if "STALE" in text:
            self.stats.stale += 1
        elif any(marker in text for marker in _REPAIRABLE):
            self.problems.count(self.keys.replica, "wrong_type" if "WRONGTYPE" in text else "foreign_entry", text)
        else:
            raise error
        await self._start_epoch()

    @staticmethod
    def _mark(blob: bytes) -> tuple[int, bytes]:
        return len(blob), blob[:64]

    async def _start_epoch(self) -> None:
        previous = self.position.epoch if self.position is not None and self.position.epoch < MAX_EPOCH else 0
        previous = max(previous, await self._meta_epoch())
        position = Position(max(previous + 1, self.clock_ms()), 0)
        # Ops recorded before the new epoch are already in the state the snapshot carries.
        self.state.take_pending()
        self._unwritten.clear()
        self._unwritten_blocks = 0
        marker = self.codec.encode(Entry(self.engine_seqs, [Cleared(None)]))
        blob = self._snapshot_blob(position)
        await self._create(
            keys=[self.keys.meta, self.keys.stream, self.keys.snapshot],
            args=[
                position.epoch,
                self._seqs_text(),
                blob,
                self.clock_ms(),
                self.hash_seed,
                marker,
            ],
        )
        self.position = position
        self._since_snapshot = 0
        self._rebuild = False
        self._snapshot_mark = self._mark(blob)
        self.stats.epochs += 1
        self.stats.snapshots += 1

    async def _meta_epoch(self) -> int:
        """The epoch the meta hash names, so a new one is above it; 0 when the hash is garbage (not built on)."""
        try:
            raw = await self.redis.hget(self.keys.meta, "epoch")
            epoch = int(raw) if raw is not None else 0
        except (ResponseError, ValueError):
            return 0
        return epoch if 0 <= epoch < MAX_EPOCH else 0

    def _seqs_text(self) -> str:
        """The meta hash's human-readable ``engine_seq`` ("rank:seq ..."); readers use the entries' own."""
        return " ".join(f"{rank}:{seq}" for rank, seq in sorted(self.engine_seqs.items()))

    def _snapshot_blob(self, position: Position) -> bytes:
        return self.codec.encode(
            Snapshot(
                SNAPSHOT_VERSION,
                position.epoch,
                position.n,
                self.engine_seqs,
                self.hash_seed,
                self.state.snapshot_blocks(),
            )
        )
