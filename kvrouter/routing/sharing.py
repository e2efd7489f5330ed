"""Shared load between router instances of one fleet: what an instance publishes and how it folds in the others'.

Each instance counts only what it routed itself (`LoadBook`). `LoadShare` turns that into a report — its own
counts per replica (in flight, pending prefill tokens, decoding requests) plus the prefixes it routed since its
last report (each one's leading block keys, which peers mark provisional on that replica, as this instance did)
— and folds the reports of the other instances into the same load book. Reports are absolute, not increments, so
a lost, repeated or late one does no lasting harm; a peer that stops reporting (it died, or lost Redis) is dropped
`expiry_s` after its last report, so its share stops counting. A rise of a peer's pending prefill tokens on a
replica is its dispatches there since its last report: a policy that follows the progress of the prefills queued on
a replica (kv_aware, `PeerPrefillSink`) hears them, so it knows how far the whole queue is, not only its own part.
The transport (Redis pub/sub, `kvrouter.redisplane.loadplane`; without Redis, between `--workers` processes, Unix
datagrams: `kvrouter.server.local_loadplane`) only moves bytes: this module is pure and clock-free (`now` is an
argument).

Hostile peers. A report is decoded at the edge into `LoadReport` (msgspec, typed) and then checked whole: counts
negative, above `max_in_flight` requests, decoding more than in flight, or more than `max_tokens_per_request`
pending tokens per request in flight (so 10^12 tokens is refused), prefixes not in whole 8-byte keys or longer than
`max_prefix_blocks`, calibration samples not finite or out of their physical range (`bad_sample`): the whole report
is ignored and counted by reason (`problems`), the peer's previous report stays until it expires. Replicas this
instance does not route to are skipped (`unknown_replica`), reports older than one already folded from the same peer
are skipped (`stale`), and this instance's own echo is ignored.

When to publish. Every change of this instance's own load that peers must hear — a dispatch committed, a
prefill done (first token), a request finished — calls `notify` (the shell's wake-up: it only sets a flag, so the
request path never waits on the transport); the shell then publishes one report with whatever changed meanwhile.
How stale peers are is measured, not assumed: the shell hands `report` the time it sends a report and `receive` the
time its own echo comes back through the channel; the largest of the last `ECHO_WINDOW` echo delays is the plane's
`staleness_s`, and the blind group's horizon is twice it (a change may wait for the one publish ahead of it, then
travel itself).

Calibration (`share_calibration`; live with the setting `load_share_calibration`, off by default). kv_aware
learns each replica's costs from the TTFTs of the requests it routed (`kvrouter.routing.calibration`); an instance
of K sees a K-th of them, so K instances fit K noisier cost models of the same replicas (live, three instances
priced one replica's prefill at 9k, 21k and 22k tokens/s). With the setting, a policy that calibrates
(`PeerCalibrationSink`) hands the load share the observations it made; each report carries those made since the
last one (`samples`), and every instance fits them beside its own, so each fits the fleet's whole history as one
router would. A peer's samples leave the fits when its reports expire. Off by default: in the replay it bought no
tail latency on the held-out trace (docs/scaling.md, "Shared calibration").

Knobs (`Settings`, `KVROUTER_LOAD_SHARE_*`): `interval_s` (the shell's tick: expiry, and a change no listener
signalled), `heartbeat_s` (publish even when nothing changed, so peers keep this instance and newcomers learn it),
`expiry_s`, `prefix_blocks` (leading blocks of a routed prefix shared with peers).
"""

from __future__ import annotations

import math
import sys
from array import array
from collections import Counter, deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import msgspec

from kvrouter.routing.calibration import Observation, SharedObservation
from kvrouter.routing.herding import BlindGroup
from kvrouter.routing.lifecycle import Routed
from kvrouter.routing.load import LoadBook, OwnLoad
from kvrouter.routing.router import PrefixLookup
from kvrouter.typedefs import BlockKey, ReplicaName

WIRE_VERSION = 1
ECHO_WINDOW = 64
"""Own echoes whose delay the staleness estimate keeps (the largest counts)."""


class ReplicaCounts(msgspec.Struct, array_like=True, frozen=True):
    replica: str
    in_flight: int
    pending_prefill_tokens: int
    decode_requests: int


class RoutedPrefix(msgspec.Struct, array_like=True, frozen=True):
    replica: str
    keys: bytes
    """Leading block keys, little-endian u64 each."""


class CostSample(msgspec.Struct, array_like=True, frozen=True):
    """One calibration observation (`kvrouter.routing.calibration.Observation`) on a replica of the given weight."""

    replica: str
    work_tokens: float
    short: float
    passes: float
    decoding: float
    ttft_s: float
    weight: float


