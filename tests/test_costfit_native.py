"""The C cost refit (kvrouter/_costfit.c) gives the Python fit's floats bit for bit, and a replay does not move.

Each window is fitted both ways and compared with `==` and through `float.hex`: random windows like kv_aware's,
hypothesis-drawn ones (any finite or infinite values, NaN where it may go), and the degenerate cases: a zero
column, coefficients pinned at zero, singular systems (None), squares that overflow (Python's OverflowError),
inputs C declines (ints that stay ints, NaN TTFTs, float subclasses) and hands back to the Python fit."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.cli import main
from kvrouter.routing import calibration
from kvrouter.routing.calibration import (
    CalibrationConfig,
    CostCalibrator,
    Observation,
    ReplicaCosts,
    fit_costs,
    python_fit_costs,
)
from tests.shared_data import SHARED, shared

_costfit = pytest.importorskip("kvrouter._costfit", reason="kvrouter._costfit was not built")
SYNTHETIC = SHARED / "traces" / "mooncake" / "synthetic_trace.jsonl"


def exact(costs: ReplicaCosts | None) -> tuple[object, ...] | None:
    if costs is None:
        return None
    values = (costs.prefill_tokens_per_s, costs.pass_s, costs.decode_s_per_request)
    return (*values, *(float(v).hex() for v in values), costs.samples, costs.source, costs.rate_source)


def native(observations: Sequence[Observation], prior: ReplicaCosts, config: CalibrationConfig) -> object:
    return _costfit.fit(
        observations,
        prior.pass_s,
        prior.decode_s_per_request,
        prior.prefill_tokens_per_s,
        config.prior_samples,
        config.iterations,
    )


def assert_same(observations: Sequence[Observation], prior: ReplicaCosts, config: CalibrationConfig) -> None:
    """Both fits agree (or raise the same error); returns nothing so callers also check who ran."""
    try:
        expected = python_fit_costs(observations, prior, config)
    except (OverflowError, ZeroDivisionError) as error:
        with pytest.raises(type(error)):
            fit_costs(observations, prior, config)
        return
    got = fit_costs(observations, prior, config)
    assert got == expected or (got is not None and expected is not None and exact(got) == exact(expected))
    assert exact(got) == exact(expected)


def window(rng: random.Random, count: int, kind: int) -> list[Observation]:
    """kv_aware's kind of window: 0 plain, 1 nothing decoding (a zero column), 2 TTFTs that fall as work grows (a
    negative coefficient pinned), 3 zero and tiny TTFTs, 4 extreme magnitudes and negative shorts."""
    rate, pass_s, per_request = rng.uniform(1e3, 2e5), rng.uniform(0.001, 0.2), rng.uniform(0, 0.002)
    result = []
    for _ in range(count):
        work = rng.choice([rng.uniform(1, 2_000), rng.uniform(2_000, 200_000), 0.0])
        short, passes = max(0.0, 1.0 - work / 8192), max(1.0, work / 8192)
        decoding = 0.0 if kind == 1 else float(rng.randint(0, 200))
        ttft = work / rate + short * pass_s + passes * decoding * per_request
        if kind == 2:
            ttft = max(0.0, 1.0 - work / 300_000)
        if kind == 3:
            ttft = rng.choice([0.0, -0.0, ttft, 1e-9])
        if kind == 4:
            work, short = work * rng.choice([1e120, 1e-160, 1.0]), -short
        result.append(Observation(work, short, passes, decoding, ttft * rng.lognormvariate(0, 0.5)))
    return result


@pytest.mark.parametrize("seed", range(300))
def test_random_windows_are_bit_identical(seed: int) -> None:
    rng = random.Random(seed)
    config = CalibrationConfig(prior_samples=rng.choice([0.0, 1.0, 4.0]), iterations=rng.choice([1, 3, 10]))
    sample = window(rng, rng.choice([3, 4, 5, 24, 100, 256]), seed % 5)
    prior = ReplicaCosts(rng.uniform(1e3, 1e5), rng.uniform(0.001, 0.1), rng.uniform(0, 0.001))
    assert native(sample, prior, config) is not False  # C ran
    assert_same(sample, prior, config)
    assert_same(deque(sample, maxlen=256), prior, config)  # what the calibrator passes


finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)
anything = st.floats(allow_nan=True, allow_infinity=True)
extreme = st.one_of(finite, anything, st.sampled_from([0.0, -0.0, 1.0, -1.0, 1e-310, 1e154, 1e160, 1e300]))


@st.composite
def windows(draw: st.DrawFn) -> tuple[list[Observation], ReplicaCosts, CalibrationConfig]:
    values = draw(st.sampled_from([finite, extreme]))
    count = draw(st.integers(min_value=0, max_value=40))
    ttfts = st.one_of(values, st.just(math.nan)) if draw(st.booleans()) else values.filter(lambda v: v == v)
    sample = [Observation(draw(values), draw(values), draw(values), draw(values), draw(ttfts)) for _ in range(count)]
    prior = ReplicaCosts(draw(st.one_of(finite, extreme)), draw(finite), draw(finite))
    config = CalibrationConfig(
        prior_samples=draw(st.sampled_from([0.0, 0.5, 1.0, 4.0])), iterations=draw(st.integers(1, 12))
    )
    return sample, prior, config


@settings(max_examples=400, deadline=None)
@given(windows())
def test_hypothesis_windows_are_bit_identical(case: tuple[list[Observation], ReplicaCosts, CalibrationConfig]) -> None:
    sample, prior, config = case
    if all(not math.isnan(o.ttft_s) for o in sample) and prior.prefill_tokens_per_s != 0.0:
        try:
            python_fit_costs(sample, prior, config)
        except OverflowError:
            pass
        else:
            assert native(sample, prior, config) is not False
    assert_same(sample, prior, config)


def test_degenerate_windows() -> None:
    rng = random.Random(7)
    prior = ReplicaCosts(20_000.0, 0.01, 0.0005)
    plain = window(rng, 64, 0)
    no_prior = CalibrationConfig(prior_samples=0.0)
    negative = [Observation(rng.uniform(1, 99), rng.uniform(0, 1), 1.0, rng.uniform(0, 5), -1.0) for _ in range(20)]
    cases: list[tuple[list[Observation], CalibrationConfig]] = [
        # every column zero and no prior rows: X'WX is all zeros, the fit is singular -> None
        ([Observation(0.0, 0.0, 1.0, 0.0, 0.5) for _ in range(30)], no_prior),
        # identical rows: rank one
        ([Observation(4_000.0, 0.5, 1.0, 3.0, 0.2)] * 30, no_prior),
        # a zero column (scale 1.0) with the prior's pull
        ([Observation(o.work_tokens, 0.0, o.passes, o.decoding, o.ttft_s) for o in plain], CalibrationConfig()),
        # every coefficient wants to be negative (positive columns, negative TTFTs): all pinned, the fit is zeros
        (negative, no_prior),
        # two equal columns: singular
        ([Observation(w, 0.5, 1.0, w, 0.1 * w) for w in (1.0, 2.0, 3.0, 4.0)], no_prior),
        # fewer than three rows
        (plain[:2], CalibrationConfig()),
        # infinite and NaN inputs outside the TTFT
        ([Observation(math.inf, 0.1, 1.0, 1.0, 0.1), *plain[:10]], CalibrationConfig()),
        ([Observation(1.0, math.nan, 1.0, 1.0, 0.1), *plain[:10]], CalibrationConfig()),
        # squares that overflow: Python raises OverflowError, and so does the dispatch
        ([Observation(1e200, 0.1, 1.0, 1.0, 0.1), *plain[:10]], CalibrationConfig()),
    ]
    for sample, config in cases:
        assert_same(sample, prior, config)
    for singular in (cases[0][0], cases[1][0], cases[4][0]):
        assert fit_costs(singular, prior, no_prior) is None and native(singular, prior, no_prior) is None
    pinned = fit_costs(cases[3][0], prior, no_prior)
    assert pinned is not None and (pinned.prefill_tokens_per_s, pinned.pass_s, pinned.decode_s_per_request) == (
        1e8,
        0.0,
        0.0,
    )
    with pytest.raises(OverflowError):
        fit_costs(cases[-1][0], prior, CalibrationConfig())
    with pytest.raises(ZeroDivisionError):
        fit_costs(plain, ReplicaCosts(0.0, 0.01, 0.0005))


class Ttft(float):
    pass


def test_inputs_c_declines_go_to_the_python_fit() -> None:
    rng = random.Random(3)
    prior = ReplicaCosts(20_000.0, 0.01, 0.0005)
    plain = window(rng, 40, 0)
    config = CalibrationConfig()
    ints = [Observation(o.work_tokens, o.short, o.passes, int(o.decoding), o.ttft_s) for o in plain]
    assert native(ints, prior, config) is not False  # float * int is a float: C takes it
    assert_same(ints, prior, config)
    declined = [
        [Observation(o.work_tokens, o.short, 1, int(o.decoding), o.ttft_s) for o in plain],  # int * int stays an int
        [Observation(o.work_tokens, o.short, o.passes, o.decoding, math.nan) for o in plain],  # NaN TTFT
        [Observation(o.work_tokens, o.short, o.passes, o.decoding, Ttft(o.ttft_s)) for o in plain],  # a subclass
        [Observation(int(o.work_tokens), o.short, o.passes, o.decoding, o.ttft_s) for o in plain],  # int squares
        [Observation(o.work_tokens, o.short, o.passes, True, o.ttft_s) for o in plain],  # a bool
    ]
    for sample in declined:
        assert native(sample, prior, config) is False
        assert_same(sample, prior, config)
    assert native(iter(plain), prior, config) is False  # type: ignore[arg-type]  # not a sequence
    assert native(plain, prior, CalibrationConfig(prior_samples=2)) is not False  # an int multiplicity converts
    assert_same(plain, prior, CalibrationConfig(prior_samples=2))
    assert_same(plain, ReplicaCosts(20_000, 1, 0), config)


def test_the_calibrator_fits_the_same_either_way(monkeypatch: pytest.MonkeyPatch) -> None:
    def run() -> list[tuple[object, ...] | None]:
        calibrator = CostCalibrator(ReplicaCosts(10_000.0, 0.02, 0.0005))
        rng = random.Random(11)
        seen = []
        for n in range(600):
            replica = f"r{n % 3}"
            sample = window(rng, 1, n % 3)[0]
            calibrator.observe(replica, sample, weight=1.0 + n % 3)
            seen.append(exact(calibrator.costs(replica)))
        return seen

    with_c = run()
    monkeypatch.setattr(calibration, "_native_fit", None)
    assert not calibration.native_cost_fit()
    assert run() == with_c


def test_the_environment_forces_the_python_fit() -> None:
    code = "from kvrouter.routing.calibration import native_cost_fit; print(native_cost_fit())"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    for value, expected in (("1", "False"), ("0", "True"), ("", "True")):
        out = subprocess.run(
            [sys.executable, "-c", code], env={**env, calibration.PYTHON_FIT_ENV: value}, capture_output=True, text=True
        )
        assert out.stdout.strip() == expected, out.stderr


def test_a_replay_writes_the_same_bytes_with_either_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trace = shared(SYNTHETIC)
    args = ["replay", str(trace), "--policies", "kv_aware", "--replicas", "4", "--profile", "dynamo-mocker"]
    args += ["--speedup", "2.4", "--no-floor", "--limit", "1200", "--jobs", "1"]
    answers: list[object] = []
    original = calibration._native_fit
    assert original is not None

    def counted(*a: object) -> object:
        answers.append(original(*a))  # type: ignore[arg-type]
        return answers[-1]

    monkeypatch.setattr(calibration, "_native_fit", counted)
    assert main([*args, "--out", str(tmp_path / "c")]) == 0
    # The replay refits, every time in C: the comparison below means something.
    assert len(answers) > 20 and False not in answers
    monkeypatch.setattr(calibration, "_native_fit", None)
    assert main([*args, "--out", str(tmp_path / "python")]) == 0
    name = "requests_kv_aware.csv"  # every request: replica, first token, finish, cached tokens, ...
    assert (tmp_path / "c" / name).read_bytes() == (tmp_path / "python" / name).read_bytes()
    reports = [json.loads((tmp_path / run / "report.json").read_text()) for run in ("c", "python")]
    for report in reports:  # the replay's own wall-clock and CPU times are the only fields that may differ
        for timing in ("prepare_s", "replay_cpu_s", "wall_s"):
            report["replay"].pop(timing)
    assert json.dumps(reports[0]) == json.dumps(reports[1])
