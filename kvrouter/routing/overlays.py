"""The learning overlays, built in one place for the live router and the replay alike.

`build_overlays` wraps the prefix index in what the settings ask for and says who must hear what:

- `kv_survival`: `SurvivalLookup` (kvrouter/routing/survival.py) trims matches to blocks likely to survive the wait; it
  reads the `LoadBook` and hears the event path (stores, removals, clears).
- `kv_feedback`: `FeedbackLookup` (kvrouter/routing/feedback.py), outermost, corrects matches with the engines' reported
  cache hits; it hears each request's `served` report and the event path (stores, clears).
- `kv_lost_hits`: `LostHitWatch` (kvrouter/routing/lost_hits.py) gives a predicted hit the engine evicted before
  admitting its request back to that request's pending prefill in the `LoadBook`; it hears each request's commit,
  first token and finish, and the event path (removals, clears).
- `kv_tune` lives in the kv_aware policy (kvrouter/routing/tuning.py); the lifecycle hands it every first token through
  `Policy.first_token`, so it needs nothing here.

The caller hands `lookup` to the `Router`, `request_listeners` to the `Router` too, and `event_listeners` to its
event path (`IndexIngest`, `RedisFollower`, the replay driver) and to whatever learns that a replica's cache is
gone (a replica removed or unreachable). Knobs: `kv_feedback`, `kv_survival`, `kv_lost_hits`, and
`kv_prefill_tokens_per_s` (survival's wait estimate uses kv_aware's prefill rate).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrouter.config import Settings
from kvrouter.routing.feedback import FeedbackLookup
from kvrouter.routing.lifecycle import EventListener, RequestListener
from kvrouter.routing.load import LoadBook
from kvrouter.routing.lost_hits import LostHitWatch
from kvrouter.routing.router import PrefixLookup
from kvrouter.routing.survival import SurvivalConfig, SurvivalLookup


@dataclass(slots=True)
class Overlays:
    lookup: PrefixLookup
    """What the router asks (the index, wrapped by the overlays turned on)."""
    request_listeners: list[RequestListener] = field(default_factory=list)
    event_listeners: list[EventListener] = field(default_factory=list)
    feedback: FeedbackLookup | None = None
    survival: SurvivalLookup | None = None
    lost_hits: LostHitWatch | None = None


def build_overlays(
    index: PrefixLookup,
    load: LoadBook,
    *,
    feedback: bool = False,
    survival: bool = False,
    lost_hits: bool = False,
    prefill_tokens_per_s: float = 48_000.0,
) -> Overlays:
    overlays = Overlays(index)
    if survival:
        overlays.survival = SurvivalLookup(index, load, SurvivalConfig(prefill_tokens_per_s=prefill_tokens_per_s))
        overlays.lookup = overlays.survival
        overlays.event_listeners.append(overlays.survival)
    if feedback:
        overlays.feedback = FeedbackLookup(overlays.lookup)
        overlays.lookup = overlays.feedback
        overlays.request_listeners.append(overlays.feedback)
        overlays.event_listeners.append(overlays.feedback)
    if lost_hits:
        overlays.lost_hits = LostHitWatch()
        overlays.request_listeners.append(overlays.lost_hits)
        overlays.event_listeners.append(overlays.lost_hits)
    return overlays


def overlays_from_settings(settings: Settings, index: PrefixLookup, load: LoadBook) -> Overlays:
    return build_overlays(
        index,
        load,
        feedback=settings.kv_feedback,
        survival=settings.kv_survival,
        lost_hits=settings.kv_lost_hits,
        prefill_tokens_per_s=settings.kv_prefill_tokens_per_s,
    )


__all__ = ["Overlays", "build_overlays", "overlays_from_settings"]
