"""Each replica's prefill rate as its engine's own /metrics histograms show it: a lower bound for kv_aware's costs.

vLLM (0.26 and 0.32 alike, `vllm/v1/metrics/stats.py`) observes, per request when it finishes,
`vllm:request_prefill_time_seconds` (first scheduled to first token: the passes that computed its prompt, any
preemption in between included) and `vllm:request_prefill_kv_computed_tokens` (the prompt tokens it computed,
cache hits excluded). Their `_sum`s and `_count`s are cumulative since the engine started, so the router reads
the engine's whole history at its first scrape and each later scrape adds an interval (the deltas).

What the ratio means. Σ computed tokens / Σ prefill seconds is the rate one request's prompt advanced at. Where
the engine ran one prefill at a time it is the engine's prefill throughput (less the decode work sharing those
passes, which kv_aware prices on top). Where a pass batches several prefills (several requests scheduled in one
pass, or a long prompt's chunks beside another's), their prefill seconds overlap and the ratio divides the rate by
how many were in prefill at once: it understates the rate under load, never overstates it (no request's tokens
advance faster than the engine computes). Both sums cover the same requests, so it does not matter that they
reach the exposition when a request finishes, long after its prefill; a rate per wall second between scrapes
would (a burst of requests finishing after long answers carries tokens computed minutes before), so none is
derived. The estimate is the ratio over the engine's history (until it slides out of the window) and the last
`window` intervals: a lower bound, tight at light load, loose by the number of prefills batched together under
load. So it is never taken as the replica's rate where the router has its own fit of the replica's TTFTs;
`CostCalibrator` uses it to replace the configured starting guess and to raise a borrowed estimate that lies
below it (`kvrouter.routing.calibration`).

The engine's pass duration is not exported (no histogram of pass time), so the fixed pass cost and the decode
cost per request are not derived here; `vllm:iteration_tokens_total` counts passes and their tokens, not time.

Bad input, each a named `Fallback` the caller counts and logs once per replica: `missing` (the exposition lacks
the two histograms: older vLLM, another engine), `invalid` (a value that is not a finite number, a negative token
sum, a count that is not whole, or a sum that went down while the count did not; the scrape's interval is
skipped), `reset` (the count went down: the engine restarted, perhaps on other hardware; the history and window
restart from the new totals). A replica without a rate (too few prefills yet, missing histograms, right after a
reset) keeps the router-only view. Pure and synchronous, no clock.

Knobs (`EngineRateConfig`): `window` [120 intervals: two minutes of scrapes at the default 1 s], `min_requests`
[4: prefills behind a figure].
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field

from kvrouter.typedefs import ReplicaName

PREFILL_SECONDS = "vllm:request_prefill_time_seconds"
COMPUTED_TOKENS = "vllm:request_prefill_kv_computed_tokens"
MAX_RATE = 1e8
"""Tokens/s beyond any accelerator: a figure above it is garbage."""


class Fallback(enum.Enum):
    MISSING = "missing"
    INVALID = "invalid"
    RESET = "reset"


@dataclass(frozen=True, slots=True)
class EngineTotals:
    """Cumulative prefill totals from one scrape, summed over the exposition's engine series."""

    prefill_s: float
    prefill_requests: float
    computed_tokens: float


def parse_engine_totals(text: str) -> EngineTotals | Fallback:
    """The three totals from vLLM's Prometheus text, or why not (a line scan, like the gauges' parser)."""
    wanted = {
        f"{PREFILL_SECONDS}_sum": 0,
        f"{PREFILL_SECONDS}_count": 1,
        f"{COMPUTED_TOKENS}_sum": 2,
    }
    totals = [0.0, 0.0, 0.0]
    seen = [False, False, False]
    for line in text.splitlines():
        if not line.startswith("vllm:request_prefill_"):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end < 0:
            continue
        slot = wanted.get(line[:name_end])
        if slot is None:
            continue
        rest = line[line.rfind("}") + 1 :] if line[name_end] == "{" else line[name_end:]
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            return Fallback.INVALID
        # A prefill-time sum may go negative for good: vLLM observes a request the engine aborted before its first
        # token with 0 - its scheduling time. The deltas after it still hold, so only the estimator judges it.
        if not math.isfinite(value) or (value < 0 and slot != 0):
            return Fallback.INVALID
        totals[slot] += value
        seen[slot] = True
    if not all(seen):
        return Fallback.MISSING
    if totals[1] != int(totals[1]):
        return Fallback.INVALID
    return EngineTotals(*totals)


