"""Per-replica cost calibration: learn each replica's prefill rate and pass costs from the TTFTs it delivers.

kv_aware prices a replica with three numbers (`ReplicaCosts`): its prefill throughput (uncached prompt tokens per
second through full passes, each pass's fixed cost included), the fixed cost of one engine pass, and the extra pass
time per request decoding there. A fleet of another
model, another GPU or two GPU generations has other numbers, so `CostCalibrator` learns them per replica from what
the router sees of every request it routed: at dispatch, the prefill work ahead of and including the request
(queued tokens + its own uncached tokens), the engine passes that work takes and the requests decoding there; at
its first token, the measured TTFT. The model is the policy's own estimate,

    ttft = work / prefill_tokens_per_s + short * pass_s + passes * decoding * decode_s_per_request,

where short = max(0, 1 - work / batch_tokens) is the part of a single pass the work leaves empty (a short request
still pays a whole pass's fixed cost; long work pays it inside the throughput). It is linear in (pass_s,
decode_s_per_request, 1 / prefill_tokens_per_s), and every coefficient shows in its own kind of request (short
ones, ones behind busy decoders, long ones), so each replica keeps a window of its last
`window` observations and refits them every `refit_every` new ones by least absolute deviations (iteratively
reweighted least squares): the fit follows the median request, so a preempted request that waited seconds, a cold
start's first slow passes or a request whose cache was evicted under it move it as much as any other single
sample and no more. Coefficients stay non-negative and inside physical bounds; a fit that comes out singular or
non-finite keeps the last estimate (counted in `rejected_fits`).

Start and convergence: until a replica has `min_samples` observations it is priced like its calibrated peers (the
median of their fits, the prefill rate per unit of replicas.yaml weight); before any replica has a fit, with a
fit of the whole fleet's observations pooled (ready after `min_samples` requests in all, so N replicas get a first
estimate N times sooner), and before even that with the starting estimates (`kv_prefill_tokens_per_s` x the
replica's weight, `kv_decode_pass_s`, `kv_decode_s_per_request`); after that with its own fit. Each refit is
pulled toward the previous estimate with the strength of `prior_samples` observations, which keeps a coefficient
steady while the window holds no request that shows it (no short request, nothing decoding); the starting values
fade out at the first refits. The window makes it follow a replica that restarts on other hardware within
`window` requests. `forget` drops a replica.

The engines' own /metrics are a second, weaker source for the prefill rate (`set_engine_rate`, fed from
`kvrouter.routing.engine_rates`): vLLM's per-request prefill-time and computed-token histograms give a rate the
replica has at least (their sums overlap where a pass batches several prefills, so the ratio understates the rate
under load; it never overstates it). A lower bound is weighted as one: it never overrides the replica's own fit
(the router's view, TTFT against the work it routed, prices exactly what the estimate predicts, on any engine);
before that fit it replaces the configured starting guess (the replica's own history beats a guess made without
it: a router that starts in front of a warm fleet prices each replica from its engine's history at the first
scrapes) and raises a borrowed estimate (its peers' median, the pooled fit) that lies below it. It also feeds the
first fit's prior through those values. No pass duration is exported, so the pass and decode costs have no
engine source. Every `ReplicaCosts` names where its values came from (`source`, `rate_source`: fit, peers, fleet,
start, engine).

Several router instances in front of one fleet (kvrouter/routing/sharing.py) each see a share of the requests:
they hand each other their observations, which `observe` takes with the peer's name as `source`, so every
instance fits the fleet's whole history as one router would. `forget_source` drops a peer's observations when its
reports stop (and refits what they were part of), so a peer that vanished, or lied, shapes no estimate after it.

Pure and synchronous; no clock (observations carry their TTFT). Knobs (`CalibrationConfig`): `window` [256],
`min_samples` [24], `refit_every` [16], `prior_samples` [1], `iterations` [10].

The refit runs on the request path (every `refit_every` first tokens per replica), so its numeric core is in C
(`kvrouter/_costfit.c`) when that extension was built: the same double operations in the same order as
`python_fit_costs`, which stays here as the reference and the fallback, so the fits are bit for bit the same
(tests/test_costfit_native.py). The backend is chosen once, at import: `KVROUTER_PYTHON_COSTFIT=1` in the
environment forces the Python fit (to measure against it).
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

from kvrouter.typedefs import ReplicaName

_MIN_RATE, _MAX_RATE = 100.0, 1e8
"""Prefill tokens/s a fit may claim: from a CPU toy to far beyond any accelerator."""
_MAX_PASS_S = 2.0
_MAX_PER_REQUEST_S = 0.1
PYTHON_FIT_ENV = "KVROUTER_PYTHON_COSTFIT"
"""Set (to anything but 0 or empty) in the environment at import: the refit runs in Python even if C is built."""


class _NativeFit(Protocol):
    def __call__(
        self,
        observations: Sequence[Observation],
        pass_s: float,
        decode_s_per_request: float,
        prefill_tokens_per_s: float,
        prior_samples: float,
        iterations: int,
        /,
    ) -> tuple[float, float, float] | Literal[False] | None: ...


def _load_native_fit() -> _NativeFit | None:
    if os.environ.get(PYTHON_FIT_ENV, "") not in ("", "0"):
        return None
    try:  # absent when the extension was not built
        from kvrouter._costfit import fit
    except ImportError:
        return None
    return fit


@dataclass(frozen=True, slots=True)
class ReplicaCosts:
    """What one replica's work costs, as kv_aware prices it."""

    prefill_tokens_per_s: float
    pass_s: float
    """Fixed cost of one engine pass."""
    decode_s_per_request: float
    """Extra pass time per request decoding on the replica."""
    samples: int = 0
    """Observations behind these values (0: the starting estimate)."""
    source: str = "start"
    """Where the pass and decode costs come from: fit (the replica's own), peers, fleet (pooled), start, pinned."""
    rate_source: str = "start"
    """Where the prefill rate comes from: as `source`, or engine (its /metrics lower bound raised or replaced it)."""


