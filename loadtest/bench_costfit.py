"""One cost refit (`kvrouter.routing.calibration.fit_costs`), in C and in Python: thread CPU time per fit.

kv_aware refits a replica's costs every `refit_every` (16) first tokens over its last `window` (256)
observations, on the request path. This times that fit on a full window of kv_aware-like observations (random
work from a few tokens to 200,000, some requests decoding), with the default `CalibrationConfig`, and checks that
the two fits give the same floats. Prints the median over `--rounds` of `--fits` fits each.

    python loadtest/bench_costfit.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable

from kvrouter.routing import calibration
from kvrouter.routing.calibration import CalibrationConfig, Observation, ReplicaCosts


def window(rng: random.Random, size: int) -> deque[Observation]:
    rate, pass_s, per_request = 40_000.0, 0.02, 0.0004
    observations: deque[Observation] = deque(maxlen=size)
    for _ in range(size):
        work = rng.choice([rng.uniform(1, 2_000), rng.uniform(2_000, 200_000)])
        short, passes = max(0.0, 1.0 - work / 8192), max(1.0, work / 8192)
        decoding = float(rng.randint(0, 64))
        ttft = work / rate + short * pass_s + passes * decoding * per_request
        observations.append(Observation(work, short, passes, decoding, ttft * rng.lognormvariate(0, 0.3)))
    return observations


def per_fit_us(fit: Callable[[], object], fits: int, rounds: int) -> float:
    results = []
    for _ in range(rounds):
        started = time.thread_time()
        for _ in range(fits):
            fit()
        results.append((time.thread_time() - started) / fits * 1e6)
    return statistics.median(results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--fits", type=int, default=50, help="fits per round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    config = CalibrationConfig(window=args.window)
    prior = ReplicaCosts(30_000.0, 0.01, 0.0005)
    observations = window(random.Random(1), args.window)
    python = calibration.python_fit_costs(observations, prior, config)
    if not calibration.native_cost_fit():
        print("kvrouter._costfit is not built (or KVROUTER_PYTHON_COSTFIT is set): Python only")
    elif calibration.fit_costs(observations, prior, config) != python:
        print("the C and Python fits differ", file=sys.stderr)
        return 1
    python_us = per_fit_us(lambda: calibration.python_fit_costs(observations, prior, config), args.fits, args.rounds)
    print(f"window {args.window}, {config.iterations} iterations; median of {args.rounds} rounds of {args.fits} fits")
    print(f"python: {python_us:,.0f} us per fit (thread CPU)")
    if calibration.native_cost_fit():
        native_us = per_fit_us(lambda: calibration.fit_costs(observations, prior, config), args.fits, args.rounds)
        print(f"C:      {native_us:,.1f} us per fit ({python_us / native_us:.0f}x faster)")
        per_request = (python_us - native_us) / config.refit_every
        print(f"per request at one refit every {config.refit_every}: {per_request:,.0f} us less")
    return 0


if __name__ == "__main__":
    sys.exit(main())
