"""Several router instances in one replay: each with its own prefix index, load book, policy and overlays.

This is `kvrouter replay --routers K`: K routers in front of one fleet, as K pods behind a Service. Every
instance's index follows the same KV events (the event plane is shared, directly or through Redis), but each
counts only the load it routed itself, unless load is shared: then each change of an instance's own counts on
a replica (a request routed, its first token, its end) reaches every other instance `delay_s` later, as the
live load plane (`kvrouter.redisplane.loadplane`) delivers it, and so do the provisional prefixes it marked when
routing; a rise of its pending prefill tokens reaches the other instances' policies as its dispatches
(`kvrouter.routing.sharing.PeerPrefillSink`), as live. Arrivals are spread over the instances round-robin, or at
random from `seed` (a plain load balancer). With a share delay, each instance decides through a `BlindGroup`
(`kvrouter.routing.herding`, as a live router with shared load does) whose horizon is the delay and whose random
source is seeded from `seed` and the instance's number, its rank the instance's number, and which waits its rank
times the delay before deciding (the stagger: a burst is decided in rank order, each instance seeing the earlier
ones); `blind_group` `nostagger` takes ranked places without waiting, `random` takes random places (no rank, no
wait), `off` leaves the blind group out (the plain policy: the herd, for comparison). With `share_calibration`,
each report also carries the calibration observations its instance made since the last one, which the others'
policies fit beside their own (`kvrouter.routing.sharing.PeerCalibrationSink`, as live with
`load_share_calibration`; off, the default: each instance fits only what it routed).

Knobs (`RouterSpread`): `routers` (K), `spread` (`round_robin` | `random`), `seed`, `share_delay_s` (None: no
sharing; 0: instant), `blind_group`, `share_calibration`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvrouter.index import PrefixIndex
from kvrouter.routing.calibration import SharedObservation
from kvrouter.routing.feedback import FeedbackLookup
from kvrouter.routing.herding import STAGGER_MAX_S, BlindGroupConfig
from kvrouter.routing.lifecycle import EventListener
from kvrouter.routing.load import LoadBook, OwnLoad
from kvrouter.routing.router import Router
from kvrouter.routing.sharing import PeerCalibrationSink, PeerPrefillSink
from kvrouter.routing.survival import SurvivalLookup
from kvrouter.typedefs import BlockKey, ReplicaName

SPREADS = ("round_robin", "random")
BLIND_GROUPS = ("on", "nostagger", "random", "off")


@dataclass(frozen=True, slots=True)
class RouterSpread:
    routers: int = 1
    spread: str = "round_robin"
    seed: int = 0
    share_delay_s: float | None = 0.0
    """Seconds before an instance's load change reaches the others; None: load is not shared at all."""
    blind_group: str = "on"
    """With a share delay: decide through `kvrouter.routing.herding.BlindGroup` (`on`: ranked places and the
    stagger, `nostagger`: ranked places without it, `random`: random places) or not (`off`: the plain policy)."""
    share_calibration: bool = False
    """With shared load: the instances hand each other their calibration observations (live:
    `load_share_calibration`)."""

    def blind_group_config(self) -> BlindGroupConfig | None:
        """What each instance's `BlindGroup` is built from; None when there is none (one router, no sharing,
        instant sharing, or turned off)."""
        delay = self.share_delay_s
        if self.routers == 1 or self.blind_group == "off" or delay is None or delay == 0:
            return None
        return BlindGroupConfig(
            horizon_s=delay,
            ranked=self.blind_group in ("on", "nostagger"),
            stagger_max_s=STAGGER_MAX_S if self.blind_group == "on" else 0.0,
        )

    def __post_init__(self) -> None:
        if self.routers < 1:
            raise ValueError("routers must be at least 1")
        if self.spread not in SPREADS:
            raise ValueError(f"spread must be one of {', '.join(SPREADS)}, got {self.spread!r}")
        if self.share_delay_s is not None and self.share_delay_s < 0:
            raise ValueError("share_delay_s must not be negative")
        if self.blind_group not in BLIND_GROUPS:
            raise ValueError(f"blind_group must be one of {', '.join(BLIND_GROUPS)}, got {self.blind_group!r}")


@dataclass(slots=True)
class RouterInstance:
    """One router of the replay: the objects a live router process would hold."""

    name: str
    index: PrefixIndex
    load: LoadBook
    router: Router
    event_listeners: list[EventListener]
    survival: SurvivalLookup | None = None
    feedback: FeedbackLookup | None = None
    routed: int = 0
    """Requests this instance took."""


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What one instance tells the others: its own counts on one replica, or a prefix it just routed there."""

    source: int
    replica: ReplicaName
    load: OwnLoad | None = None
    keys: tuple[BlockKey, ...] = ()
    observations: tuple[SharedObservation, ...] = ()


class Spreader:
    """Which instance takes each arrival (pure; deterministic from the seed)."""

    def __init__(self, spread: RouterSpread) -> None:
        self.spread = spread
        self._random = random.Random(spread.seed)
        self._turn = 0

    def pick(self) -> int:
        count = self.spread.routers
        if count == 1:
            return 0
        if self.spread.spread == "random":
            return self._random.randrange(count)
        self._turn += 1
        return (self._turn - 1) % count


def deliver(instances: list[RouterInstance], report: LoadReport, now: float) -> None:
    """`report` reaches every instance but its source."""
    for number, instance in enumerate(instances):
        if number == report.source:
            continue
        if report.load is not None:
            rise = instance.load.fold_peer(instances[report.source].name, report.replica, report.load)
            blind_group = instance.router.blind_group
            if blind_group is not None:
                blind_group.peer_dispatched(rise.requests, now, ranked_after=report.source > number)
            policy = instance.router.policy
            if rise.prefill_tokens and isinstance(policy, PeerPrefillSink):
                pending = instance.load.snapshot(report.replica).pending_prefill_tokens
                policy.peer_prefill(report.replica, rise.prefill_tokens, pending, now)
        if report.keys and instance.router.index is not None:
            instance.router.index.add_provisional(report.replica, report.keys, now)
        if report.observations and isinstance(instance.router.policy, PeerCalibrationSink):
            instance.router.policy.peer_observations(instances[report.source].name, report.observations)


__all__ = ["BLIND_GROUPS", "SPREADS", "LoadReport", "RouterInstance", "RouterSpread", "Spreader", "deliver"]
