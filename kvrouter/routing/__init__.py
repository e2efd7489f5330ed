"""Routing: from a request's token ids to a replica, and what happens to the request after the decision.

* `router.py` — `Router`: facts (exact token ids) -> candidates (prefix index + load) -> the policy's decision ->
  commit (provisional index entries, load ticket) -> a `Routed` handle. The policies themselves are in
  `kvrouter/policies/`; the prefix index in `kvrouter/index.py`.
* `lifecycle.py` — `Routed` (`first_token`, `served`, `finish`) and the listener protocols the overlays hear.
* `load.py` — `LoadBook`: the router's own in-flight / pending-prefill / decoding accounting plus engine gauges.
* `overlays.py` — `build_overlays`: the one place the learning overlays are built from settings (live and replay).
* `feedback.py`, `survival.py`, `tuning.py` — the learning overlays: engine-reported cache hits (`kv_feedback`),
  block survival (`kv_survival`), kv_aware's weight tuner (`kv_tune`).
* `replication.py` — warm-up planners (hot-prefix replication, drain with warm-up); replay only.

Pure and synchronous throughout: the caller's clock, no I/O, so the live proxy and the virtual-time replay drive
the same objects. The main names are re-exported here.
"""

from kvrouter.routing.router import PrefixLookup, PrefixMatch, PromptTokenizer, Route, Router, RoutingFacts

__all__ = ["PrefixLookup", "PrefixMatch", "PromptTokenizer", "Route", "Router", "RoutingFacts"]