@dataclass(frozen=True, slots=True)
class Observation:
    """One request's dispatch-time picture and its measured time to first token."""

    work_tokens: float
    """Prefill tokens ahead of the request on its replica plus its own uncached tokens."""
    short: float
    """max(0, 1 - work_tokens / batch_tokens): the part of one pass the work leaves empty."""
    passes: float
    decoding: float
    """Requests decoding on the replica when it was dispatched."""
    ttft_s: float


@dataclass(frozen=True, slots=True)
class SharedObservation:
    """One observation as a router instance hands it to its peers (kvrouter/routing/sharing.py): the replica it
    was made on and that replica's replicas.yaml weight with it."""

    replica: ReplicaName
    observation: Observation
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class CalibrationConfig:
    window: int = 256
    min_samples: int = 24
    refit_every: int = 16
    prior_samples: float = 1.0
    iterations: int = 10

    def __post_init__(self) -> None:
        if self.window < 3 or not 3 <= self.min_samples <= self.window or self.refit_every < 1:
            raise ValueError("window >= 3, 3 <= min_samples <= window, refit_every >= 1")
        if self.prior_samples < 0 or self.iterations < 1:
            raise ValueError("prior_samples >= 0 and iterations >= 1")


@dataclass(slots=True)
class _Replica:
    observations: deque[Observation]
    sources: deque[str | None]
    """Beside each observation, the peer instance it came from (None: this instance's own)."""
    costs: ReplicaCosts | None = None
    """The last accepted fit; None until there is one."""
    since_fit: int = 0
    seen: int = 0
    weight: float = 1.0