class LoadReport(msgspec.Struct, array_like=True, frozen=True):
    version: int
    instance: str
    seq: int
    replicas: list[ReplicaCounts]
    prefixes: list[RoutedPrefix] = []
    samples: list[CostSample] = []
    """Calibration observations made since the last report (a later field: older peers' reports have none)."""


@dataclass(frozen=True, slots=True)
class ShareLimits:
    expiry_s: float = 3.0
    prefix_blocks: int = 256
    max_in_flight: int = 100_000
    max_tokens_per_request: int = 4_194_304
    max_instance_chars: int = 128
    max_ttft_s: float = 86_400.0
    """A calibration sample's TTFT above this is refused (a day: no engine answers later and is still routed to)."""
    max_weight: float = 1e6


_BIG_ENDIAN = sys.byteorder == "big"
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(LoadReport)


def _sample(shared: SharedObservation) -> CostSample:
    o = shared.observation
    return CostSample(str(shared.replica), o.work_tokens, o.short, o.passes, o.decoding, o.ttft_s, shared.weight)


def _observation(sample: CostSample) -> SharedObservation:
    observation = Observation(sample.work_tokens, sample.short, sample.passes, sample.decoding, sample.ttft_s)
    return SharedObservation(ReplicaName(sample.replica), observation, sample.weight)


def _pack_keys(keys: Sequence[BlockKey]) -> bytes:
    """Little-endian u64 each, converted in C (a Python loop over a request's ~250 keys cost ~20 µs a report)."""
    packed = array("Q", keys)
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def _unpack_keys(blob: bytes) -> list[BlockKey]:
    """The keys of `_pack_keys`'s bytes (a whole number of 8-byte words: `_refusal` checked it)."""
    keys = array("Q")
    keys.frombytes(blob)
    if _BIG_ENDIAN:
        keys.byteswap()
    return keys.tolist()  # type: ignore[return-value]  # BlockKey is a NewType of int


@runtime_checkable
class PeerPrefillSink(Protocol):
    """A policy that follows the progress of every request prefilling on a replica, the peers' included."""

    def peer_prefill(self, replica: ReplicaName, tokens: int, pending: int, now: float) -> None:
        """A peer's report on `replica`, folded in `now`, shows `tokens` (> 0) more prefill tokens pending there
        than its last one (its dispatches since); the replica's pending prefill is now `pending` (the fleet's)."""
        ...


@runtime_checkable
class PeerCalibrationSink(Protocol):
    """A policy that learns replica costs from TTFTs: it hands out its observations and fits the peers' too."""

    def share_observations(self) -> None:
        """Start keeping observations for `take_observations`."""
        ...

    def take_observations(self) -> list[SharedObservation]:
        """The observations made since the last call."""
        ...

    def peer_observations(self, peer: str, observations: Sequence[SharedObservation]) -> None:
        """A peer instance's observations, already checked."""
        ...

    def forget_peer(self, peer: str) -> None:
        """The peer's reports stopped: its observations no longer count."""
        ...


@dataclass(slots=True)
class _Peer:
    seq: int
    seen: float


