"""The fit's unrolled normal equations give bit for bit the fits of the straightforward loops they replaced (and so
does the C fit, `kvrouter/_costfit.c`, which tests/test_costfit_native.py holds to the Python one).

The replay's figures and the live router's decisions depend on every fitted value, so the speed-up must not move
any of them: the reference below is the earlier implementation, kept verbatim."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest

from kvrouter.routing import calibration
from kvrouter.routing.calibration import CalibrationConfig, Observation, ReplicaCosts, fit_costs, python_fit_costs


def reference_fit(
    observations: Sequence[Observation], prior: ReplicaCosts, config: CalibrationConfig
) -> ReplicaCosts | None:
    rows = [(o.short, o.passes * o.decoding, o.work_tokens) for o in observations]
    targets = [o.ttft_s for o in observations]
    count = len(rows)
    if count < 3:
        return None
    prior_beta = [prior.pass_s, prior.decode_s_per_request, 1.0 / prior.prefill_tokens_per_s]
    scales = [math.sqrt(sum(row[j] ** 2 for row in rows) / count) or 1.0 for j in range(3)]
    scaled = [[row[j] / scales[j] for j in range(3)] for row in rows]
    prior_scaled = [prior_beta[j] * scales[j] for j in range(3)]
    typical = sorted(targets)[count // 2]
    floor = max(1e-4, 1e-3 * typical)
    multiplicity = [1.0] * count
    if config.prior_samples > 0:
        for j in range(3):
            scaled.append([1.0 if k == j else 0.0 for k in range(3)])
            targets.append(prior_scaled[j])
            multiplicity.append(config.prior_samples)
    beta = prior_scaled
    weights = multiplicity
    for _ in range(config.iterations):
        solved = reference_solve(scaled, targets, weights)
        if solved is None:
            return None
        beta = solved
        residuals = [y - sum(x[j] * beta[j] for j in range(3)) for x, y in zip(scaled, targets, strict=True)]
        weights = [m / max(abs(r), floor) for r, m in zip(residuals, multiplicity, strict=True)]
    pass_s, per_request, per_token = (beta[j] / scales[j] for j in range(3))
    if not all(math.isfinite(value) for value in (pass_s, per_request, per_token)):
        return None
    rate = 1e8 if per_token <= 1.0 / 1e8 else min(1e8, max(100.0, 1.0 / per_token))
    return ReplicaCosts(rate, min(2.0, pass_s), min(0.1, per_request), count)


def reference_solve(
    rows: Sequence[Sequence[float]], targets: Sequence[float], weights: Sequence[float]
) -> list[float] | None:
    free = [0, 1, 2]
    while free:
        size = len(free)
        matrix = [[0.0] * size for _ in range(size)]
        vector = [0.0] * size
        for x, y, w in zip(rows, targets, weights, strict=True):
            for a, j in enumerate(free):
                wx = w * x[j]
                vector[a] += wx * y
                row = matrix[a]
                for b, k in enumerate(free):
                    row[b] += wx * x[k]
        solution = calibration._gauss(matrix, vector)
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


def observations(rng: random.Random, count: int, *, idle: bool, negative_pull: bool) -> list[Observation]:
    """Requests of a random replica; `idle`: nothing ever decodes (a zero column); `negative_pull`: TTFTs that fall
    as work grows, so the unconstrained fit wants a negative coefficient and a reduced solve runs."""
    rate = rng.uniform(1_000, 200_000)
    pass_s = rng.uniform(0.001, 0.2)
    per_request = rng.uniform(0, 0.002)
    result = []
    for _ in range(count):
        work = rng.choice([rng.uniform(1, 2_000), rng.uniform(2_000, 200_000)])
        short = max(0.0, 1.0 - work / 8192)
        passes = max(1.0, work / 8192)
        decoding = 0 if idle else rng.randint(0, 200)
        ttft = work / rate + short * pass_s + passes * decoding * per_request
        if negative_pull:
            ttft = max(0.0, 1.0 - work / 300_000)
        result.append(Observation(work, short, passes, decoding, ttft * rng.lognormvariate(0, 0.3)))
    return result


@pytest.mark.parametrize("seed", range(40))
def test_fits_are_bit_identical_to_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    config = CalibrationConfig(prior_samples=rng.choice([0.0, 1.0, 4.0]), iterations=rng.choice([1, 10]))
    sample = observations(rng, rng.choice([3, 24, 256]), idle=seed % 5 == 0, negative_pull=seed % 7 == 0)
    prior = ReplicaCosts(rng.uniform(1_000, 100_000), rng.uniform(0.001, 0.1), rng.uniform(0, 0.001))
    expected = reference_fit(sample, prior, config)
    assert python_fit_costs(sample, prior, config) == expected
    assert fit_costs(sample, prior, config) == expected  # in C where it was built (tests/test_costfit_native.py)


def test_a_reduced_solve_is_exercised(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cases above include fits that pin a coefficient at zero (the generic path, not the unrolled one)."""
    monkeypatch.setattr(calibration, "_native_fit", None)  # the spy sees the Python fit only
    calls: list[list[int]] = []
    original = calibration._normal_equations

    def spy(
        columns: tuple[Sequence[float], Sequence[float], Sequence[float]],
        targets: Sequence[float],
        weights: Sequence[float],
        free: list[int],
    ) -> tuple[list[list[float]], list[float]]:
        calls.append(list(free))
        return original(columns, targets, weights, free)

    monkeypatch.setattr(calibration, "_normal_equations", spy)
    for seed in range(40):
        test_fits_are_bit_identical_to_the_reference(seed)
    assert any(len(free) < 3 for free in calls) and any(len(free) == 3 for free in calls)
