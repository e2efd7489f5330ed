"""A replica's vLLM KV-event stream over ZMQ, made gap-free where the engine allows, handed to a sink.

`ZmqEventSource.run()` subscribes to the replica's publisher (connecting, or binding when the engine connects —
`KvEventsConfig.bind`), decodes every message once (`wire.WireDecoder`) and passes each normalised `EventBatch`
to `sink` — the router's index ingest, or the Redis relay; both use this class unchanged.

Sequence numbers are tracked per (replica, data-parallel rank), because every DP rank's engine counts its own:
* the next number: delivered;
* a jump forward (a lost message, or the router starting after the engine): the missing range is asked from the
  engine's replay socket (DEALER sends `[b"", seq]`; replies until seq == -1) and delivered in order first; what
  the engine no longer buffers is counted as lost, and when the rank had history an `AllBlocksCleared` for it is
  delivered first — a lost removal would otherwise leave blocks the engine no longer holds;
* a number at or below the last one: the engine restarted, so its cache is empty — an
  `AllBlocksCleared(restart=True)` for every rank of the replica is delivered before the new message (a vLLM
  server restarts its DP ranks together).

A source that resumes (`resume_from`, the relay restarting from what Redis holds) or reopens its sockets asks
the replay socket for everything after each rank's last seq as soon as it subscribes, and once more after
`recheck_s` (a SUB socket misses what is published before its subscription reaches the publisher), so an idle
engine's gap is filled without waiting for its next message; live copies of what the replay delivered are
dropped as duplicates.

Hostile input is refused before it costs anything: a message whose DP rank is outside [0, data_parallel_size)
is skipped as `bad_rank` (it would otherwise open an index source per made-up rank); a payload over the
config's `max_message_bytes` is skipped undecoded as `oversized` (its seq then shows as a gap: replayed, or lost
and the rank cleared; replay replies get ZMQ's MAXMSGSIZE as well). A bound socket (`bind: true`) trusts its
network unless the config names `allow_from`: then the socket runs on a context of its own whose ZAP handler
(`zap.PeerAllowList`) refuses every peer address outside the list (`peer_refused`). vLLM's publisher cannot
authenticate, so an address check (or a network policy, or an ipc:// endpoint's file permissions) is all there is.

Nothing stops the task but cancellation: a malformed frame or event is counted by `(replica, type, reason)`
through `on_problem`, logged at most once per `log_every_s` per reason, and skipped; a socket error closes and
reopens the sockets after `reconnect_s`, and so does an endpoint that cannot be bound or connected yet (a port
still held). Every socket and the allow-list's context are closed on every way out, never left to the garbage
collector: pyzmq's finalizer of a context collected together with one of its open sockets waits in term() forever.

Knobs: `replay_timeout_s` (wait for each replay reply), `recheck_s`, `data_parallel_size` (rank r of a connecting source
publishes and replays on the configured ports + r, as vLLM assigns them), `rcv_hwm` (messages the SUB socket
queues while the sink is behind: it bounds this process's memory under an event flood; past it ZMQ stops reading
and the backlog waits in the engine's publisher — vLLM's `KVEventsConfig.hwm` — which drops the excess, so the
next message reveals a seq gap: replayed, or counted as lost and the rank cleared, never silent).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from kvrouter.config import KvEventsConfig
from kvrouter.events.wire import (
    SEQ_END,
    AllBlocksCleared,
    DecodeProblem,
    EventBatch,
    WireDecoder,
    decode_seq,
    encode_seq,
    split_frames,
    split_replay_reply,
)
from kvrouter.events.zap import ZAP_DOMAIN, PeerAllowList

_YIELD_EVERY_S = 0.002

BatchSink = Callable[[EventBatch], Awaitable[None] | None]
ProblemCount = Callable[[str, str, str], None]
"""(replica, event type or "frame", reason) -> None."""


class RateLimitedLog:
    """Logs a recurring problem at most once per `every_s` per key, with how many were suppressed."""

    def __init__(self, logger: logging.Logger, *, every_s: float, clock: Callable[[], float]) -> None:
        self.logger = logger
        self.every_s = every_s
        self.clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, message: str, *args: object) -> None:
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        suppressed = self._suppressed.pop(key, 0)
        self._last[key] = now
        suffix = f" ({suppressed} more since the last report)" if suppressed else ""
        self.logger.warning(message + suffix, *args)


def offset_endpoint(endpoint: str, offset: int) -> str:
    """vLLM's address for DP rank `offset`: tcp ports shifted by the rank; other transports unchanged."""
    if offset == 0 or not endpoint.startswith("tcp://"):
        return endpoint
    parts = urlsplit(endpoint)
    if parts.port is None:
        return endpoint
    host = endpoint[len("tcp://") : endpoint.rindex(":")]
    return f"tcp://{host}:{parts.port + offset}"