@dataclass(frozen=True, slots=True)
class EngineRateConfig:
    window: int = 120
    min_requests: int = 4

    def __post_init__(self) -> None:
        if self.window < 1 or self.min_requests < 1:
            raise ValueError("window and min_requests must be >= 1")


@dataclass(slots=True)
class _Engine:
    last: EngineTotals | None = None
    intervals: deque[EngineTotals] = field(default_factory=deque)
    """The history before the first scrape, then each scrape's deltas."""
    rate: float | None = None


@dataclass(slots=True)
class EngineRates:
    """Per replica, the prefill rate its engine's histograms prove it at least has (see the module docstring)."""

    config: EngineRateConfig = field(default_factory=EngineRateConfig)
    _engines: dict[ReplicaName, _Engine] = field(default_factory=dict)

    def observe(self, replica: ReplicaName, scraped: EngineTotals | Fallback) -> Fallback | None:
        """One scrape's totals (or the parser's fallback); returns the fallback this scrape caused, if any."""
        engine = self._engines.get(replica)
        if engine is None:
            engine = self._engines[replica] = _Engine(intervals=deque(maxlen=self.config.window + 1))
        if isinstance(scraped, Fallback):
            if scraped is Fallback.MISSING:
                # Not this engine's metrics (any more): the router's own view alone.
                engine.last, engine.rate = None, None
                engine.intervals.clear()
            return scraped
        last = engine.last
        fallback = None
        if last is not None and scraped.prefill_requests < last.prefill_requests:
            fallback, last = Fallback.RESET, None
            engine.intervals.clear()
            engine.rate = None
        elif last is not None and (
            scraped.prefill_s < last.prefill_s or scraped.computed_tokens < last.computed_tokens
        ):
            # More requests but less time or fewer tokens: an observation that took some away (vLLM records a
            # request aborted by the engine before its first token with a negative prefill time). The interval is
            # dropped; the next one is measured from here.
            engine.last = scraped
            return Fallback.INVALID
        if last is None:
            engine.last = scraped
            if scraped.prefill_s < 0:
                return fallback or Fallback.INVALID  # a history with such an abort in it: only deltas from here
            engine.intervals.append(scraped)  # the engine's history since it started
        else:
            engine.intervals.append(
                EngineTotals(
                    scraped.prefill_s - last.prefill_s,
                    scraped.prefill_requests - last.prefill_requests,
                    scraped.computed_tokens - last.computed_tokens,
                )
            )
        engine.last = scraped
        engine.rate = self._estimate(engine.intervals)
        return fallback

    def _estimate(self, intervals: deque[EngineTotals]) -> float | None:
        tokens = sum(i.computed_tokens for i in intervals)
        prefill_s = sum(i.prefill_s for i in intervals)
        requests = sum(i.prefill_requests for i in intervals)
        if requests < self.config.min_requests or tokens <= 0 or prefill_s <= 0:
            return None
        rate = tokens / prefill_s
        return rate if rate <= MAX_RATE else None

    def rate(self, replica: ReplicaName) -> float | None:
        engine = self._engines.get(replica)
        return None if engine is None else engine.rate

    def rates(self) -> dict[ReplicaName, float]:
        return {name: engine.rate for name, engine in self._engines.items() if engine.rate is not None}

    def forget(self, replica: ReplicaName) -> None:
        self._engines.pop(replica, None)


__all__ = ["EngineRateConfig", "EngineRates", "EngineTotals", "Fallback", "parse_engine_totals"]