@dataclass(slots=True)
class CostCalibrator:
    """Per-replica `ReplicaCosts`, from a starting estimate to a fit of the replica's own observations."""

    start: ReplicaCosts
    config: CalibrationConfig = field(default_factory=CalibrationConfig)
    rejected_fits: int = 0
    _replicas: dict[ReplicaName, _Replica] = field(default_factory=dict)
    _fleet: _Replica | None = None
    """Every replica's observations pooled (work per unit of weight): the first fit, before any replica has its own."""
    _engine_rates: dict[ReplicaName, float] = field(default_factory=dict)
    """Per replica, the prefill rate its engine's /metrics prove it at least has (`set_engine_rate`)."""

    def costs(self, replica: ReplicaName, weight: float = 1.0) -> ReplicaCosts:
        """The replica's current costs: its own fit, else its peers' (median), else the fleet's pooled fit, else
        the start; `weight` (replicas.yaml) scales the borrowed prefill rate only. Short of its own fit, the
        engine's lower bound (`set_engine_rate`) replaces the start's rate and raises a borrowed one below it."""
        state = self._replicas.get(replica)
        if state is not None and state.costs is not None:
            return state.costs
        borrowed = self._borrowed(weight)
        engine = self._engine_rates.get(replica)
        if engine is None or (borrowed.source != "start" and engine <= borrowed.prefill_tokens_per_s):
            return borrowed
        return replace(borrowed, prefill_tokens_per_s=engine, rate_source="engine")

    def _borrowed(self, weight: float) -> ReplicaCosts:
        fitted = [(other.costs, other.weight) for other in self._replicas.values() if other.costs is not None]
        if fitted:
            # Like its peers until it shows otherwise: a pessimistic start would keep a new replica idle.
            return ReplicaCosts(
                _median([c.prefill_tokens_per_s / w for c, w in fitted]) * weight,
                _median([c.pass_s for c, _ in fitted]),
                _median([c.decode_s_per_request for c, _ in fitted]),
                source="peers",
                rate_source="peers",
            )
        pooled = self._fleet.costs if self._fleet is not None else None
        base = self.start if pooled is None else pooled
        if weight == 1.0 and pooled is None:
            return base
        source = "start" if pooled is None else "fleet"
        return ReplicaCosts(
            base.prefill_tokens_per_s * weight,
            base.pass_s,
            base.decode_s_per_request,
            source=source,
            rate_source=source,
        )

    def set_engine_rate(self, replica: ReplicaName, rate: float | None) -> None:
        """The replica's engine-side lower bound on its prefill rate (None: the engine shows none, or no longer)."""
        if rate is None or not math.isfinite(rate) or rate <= 0:
            self._engine_rates.pop(replica, None)
        else:
            self._engine_rates[replica] = min(_MAX_RATE, max(_MIN_RATE, rate))

    def engine_rates(self) -> dict[ReplicaName, float]:
        return dict(self._engine_rates)

    def replicas(self) -> list[ReplicaName]:
        return list(self._replicas)

    def observe(
        self, replica: ReplicaName, observation: Observation, weight: float = 1.0, source: str | None = None
    ) -> None:
        """One request's observation on `replica`: this instance's own (`source` None) or a peer instance's."""
        if not (math.isfinite(observation.ttft_s) and observation.ttft_s >= 0 and observation.passes > 0):
            return
        if weight <= 0 or not math.isfinite(weight):
            weight = 1.0
        state = self._replicas.get(replica)
        if state is None:
            state = self._replicas[replica] = self._empty()
        state.weight = weight
        self._add(state, observation, source, lambda: self.costs(replica, weight))
        if not any(other.costs is not None for other in self._replicas.values()):
            # Until one replica has its own fit, the fleet's pooled observations give the first estimate sooner.
            fleet = self._fleet
            if fleet is None:
                fleet = self._fleet = self._empty()
            per_weight = replace(observation, work_tokens=observation.work_tokens / weight)
            self._add(fleet, per_weight, source, lambda: self._fleet_prior())

    def held_from(self, source: str | None) -> int:
        """Observations in the replicas' windows that came from `source` (None: this instance's own)."""
        return sum(state.sources.count(source) for state in self._replicas.values())

    def forget_source(self, source: str) -> None:
        """Drop every observation a peer instance handed over (its reports stopped): each window it was part of
        is refitted on what remains, or goes back to borrowing while that is under `min_samples`."""
        for replica, state in self._replicas.items():
            if source in state.sources:
                self._drop(state, source)
                # Pulled toward what the replica would borrow now, not toward its own fit with the peer's share in it.
                self._refit(state, self.costs(replica, state.weight))
        fleet = self._fleet
        if fleet is not None and source in fleet.sources:
            self._drop(fleet, source)
            self._refit(fleet, self.start)

    def _drop(self, state: _Replica, source: str) -> None:
        """Take `source`'s observations out of `state`'s window, and its fit with them."""
        kept = [(o, s) for o, s in zip(state.observations, state.sources, strict=True) if s != source]
        state.seen -= len(state.observations) - len(kept)
        state.observations = deque((o for o, _ in kept), maxlen=self.config.window)
        state.sources = deque((s for _, s in kept), maxlen=self.config.window)
        state.costs = None

    def _empty(self) -> _Replica:
        return _Replica(deque(maxlen=self.config.window), deque(maxlen=self.config.window))

    def _fleet_prior(self) -> ReplicaCosts:
        fleet = self._fleet
        return fleet.costs if fleet is not None and fleet.costs is not None else self.start

    def _add(
        self, state: _Replica, observation: Observation, source: str | None, prior: Callable[[], ReplicaCosts]
    ) -> None:
        state.observations.append(observation)
        state.sources.append(source)
        state.seen += 1
        state.since_fit += 1
        if len(state.observations) >= self.config.min_samples and (
            state.costs is None or state.since_fit >= self.config.refit_every
        ):
            self._refit(state, prior())

    def _refit(self, state: _Replica, prior: ReplicaCosts) -> None:
        """Fit `state`'s window (once it holds `min_samples`); a failed fit keeps the last estimate."""
        state.since_fit = 0
        if len(state.observations) < self.config.min_samples:
            return
        fitted = fit_costs(state.observations, prior, self.config)
        if fitted is None:
            self.rejected_fits += 1
            return
        state.costs = ReplicaCosts(
            fitted.prefill_tokens_per_s,
            fitted.pass_s,
            fitted.decode_s_per_request,
            state.seen,
            source="fit",
            rate_source="fit",
        )

    def forget(self, replica: ReplicaName) -> None:
        self._replicas.pop(replica, None)
        self._engine_rates.pop(replica, None)


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def fit_costs(
    observations: Sequence[Observation], prior: ReplicaCosts, config: CalibrationConfig | None = None
) -> ReplicaCosts | None:
    """Least-absolute-deviation fit of the TTFT model to `observations`, pulled toward `prior`; None if it fails.

    In C when the extension was built (bit for bit `python_fit_costs`); in Python for what C declines (inputs
    that are not plain floats, a NaN TTFT, anything on which the Python fit raises)."""
    config = config or CalibrationConfig()
    if _native_fit is not None:
        fitted = _native_fit(
            observations,
            prior.pass_s,
            prior.decode_s_per_request,
            prior.prefill_tokens_per_s,
            config.prior_samples,
            config.iterations,
        )
        if fitted is None:
            return None
        if fitted is not False:
            rate, pass_s, per_request = fitted
            return ReplicaCosts(rate, pass_s, per_request, len(observations))
    return python_fit_costs(observations, prior, config)