@dataclass(slots=True)
class SequenceTracker:
    """Last delivered seq per DP rank (pure)."""

    last: dict[int, int] = field(default_factory=dict)

    def classify(self, rank: int, seq: int) -> str:
        """ "next", "first" (no history), "gap" (seq skipped ahead) or "restart" (seq went backwards or repeated)."""
        previous = self.last.get(rank)
        if previous is None:
            return "first"
        if seq == previous + 1:
            return "next"
        if seq > previous + 1:
            return "gap"
        return "restart"

    def expected(self, rank: int) -> int:
        previous = self.last.get(rank)
        return 0 if previous is None else previous + 1

    def delivered(self, rank: int, seq: int) -> None:
        self.last[rank] = seq


class ZmqEventSource:
    def __init__(
        self,
        replica: str,
        config: KvEventsConfig,
        sink: BatchSink,
        *,
        context: zmq.asyncio.Context,
        on_problem: ProblemCount | None = None,
        data_parallel_size: int = 1,
        replay_timeout_s: float = 1.0,
        recheck_s: float = 1.0,
        reconnect_s: float = 1.0,
        rcv_hwm: int = 1000,
        log_every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger | None = None,
    ) -> None:
        self.replica = replica
        self.config = config
        self.sink = sink
        self.context = context
        self.on_problem = on_problem
        self.data_parallel_size = data_parallel_size
        self.replay_timeout_s = replay_timeout_s
        self.recheck_s = recheck_s
        self.reconnect_s = reconnect_s
        self.rcv_hwm = rcv_hwm
        self.tracker = SequenceTracker()
        self.decoder = WireDecoder()
        self.log = RateLimitedLog(logger or logging.getLogger(__name__), every_s=log_every_s, clock=clock)
        self.delivered = 0
        self.replayed = 0
        self.lost = 0
        self.restarts = 0
        self.lost_clears = 0
        """Ranks cleared because events the engine no longer buffers were lost after the rank had history."""
        self.duplicates = 0
        self._caught_up_from: dict[int, int] = {}
        """Per rank, the last seq before a catch-up replay: a live seq above it and at or below the last delivered
        is a copy of a replayed message, not an engine restart."""
        self.connected = asyncio.Event()
        self.clock = clock

    def resume_from(self, last_seq_by_rank: Mapping[int, int]) -> None:
        """Continue after these last delivered seqs (per DP rank), before `run`: on start the source asks the replay
        socket for what each rank published since, delivers it, then follows live."""
        for rank, seq in last_seq_by_rank.items():
            self.tracker.delivered(rank, seq)

    # ---- the loop -----------------------------------------------------------------------------------------

    async def run(self) -> None:
        guard = self._guard()
        try:
            await self._follow(guard.context if guard is not None else self.context)
        finally:
            if guard is not None:
                # Destroyed even when a second cancellation interrupts the stop: a context left to the garbage
                # collector with a socket still open blocks the collecting thread in term() for good.
                try:
                    await guard.stop()
                finally:
                    guard.context.destroy(linger=0)

    def _guard(self) -> PeerAllowList | None:
        """A bound socket with an allow-list gets a context of its own with a ZAP handler (one per context)."""
        if not (self.config.bind and self.config.allow_from is not None):
            return None
        context = zmq.asyncio.Context()
        context.setsockopt(zmq.LINGER, 0)
        guard = PeerAllowList(context, self.config.allow_from, on_refused=self._refused)
        try:
            guard.start()
        except BaseException:
            context.destroy(linger=0)
            raise
        return guard

    def _refused(self, peer: str) -> None:
        self._problem(DecodeProblem("frame", "peer_refused", peer))

    async def _follow(self, context: zmq.asyncio.Context) -> None:
        while True:
            try:
                socket = self._open(context)
            except zmq.ZMQError as error:  # e.g. a bound endpoint's port still held by another process
                self.log.warning(
                    f"socket:{self.replica}",
                    "kv events from %s: cannot open %s (%s); retrying",
                    self.replica,
                    self.config.endpoint,
                    error,
                )
                await asyncio.sleep(self.reconnect_s)
                continue
            worked_since = self.clock()
            try:
                self.connected.set()
                # The SUB socket is open first, so what is published during the replay queues up behind it.
                recheck_at = await self._catch_up()
                while True:
                    if recheck_at is not None:
                        remaining_ms = max(0, int((recheck_at - self.clock()) * 1000))
                        if remaining_ms == 0 or not await socket.poll(remaining_ms):
                            recheck_at = None
                            await self._catch_up()
                            continue
                    frames = await socket.recv_multipart()
                    try:
                        await self.handle(frames)
                    except Exception as error:  # a sink or decode bug must not end the stream
                        self._problem(DecodeProblem("frame", "internal_error", repr(error)))
                    # A receive with messages queued completes without yielding: under an event flood this loop
                    # would hold the event loop until the queue drained, and every request would wait on it. So
                    # it yields once per _YIELD_EVERY_S of work (not per message, which costs ingest throughput).
                    now = self.clock()
                    if now - worked_since >= _YIELD_EVERY_S:
                        await asyncio.sleep(0)
                        worked_since = self.clock()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as error:
                self.log.warning(
                    f"socket:{self.replica}", "kv events from %s: socket error %s; reopening", self.replica, error
                )
            finally:
                self.connected.clear()
                socket.close(linger=0)
            await asyncio.sleep(self.reconnect_s)

    def _open(self, context: zmq.asyncio.Context) -> zmq.asyncio.Socket:
        socket = context.socket(zmq.SUB)
        try:
            socket.setsockopt(zmq.RCVHWM, self.rcv_hwm)
            if self.config.bind and self.config.allow_from is not None:
                socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
            socket.setsockopt(zmq.SUBSCRIBE, self.config.topic.encode())
            for rank in range(self.data_parallel_size):
                endpoint = offset_endpoint(self.config.endpoint, rank)
                if self.config.bind:
                    socket.bind(endpoint)
                else:
                    socket.connect(endpoint)
        except BaseException:
            # Closed here: left open, it would outlive this call only in the traceback, and a context collected
            # together with an open socket of its own never finishes term().
            socket.close(linger=0)
            raise
        return socket

    # ---- one message --------------------------------------------------------------------------------------

    async def handle(self, frames: list[bytes]) -> None:
        """Decode one published message and deliver it (after any replay or restart it reveals)."""
        parts = split_frames(frames)
        if parts is None:
            self._problem(DecodeProblem("frame", "bad_frame_count", str(len(frames))))
            return
        _topic, seq_frame, payload = parts
        seq = decode_seq(seq_frame)
        if seq is None:
            self._problem(DecodeProblem("frame", "bad_seq", seq_frame[:16].hex()))
            return
        if len(payload) > self.config.max_message_bytes:
            # Skipped before decoding (which would hold the loop ~15 ms per MB); the seq is not delivered, so the
            # rank's next message shows it as a gap: replayed (refused again there) or counted lost, rank cleared.
            self._problem(DecodeProblem("frame", "oversized", f"seq {seq}: {len(payload)} bytes"))
            return
        batch = self._decode(seq, payload)
        if batch is None:
            return
        rank = batch.dp_rank
        if not 0 <= rank < self.data_parallel_size:
            # Not a rank this replica has: indexing it would open a source (a table bit) per made-up rank.
            self._problem(DecodeProblem("frame", "bad_rank", f"rank {rank} of {self.data_parallel_size}"))
            return
        floor = self._caught_up_from.get(rank)
        if floor is not None:
            if floor < seq <= self.tracker.last.get(rank, -1):
                self.duplicates += 1
                return
            del self._caught_up_from[rank]
        state = self.tracker.classify(rank, seq)
        if state == "restart":
            self.restarts += 1
            self.log.warning(
                f"restart:{self.replica}",
                "kv events from %s rank %d: seq went from %d to %d; the engine restarted, dropping its blocks",
                self.replica,
                rank,
                self.tracker.last[rank],
                seq,
            )
            # A vLLM server restarts all its DP ranks together; a rank that has not spoken yet must not keep
            # its old blocks meanwhile. Each rank's history starts over.
            for stale in sorted(self.tracker.last):
                cleared = EventBatch(self.replica, stale, seq, batch.ts, [AllBlocksCleared(restart=True)])
                await self._deliver(cleared)
            self.tracker.last.clear()
            self._caught_up_from.clear()
            state = "first"
        if state in ("gap", "first") and seq > self.tracker.expected(rank):
            await self._replay(rank, self.tracker.expected(rank), seq, batch.ts)
        await self._deliver(batch)
        self.tracker.delivered(rank, seq)

    def _decode(self, seq: int, payload: bytes) -> EventBatch | None:
        batch, problems = self.decoder.decode_payload(self.replica, seq, payload)
        for problem in problems:
            self._problem(problem)
        return batch

    async def _deliver(self, batch: EventBatch) -> None:
        result = self.sink(batch)
        if inspect.isawaitable(result):
            await result
        self.delivered += 1

    def _problem(self, problem: DecodeProblem) -> None:
        if self.on_problem is not None:
            self.on_problem(self.replica, problem.kind, problem.reason)
        self.log.warning(
            f"{problem.kind}:{problem.reason}:{self.replica}",
            "kv events from %s: skipped %s (%s) %s",
            self.replica,
            problem.kind,
            problem.reason,
            problem.detail[:200],
        )

    # ---- replay -------------------------------------------------------------------------------------------

    async def _catch_up(self) -> float | None:
        """Replay everything after each rank's last delivered seq; when the time to check again is, if any."""
        if not self.config.replay_endpoint or not self.tracker.last:
            return None
        for rank, last in sorted(self.tracker.last.items()):
            self._caught_up_from.setdefault(rank, last)
            await self._replay(rank, last + 1, None)
        return self.clock() + self.recheck_s

    async def _replay(self, rank: int, start: int, until: int | None, until_ts: float = 0.0) -> None:
        """Deliver seqs [start, until) of `rank` (everything from `start` when `until` is None; `until_ts` is the
        time of message `until`) from the engine's replay buffer; count what it cannot give, and clear the rank
        when that loss breaks a known history."""
        got = await self._replay_batches(rank, start, until) if self.config.replay_endpoint else []
        next_seq = start
        for seq, batch in got:
            if seq < next_seq or (until is not None and seq >= until) or batch.dp_rank != rank:
                continue
            if seq > next_seq:
                await self._lost(rank, next_seq, seq, batch.ts)
            await self._deliver(batch)
            self.tracker.delivered(rank, seq)
            self.replayed += 1
            next_seq = seq + 1
        if until is not None and next_seq < until:
            await self._lost(rank, next_seq, until, until_ts)

    async def _lost(self, rank: int, start: int, until: int, ts: float) -> None:
        """Seqs [start, until) of `rank` are gone for good. The blocks they stored are merely missing, but a lost
        removal or clear would leave blocks the engine no longer holds: a rank with history is cleared (the relay
        starts a new epoch), and rebuilt from what follows."""
        self.lost += until - start
        if self.on_problem is not None:
            self.on_problem(self.replica, "frame", "lost")
        self.log.warning(
            f"lost:{self.replica}",
            "kv events from %s rank %d: seqs %d..%d are lost (not in the replay buffer)",
            self.replica,
            rank,
            start,
            until - 1,
        )
        if rank in self.tracker.last:
            self.lost_clears += 1
            await self._deliver(EventBatch(self.replica, rank, until - 1, ts, [AllBlocksCleared()]))
            self.tracker.delivered(rank, until - 1)

    async def _replay_batches(self, rank: int, start: int, until: int | None) -> list[tuple[int, EventBatch]]:
        assert self.config.replay_endpoint is not None
        endpoint = offset_endpoint(self.config.replay_endpoint, rank)
        socket = self.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        batches: list[tuple[int, EventBatch]] = []
        try:
            socket.connect(endpoint)
            await socket.send_multipart([b"", encode_seq(start)])
            while True:
                if not await socket.poll(int(self.replay_timeout_s * 1000)):
                    self._problem(DecodeProblem("frame", "replay_timeout", endpoint))
                    break
                reply = split_replay_reply(await socket.recv_multipart())
                if reply is None:
                    self._problem(DecodeProblem("frame", "bad_replay_reply"))
                    continue
                seq, payload = reply
                if seq == SEQ_END:
                    break
                if len(payload) > self.config.max_message_bytes:
                    self._problem(DecodeProblem("frame", "oversized", f"replayed seq {seq}: {len(payload)} bytes"))
                    continue
                batch = self._decode(seq, payload)
                if batch is not None:
                    batches.append((seq, batch))
                if until is not None and seq >= until - 1:
                    break  # the rest will arrive live
        except zmq.ZMQError as error:
            self._problem(DecodeProblem("frame", "replay_error", str(error)))
        finally:
            socket.close(linger=0)
        return batches


__all__ = ["BatchSink", "ProblemCount", "RateLimitedLog", "SequenceTracker", "ZmqEventSource", "offset_endpoint"]