class LoadShare:
    """One instance's side of load sharing; also a `RequestListener` (it hears what the router routes)."""

    def __init__(
        self,
        instance: str,
        load: LoadBook,
        replicas: Callable[[], Collection[ReplicaName]],
        *,
        lookup: PrefixLookup | None = None,
        limits: ShareLimits | None = None,
        blind_group: BlindGroup | None = None,
        progress: PeerPrefillSink | None = None,
        calibration: PeerCalibrationSink | None = None,
    ) -> None:
        self.instance = instance
        self.blind_group = blind_group
        """Hears the peers' dispatches (`kvrouter.routing.herding`: how blind this instance's decisions are)."""
        self.progress = progress
        """Hears the prefill tokens peers sent to each replica (kv_aware's prefill-progress estimate queues them)."""
        self.calibration: PeerCalibrationSink | None = None
        """Hands out this instance's calibration observations and fits the peers' (`share_calibration`)."""
        if calibration is not None:
            self.share_calibration(calibration)
        self.load = load
        self.replicas = replicas
        """The fleet's replicas now (a reload changes them): reports about others do not count."""
        self.lookup = lookup
        self.limits = limits or ShareLimits()
        self.problems: Counter[str] = Counter()
        self.reports_folded = 0
        self.expired = 0
        self._seq = 0
        self._peers: dict[str, _Peer] = {}
        self._routed: list[RoutedPrefix] = []
        self._last: tuple[tuple[str, int, int, int], ...] | None = None
        self.notify: Callable[[], None] | None = None
        """The shell's wake-up, called on each change of this instance's own load (it must not block)."""
        self._sent: deque[tuple[int, float]] = deque(maxlen=ECHO_WINDOW)
        self._echoes: deque[float] = deque(maxlen=ECHO_WINDOW)

    def share_calibration(self, calibration: PeerCalibrationSink) -> None:
        """Reports carry `calibration`'s observations, and the peers' are fitted by it."""
        calibration.share_observations()
        self.calibration = calibration

    # -- RequestListener: each change of own load wakes the shell; the commit also marks the routed prefix -------

    def on_commit(self, routed: Routed) -> None:
        keys = routed.keys[: self.limits.prefix_blocks]
        if keys:
            self._routed.append(RoutedPrefix(str(routed.replica), _pack_keys(keys)))
        if self.notify is not None:
            self.notify()

    def on_first_token(self, routed: Routed, now: float) -> None:
        if self.notify is not None:
            self.notify()  # its prefill is done: pending prefill down, decoding up

    def on_served(self, routed: Routed, cached_tokens: int, now: float) -> None:
        return

    def on_finish(self, routed: Routed, now: float) -> None:
        if self.notify is not None:
            self.notify()

    # -- publishing -------------------------------------------------------------------------------------------

    def changed(self) -> bool:
        """Whether a report would say something the last one did not (counts moved, or prefixes were routed)."""
        return bool(self._routed) or self._counts() != self._last

    def due(self, now: float, last_sent: float, heartbeat_s: float) -> bool:
        """Whether a report should go out now: it would say something new, or the heartbeat is due."""
        return self.changed() or now - last_sent >= heartbeat_s

    def report(self, max_bytes: int | None = None, *, now: float | None = None) -> bytes:
        """The next report to publish (it takes the prefixes routed since the last one). With `max_bytes` (a
        datagram's limit) the newest prefixes that do not fit are left out: they are provisional hints, and the
        KV events bring the truth shortly after. With `now` (when it is sent) its echo measures the staleness."""
        counts = self._counts()
        self._last = counts
        self._seq += 1
        if now is not None:
            self._sent.append((self._seq, now))
        prefixes, self._routed = self._routed, []
        replicas = [ReplicaCounts(*entry) for entry in counts]
        samples = [] if self.calibration is None else [_sample(o) for o in self.calibration.take_observations()]
        payload = _encoder.encode(LoadReport(WIRE_VERSION, self.instance, self._seq, replicas, prefixes, samples))
        while max_bytes is not None and len(payload) > max_bytes and (prefixes or samples):
            # Prefixes go first (the KV events bring them anyway), then the oldest calibration samples.
            if prefixes:
                prefixes = prefixes[: len(prefixes) // 2]
            else:
                samples = samples[len(samples) // 2 + len(samples) % 2 :]
            payload = _encoder.encode(LoadReport(WIRE_VERSION, self.instance, self._seq, replicas, prefixes, samples))
        return payload

    def _counts(self) -> tuple[tuple[str, int, int, int], ...]:
        own = self.load.own()
        fleet = self.replicas()
        return tuple(
            (str(replica), load.in_flight, load.pending_prefill_tokens, load.decode_requests)
            for replica, load in sorted(own.items())
            if replica in fleet
        )

    # -- folding in ---------------------------------------------------------------------------------------------

    def receive(self, payload: bytes, now: float) -> bool:
        """Fold one peer report in; False (and counted) when it was refused. Never raises."""
        try:
            report = _decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
            self.problems["undecodable"] += 1
            return False
        if report.instance == self.instance:
            self._echoed(report.seq, now)
            return False
        fleet = set(self.replicas())
        reason = self._refusal(report, len(fleet))
        if reason is not None:
            self.problems[reason] += 1
            return False
        peer = self._peers.get(report.instance)
        if peer is not None and report.seq <= peer.seq:
            self.problems["stale"] += 1
            return False
        joined = peer is None
        self._peers[report.instance] = _Peer(report.seq, now)
        if joined:
            self._rank()
        reported = set()
        dispatched = 0
        for entry in report.replicas:
            replica = ReplicaName(entry.replica)
            if replica not in fleet:
                self.problems["unknown_replica"] += 1
                continue
            reported.add(replica)
            load = OwnLoad(entry.in_flight, entry.pending_prefill_tokens, entry.decode_requests)
            rise = self.load.fold_peer(report.instance, replica, load)
            dispatched += rise.requests
            if rise.prefill_tokens and self.progress is not None:
                pending = self.load.snapshot(replica).pending_prefill_tokens
                self.progress.peer_prefill(replica, rise.prefill_tokens, pending, now)
        for replica in fleet - reported:
            # A replica missing from a report carries nothing from that peer (it never routed there).
            self.load.fold_peer(report.instance, replica, OwnLoad(0, 0, 0))
        if self.lookup is not None:
            for prefix in report.prefixes:
                replica = ReplicaName(prefix.replica)
                if replica in fleet:
                    self.lookup.add_provisional(replica, _unpack_keys(prefix.keys), now)
        if self.calibration is not None and report.samples:
            shared = [_observation(sample) for sample in report.samples if sample.replica in fleet]
            self.problems["unknown_replica"] += len(report.samples) - len(shared)
            if shared:
                self.calibration.peer_observations(report.instance, shared)
        if self.blind_group is not None:
            self.blind_group.peer_dispatched(dispatched, now, ranked_after=report.instance > self.instance)
        self.reports_folded += 1
        return True

    def _echoed(self, seq: int, now: float) -> None:
        """Our own report `seq` came back through the channel at `now`: as late as it reaches the peers."""
        sent = self._sent
        while sent and sent[0][0] < seq:
            sent.popleft()  # lost on the way (or sent without a time)
        if not sent or sent[0][0] != seq:
            return
        self._echoes.append(max(0.0, now - sent.popleft()[1]))
        if self.blind_group is not None:
            horizon = 2 * max(self._echoes)
            if horizon != self.blind_group.config.horizon_s:
                self.blind_group.retune(horizon)

    @property
    def staleness_s(self) -> float | None:
        """How late a report reaches the peers: the largest of the last echo delays (None before the first)."""
        return max(self._echoes) if self._echoes else None

    def _refusal(self, report: LoadReport, fleet_size: int) -> str | None:
        limits = self.limits
        if report.version != WIRE_VERSION:
            return "version"
        if not report.instance or len(report.instance) > limits.max_instance_chars or report.seq < 0:
            return "bad_instance"
        if len(report.replicas) > 4 * fleet_size + 64:
            return "too_many_replicas"
        for entry in report.replicas:
            in_flight, pending, decoding = entry.in_flight, entry.pending_prefill_tokens, entry.decode_requests
            if min(in_flight, pending, decoding) < 0:
                return "negative"
            if in_flight > limits.max_in_flight or decoding > in_flight:
                return "absurd_requests"
            if pending > (in_flight - decoding) * limits.max_tokens_per_request:
                return "absurd_tokens"
        if len(report.prefixes) > limits.max_in_flight:
            return "absurd_prefixes"
        for prefix in report.prefixes:
            if len(prefix.keys) % 8 or len(prefix.keys) > 8 * limits.prefix_blocks:
                return "bad_prefix"
        if len(report.samples) > limits.max_in_flight:
            return "absurd_samples"
        most_work = float(limits.max_in_flight) * limits.max_tokens_per_request
        for sample in report.samples:
            values = (sample.work_tokens, sample.short, sample.passes, sample.decoding, sample.ttft_s, sample.weight)
            if not all(math.isfinite(value) for value in values):
                return "bad_sample"
            if not (
                0 <= sample.work_tokens <= most_work
                and 0 <= sample.short <= 1
                and 1 <= sample.passes <= most_work
                and 0 <= sample.decoding <= limits.max_in_flight
                and 0 <= sample.ttft_s <= limits.max_ttft_s
                and 0 < sample.weight <= limits.max_weight
            ):
                return "bad_sample"
        return None

    def expire(self, now: float) -> list[str]:
        """Drop the peers not heard from in `expiry_s`; returns who was dropped."""
        gone = [name for name, peer in self._peers.items() if now - peer.seen > self.limits.expiry_s]
        for name in gone:
            del self._peers[name]
            self.load.drop_peer(name)
            if self.calibration is not None:
                self.calibration.forget_peer(name)
        self.expired += len(gone)
        if gone:
            self._rank()
        return gone

    def _rank(self) -> None:
        """The blind group takes this instance's place among the live ones (sorted by name, alike everywhere)."""
        if self.blind_group is not None:
            names = sorted([*self._peers, self.instance])
            self.blind_group.rank_among(names.index(self.instance), len(names))

    def peers(self) -> list[str]:
        return sorted(self._peers)


__all__ = [
    "ECHO_WINDOW",
    "WIRE_VERSION",
    "CostSample",
    "LoadReport",
    "LoadShare",
    "PeerCalibrationSink",
    "PeerPrefillSink",
    "ReplicaCounts",
    "RoutedPrefix",
    "ShareLimits",
]