def native_cost_fit() -> bool:
    """Whether `fit_costs` runs in C (built, and not forced to Python by `KVROUTER_PYTHON_COSTFIT`)."""
    return _native_fit is not None


def python_fit_costs(
    observations: Sequence[Observation], prior: ReplicaCosts, config: CalibrationConfig | None = None
) -> ReplicaCosts | None:
    """`fit_costs` in Python: the reference `kvrouter/_costfit.c` matches bit for bit, and its fallback."""
    config = config or CalibrationConfig()
    rows = [(o.short, o.passes * o.decoding, o.work_tokens) for o in observations]
    targets = [o.ttft_s for o in observations]
    count = len(rows)
    if count < 3:
        return None
    prior_beta = [prior.pass_s, prior.decode_s_per_request, 1.0 / prior.prefill_tokens_per_s]
    # Columns differ by orders of magnitude (passes ~1-20, tokens ~1e3-1e5): scale each to unit mean square.
    scales = [math.sqrt(sum(row[j] ** 2 for row in rows) / count) or 1.0 for j in range(3)]
    scaled = [[row[j] / scales[j] for j in range(3)] for row in rows]
    prior_scaled = [prior_beta[j] * scales[j] for j in range(3)]
    typical = sorted(targets)[count // 2]
    floor = max(1e-4, 1e-3 * typical)
    # The prior enters as one pseudo-observation per coefficient (that coefficient's column at its typical size),
    # counted `prior_samples` times and reweighted like the rest: an absolute-deviation pull toward it.
    multiplicity = [1.0] * count
    if config.prior_samples > 0:
        for j in range(3):
            scaled.append([1.0 if k == j else 0.0 for k in range(3)])
            targets.append(prior_scaled[j])
            multiplicity.append(config.prior_samples)
    columns = ([x[0] for x in scaled], [x[1] for x in scaled], [x[2] for x in scaled])
    beta = prior_scaled
    weights = multiplicity  # the first pass is plain least squares; then each residual reweights its row
    for _ in range(config.iterations):
        solved = _solve_nonnegative(columns, targets, weights)
        if solved is None:
            return None
        beta = solved
        b0, b1, b2 = beta
        # Each row's weight is multiplicity / max(|residual|, floor). The residual is y - sum() of the three terms,
        # as it always was computed (the same float on every Python), and `floor if floor > a else a` is max().
        weights = [
            m / (floor if floor > (a := abs(y - sum((x0 * b0, x1 * b1, x2 * b2)))) else a)
            for x0, x1, x2, y, m in zip(*columns, targets, multiplicity, strict=True)
        ]
    pass_s, per_request, per_token = (beta[j] / scales[j] for j in range(3))
    if not all(math.isfinite(value) for value in (pass_s, per_request, per_token)):
        return None
    rate = _MAX_RATE if per_token <= 1.0 / _MAX_RATE else min(_MAX_RATE, max(_MIN_RATE, 1.0 / per_token))
    return ReplicaCosts(rate, min(_MAX_PASS_S, pass_s), min(_MAX_PER_REQUEST_S, per_request), count)


def _solve_nonnegative(
    columns: tuple[Sequence[float], Sequence[float], Sequence[float]],
    targets: Sequence[float],
    weights: Sequence[float],
) -> list[float] | None:
    """Weighted least squares with coefficients >= 0 (a negative one is pinned at 0 and the rest refit)."""
    free = [0, 1, 2]
    while free:
        matrix, vector = _normal_equations(columns, targets, weights, free)
        solution = _gauss(matrix, vector)
        if solution is None:
            return None
        negative = [j for j, value in zip(free, solution, strict=True) if value < 0]
        if not negative:
            beta = [0.0, 0.0, 0.0]
            for j, value in zip(free, solution, strict=True):
                beta[j] = value
            return beta
        free = [j for j in free if j not in negative]
    return [0.0, 0.0, 0.0]


def _normal_equations(
    columns: tuple[Sequence[float], Sequence[float], Sequence[float]],
    targets: Sequence[float],
    weights: Sequence[float],
    free: list[int],
) -> tuple[list[list[float]], list[float]]:
    """X'WX and X'Wy over the `free` columns, each entry summed row by row in row order. The three-column case
    (every fit's first solve, usually its only one) is unrolled: a refit runs it `iterations` times per 16 requests,
    on the request path, and the unrolled sums are the same float operations in the same order."""
    if free == [0, 1, 2]:
        v0 = v1 = v2 = m00 = m01 = m02 = m10 = m11 = m12 = m20 = m21 = m22 = 0.0
        for x0, x1, x2, y, w in zip(*columns, targets, weights, strict=True):
            a0 = w * x0
            a1 = w * x1
            a2 = w * x2
            v0 += a0 * y
            v1 += a1 * y
            v2 += a2 * y
            m00 += a0 * x0
            m01 += a0 * x1
            m02 += a0 * x2
            m10 += a1 * x0
            m11 += a1 * x1
            m12 += a1 * x2
            m20 += a2 * x0
            m21 += a2 * x1
            m22 += a2 * x2
        return [[m00, m01, m02], [m10, m11, m12], [m20, m21, m22]], [v0, v1, v2]
    size = len(free)
    matrix = [[0.0] * size for _ in range(size)]
    vector = [0.0] * size
    picked = [columns[j] for j in free]
    for i, (y, w) in enumerate(zip(targets, weights, strict=True)):
        for a in range(size):
            wx = w * picked[a][i]
            vector[a] += wx * y
            row = matrix[a]
            for b in range(size):
                row[b] += wx * picked[b][i]
    return matrix, vector


def _gauss(matrix: list[list[float]], vector: list[float]) -> list[float] | None:
    size = len(vector)
    for column in range(size):
        pivot = max(range(column, size), key=lambda row: abs(matrix[row][column]))
        if abs(matrix[pivot][column]) < 1e-300:
            return None
        matrix[column], matrix[pivot] = matrix[pivot], matrix[column]
        vector[column], vector[pivot] = vector[pivot], vector[column]
        for row in range(column + 1, size):
            factor = matrix[row][column] / matrix[column][column]
            for k in range(column, size):
                matrix[row][k] -= factor * matrix[column][k]
            vector[row] -= factor * vector[column]
    solution = [0.0] * size
    for row in range(size - 1, -1, -1):
        rest = sum(matrix[row][k] * solution[k] for k in range(row + 1, size))
        solution[row] = (vector[row] - rest) / matrix[row][row]
    return solution


_native_fit = _load_native_fit()
"""The C fit, chosen once at import (None: the Python fit)."""

__all__ = [
    "PYTHON_FIT_ENV",
    "CalibrationConfig",
    "CostCalibrator",
    "Observation",
    "ReplicaCosts",
    "SharedObservation",
    "fit_costs",
    "native_cost_fit",
    "python_fit_costs",
]
