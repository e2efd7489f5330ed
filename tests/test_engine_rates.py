"""kv_aware's engine source: a replica's prefill rate lower bound from its vLLM /metrics histograms.

Pure tests of the parser (on a captured vLLM 0.32 exposition), the per-replica estimator and how the calibrator
weighs it; then over real sockets a fake engine serving that captured text with its prefill totals advancing
(the router picks the rate up, /debug/route and /metrics show it), and the fallbacks: histograms missing, garbage,
an engine restart; last, the replay's engine totals on a mixed fleet.
"""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from kvrouter.config import Settings, parse_fleet
from kvrouter.metrics import RouterMetrics
from kvrouter.policies.kv_aware import KvAwareConfig, KvAwarePolicy
from kvrouter.replay.cli import replay_policy_object
from kvrouter.replay.driver import ReplayOptions, VirtualClock, replay_policy
from kvrouter.replay.engine_metrics import PrefillTotals
from kvrouter.replay.prompts import PromptCatalog
from kvrouter.replay.trace import load_trace, unshared
from kvrouter.routing.calibration import CostCalibrator, Observation, ReplicaCosts
from kvrouter.routing.engine_rates import (
    EngineRateConfig,
    EngineRates,
    EngineTotals,
    Fallback,
    parse_engine_totals,
)
from kvrouter.server.app import create_app, forget_replica
from kvrouter.server.engine_costs import EngineCostFeed
from kvrouter.sim.mocker import DynamoMockerEngine, MockerConfig
from kvrouter.sim.profiles import build_engine, get_profile
from kvrouter.sim.server import ReplicaSettings, build_replica_app
from kvrouter.sim.textio import SimTokenizer
from kvrouter.tinymodel import ensure_tokenizer
from kvrouter.typedefs import ReplicaName
from tests.conftest import eventually, router_settings
from tests.shared_data import MOONCAKE_CONVERSATION, VLLM_CAPTURES, shared

R0, R1 = ReplicaName("r0"), ReplicaName("r1")
START = ReplicaCosts(10_000.0, 0.01, 0.0005)


@pytest.fixture(scope="module")
def captured() -> str:
    """/metrics of a vLLM 0.32 CPU engine after 9 requests (prefill 0.501 s, 1,504 computed tokens)."""
    return shared(VLLM_CAPTURES / "runs" / "s1_basic_bs32" / "metrics_after.txt").read_text()


def advanced(text: str, prefill_s: float, requests: float, tokens: float) -> str:
    """The captured exposition with its three prefill totals replaced (every other line as vLLM wrote it)."""
    values = {
        "vllm:request_prefill_time_seconds_sum": prefill_s,
        "vllm:request_prefill_time_seconds_count": requests,
        "vllm:request_prefill_kv_computed_tokens_sum": tokens,
    }
    lines = []
    for line in text.splitlines():
        name = re.split(r"[{ ]", line, maxsplit=1)[0]
        if name in values:
            line = f"{line.rsplit(' ', 1)[0]} {values[name]!r}"
        lines.append(line)
    return "\n".join(lines) + "\n"


# --- the parser ---------------------------------------------------------------------------------------------


def test_parses_the_captured_vllm_exposition(captured: str) -> None:
    totals = parse_engine_totals(captured)
    assert isinstance(totals, EngineTotals)
    assert totals.prefill_requests == 9
    assert totals.computed_tokens == 1504
    assert totals.prefill_s == pytest.approx(0.5012284339999269)


def test_sums_the_series_of_a_data_parallel_replica(captured: str) -> None:
    second = "\n".join(
        line.replace('engine="0"', 'engine="1"') for line in captured.splitlines() if "request_prefill_" in line
    )
    totals = parse_engine_totals(captured + second + "\n")
    assert isinstance(totals, EngineTotals)
    assert (totals.prefill_requests, totals.computed_tokens) == (18, 3008)


def test_an_engine_without_the_histograms_is_missing(captured: str) -> None:
    older = "\n".join(line for line in captured.splitlines() if "request_prefill_kv_computed" not in line)
    assert parse_engine_totals(older) is Fallback.MISSING
    assert parse_engine_totals("") is Fallback.MISSING
    assert parse_engine_totals("sglang:prompt_tokens_total 5\n") is Fallback.MISSING


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-3.0", "lots", "2.5e400"])
def test_garbage_values_are_invalid(captured: str, value: str) -> None:
    text = advanced(captured, 0.5, 9, 1504).replace(
        'vllm:request_prefill_kv_computed_tokens_sum{engine="0",model_name="tiny"} 1504',
        f'vllm:request_prefill_kv_computed_tokens_sum{{engine="0",model_name="tiny"}} {value}',
    )
    assert parse_engine_totals(text) is Fallback.INVALID


def test_a_fractional_request_count_is_invalid(captured: str) -> None:
    assert parse_engine_totals(advanced(captured, 0.5, 9.5, 1504)) is Fallback.INVALID


H200_SCRAPES = Path(__file__).parent / "fixtures" / "vllm-metrics-h200"


@pytest.mark.parametrize("replica", range(4))
def test_real_gpu_scrapes_give_a_lower_bound_of_the_replicas_rate(replica: int) -> None:
    """vLLM 0.26 on the H200 (tests/fixtures/vllm-metrics-h200): one 12 req/s row between the two scrapes."""
    before = parse_engine_totals((H200_SCRAPES / f"vllm-{replica}.before.txt").read_text())
    after = parse_engine_totals((H200_SCRAPES / f"vllm-{replica}.after.txt").read_text())
    assert isinstance(before, EngineTotals) and isinstance(after, EngineTotals)
    rates = EngineRates()
    assert rates.observe(R0, before) is None
    assert rates.observe(R0, after) is None
    assert 69 <= after.prefill_requests - before.prefill_requests <= 106
    row = EngineRates()  # the row alone: what the two scrapes bracket, as if it were an engine's whole history
    row.observe(
        R0,
        EngineTotals(
            after.prefill_s - before.prefill_s,
            after.prefill_requests - before.prefill_requests,
            after.computed_tokens - before.computed_tokens,
        ),
    )
    row_rate = row.rate(R0)
    assert row_rate is not None and 4_000 < row_rate < 7_000
    # Prefills that share a pass overlap in the time sum: under this load the bound sits well below the ~15,200
    # tokens/s one replica prefills at light load on that GPU (docs/benchmarks.md, "Real GPUs"), never above it.
    history = rates.rate(R0)
    assert history is not None and history < 15_200


# --- the estimator ------------------------------------------------------------------------------------------


def totals(prefill_s: float, requests: float, tokens: float) -> EngineTotals:
    return EngineTotals(prefill_s, requests, tokens)


def test_the_engine_history_gives_a_rate_at_the_first_scrape() -> None:
    rates = EngineRates()
    assert rates.observe(R0, totals(10.0, 100, 300_000)) is None
    assert rates.rate(R0) == pytest.approx(30_000)


def test_too_few_prefills_give_no_rate() -> None:
    rates = EngineRates(EngineRateConfig(min_requests=4))
    rates.observe(R0, totals(0.1, 3, 3000))
    assert rates.rate(R0) is None
    rates.observe(R0, totals(0.2, 4, 6000))
    assert rates.rate(R0) == pytest.approx(30_000)


def test_intervals_follow_the_engine_and_the_history_slides_out() -> None:
    rates = EngineRates(EngineRateConfig(window=5))
    rates.observe(R0, totals(100.0, 1000, 1_000_000))  # 10k tokens/s in its past
    assert rates.rate(R0) == pytest.approx(10_000)
    state = totals(100.0, 1000, 1_000_000)
    for _ in range(6):
        state = totals(state.prefill_s + 1.0, state.prefill_requests + 5, state.computed_tokens + 40_000)
        rates.observe(R0, state)
    assert rates.rate(R0) == pytest.approx(40_000)  # the last 5 intervals only


def test_overlapping_prefills_understate_never_overstate() -> None:
    """Four prefills at a time on an engine of 48k tokens/s: their prefill seconds add up to four times the time
    the tokens took, so the bound is a quarter of the rate; it never exceeds the rate, however the scrapes fall."""
    rates = EngineRates()
    rates.observe(R0, totals(0.0, 0, 0))
    for step in range(1, 61):
        rates.observe(R0, totals(4.0 * step, 12 * step, 48_000 * step))
        assert rates.rate(R0) == pytest.approx(12_000)
    # Requests reach the histograms when they finish: a burst of long answers finishing at once carries tokens
    # computed long before. Both sums cover the same requests, so the ratio is the same.
    rates.observe(R0, totals(4.0 * 60 + 40.0, 12 * 60 + 120, 48_000 * 60 + 480_000))
    assert rates.rate(R0) == pytest.approx(12_000)


def test_a_counter_that_goes_down_is_a_restart() -> None:
    rates = EngineRates()
    rates.observe(R0, totals(10.0, 100, 300_000))
    assert rates.observe(R0, totals(0.5, 10, 40_000)) is Fallback.RESET
    assert rates.rate(R0) == pytest.approx(80_000)  # the new engine's own history
    assert rates.observe(R0, totals(0.1, 2, 8_000)) is Fallback.RESET
    assert rates.rate(R0) is None  # too few prefills since this restart: not the old engine's figure


def test_a_sum_that_goes_down_while_the_count_rises_is_invalid_not_a_restart() -> None:
    rates = EngineRates()
    rates.observe(R0, totals(10.0, 100, 300_000))
    # An engine-side abort before the first token: vLLM observes first_token_ts (0) - scheduled_ts, negative.
    assert rates.observe(R0, totals(-5.0, 101, 300_100)) is Fallback.INVALID
    assert rates.rate(R0) == pytest.approx(30_000)
    assert rates.observe(R0, totals(-4.0, 111, 340_100)) is None  # measured from the invalid scrape on
    assert rates.rate(R0) == pytest.approx(340_000 / 11.0)
    # A router that starts after such an abort: the history is unusable, the deltas are not.
    later = EngineRates()
    assert later.observe(R0, totals(-1e6, 100, 300_000)) is Fallback.INVALID
    assert later.rate(R0) is None
    later.observe(R0, totals(-1e6 + 1.0, 110, 340_000))
    assert later.rate(R0) == pytest.approx(40_000)


def test_a_negative_prefill_time_sum_parses(captured: str) -> None:
    text = captured.replace(
        'vllm:request_prefill_time_seconds_sum{engine="0",model_name="tiny"} 0.5012284339999269',
        'vllm:request_prefill_time_seconds_sum{engine="0",model_name="tiny"} -123456.5',
    )
    totals_now = parse_engine_totals(text)
    assert isinstance(totals_now, EngineTotals) and totals_now.prefill_s == -123456.5


def test_missing_histograms_drop_the_rate_and_invalid_scrapes_keep_it() -> None:
    rates = EngineRates()
    rates.observe(R0, totals(10.0, 100, 300_000))
    assert rates.observe(R0, Fallback.INVALID) is Fallback.INVALID
    assert rates.rate(R0) == pytest.approx(30_000)
    assert rates.observe(R0, Fallback.MISSING) is Fallback.MISSING
    assert rates.rate(R0) is None and rates.rates() == {}


# --- how the calibrator weighs it ---------------------------------------------------------------------------


def observation(rate: float, work: float, ttft_scale: float = 1.0) -> Observation:
    short = max(0.0, 1 - work / 8192)
    return Observation(work, short, max(1.0, work / 8192), 0.0, ttft_scale * (work / rate + short * 0.02))


def test_the_engine_bound_replaces_the_start_and_says_so() -> None:
    calibrator = CostCalibrator(START)
    assert calibrator.costs(R0).rate_source == "start"
    calibrator.set_engine_rate(R0, 31_000.0)
    costs = calibrator.costs(R0)
    assert (costs.prefill_tokens_per_s, costs.rate_source, costs.source) == (31_000.0, "engine", "start")
    assert calibrator.costs(R1).prefill_tokens_per_s == 10_000.0  # per replica
    calibrator.set_engine_rate(R0, None)
    assert calibrator.costs(R0).rate_source == "start"


def test_the_engine_bound_raises_a_borrowed_rate_below_it_only() -> None:
    calibrator = CostCalibrator(START)
    for i in range(40):
        calibrator.observe(R0, observation(40_000.0, 500.0 + 300 * (i % 20)))
    peers = calibrator.costs(R1)
    assert peers.source == "peers" and peers.prefill_tokens_per_s == pytest.approx(40_000, rel=0.05)
    calibrator.set_engine_rate(R1, 20_000.0)  # below what its peers show: proves nothing more
    assert calibrator.costs(R1).rate_source == "peers"
    calibrator.set_engine_rate(R1, 90_000.0)  # a faster engine than its peers
    assert calibrator.costs(R1).prefill_tokens_per_s == 90_000.0 and calibrator.costs(R1).rate_source == "engine"


def test_the_replicas_own_fit_is_never_overridden() -> None:
    calibrator = CostCalibrator(START)
    calibrator.set_engine_rate(R0, 90_000.0)
    for i in range(40):
        calibrator.observe(R0, observation(40_000.0, 500.0 + 300 * (i % 20)))
    costs = calibrator.costs(R0)
    assert costs.source == costs.rate_source == "fit"
    assert costs.prefill_tokens_per_s == pytest.approx(40_000, rel=0.05)


def test_pinned_costs_ignore_the_engine() -> None:
    policy = KvAwarePolicy(KvAwareConfig(calibrate=False))
    policy.set_engine_rate(R0, 90_000.0)
    costs = policy.costs(R0)
    assert (costs.prefill_tokens_per_s, costs.rate_source) == (10_000.0, "pinned")
    assert policy.engine_rates() == {}


# --- over real sockets --------------------------------------------------------------------------------------


class CapturedEngine:
    """A fake vLLM replica: /health, and /metrics serving the captured exposition whose prefill totals advance on
    every scrape by `step` (seconds, requests, tokens); `serve` swaps in another exposition (a restart, garbage)."""

    def __init__(self, text: str, step: tuple[float, float, float] | None) -> None:
        self.text = text
        self.step = step
        self.scrapes = 0
        self.totals = (0.5012284339999269, 9.0, 1504.0)
        self.override: str | None = None
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self.server = TestServer(app, host="127.0.0.1")

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _metrics(self, _: web.Request) -> web.Response:
        self.scrapes += 1
        if self.override is not None:
            return web.Response(text=self.override, content_type="text/plain")
        if self.step is None:
            return web.Response(text=self.text, content_type="text/plain")
        self.totals = tuple(total + delta for total, delta in zip(self.totals, self.step, strict=True))  # type: ignore[assignment]
        return web.Response(text=advanced(self.text, *self.totals), content_type="text/plain")

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")


@pytest.fixture
async def engines() -> Any:
    started: list[CapturedEngine] = []

    async def make(text: str, step: tuple[float, float, float] | None) -> CapturedEngine:
        engine = CapturedEngine(text, step)
        await engine.server.start_server()
        started.append(engine)
        return engine

    yield make
    for engine in started:
        await engine.server.close()


async def router_for(aiohttp_client: Any, engines: list[CapturedEngine], **overrides: Any) -> Any:
    fleet = parse_fleet(
        {"replicas": [{"name": f"e{i}", "url": e.url} for i, e in enumerate(engines)]}, Path("test-replicas.yaml")
    )
    settings = router_settings(policy="kv_aware", metrics_interval_s=0.02, **overrides)
    return await aiohttp_client(create_app(settings, fleet, registry=CollectorRegistry()))


def sample(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


async def debug_candidates(client: Any) -> dict[str, Any]:
    body = {"model": "m", "prompt": list(range(100, 900)), "max_tokens": 2}
    answer = await (await client.post("/debug/route", json=body)).json()
    return {c["replica"]: c for c in answer["candidates"]}


async def test_the_router_prices_a_warm_replica_from_its_engine_metrics(
    aiohttp_client: Any, engines: Any, captured: str
) -> None:
    # 36k tokens/s: every scrape 0.1 s more prefill time for 3,600 more tokens; the other replica shows nothing.
    warm = await engines(captured, (0.1, 2.0, 3600.0))
    older = await engines("\n".join(line for line in captured.splitlines() if "request_prefill" not in line), None)
    client = await router_for(aiohttp_client, [warm, older])

    async def engine_rate() -> float | None:
        return sample(await (await client.get("/metrics")).text(), "kvrouter_kv_engine_prefill_tokens_per_s")

    rate = None
    for _ in range(500):
        rate = await engine_rate()
        if rate is not None and rate > 30_000:
            break
        await asyncio.sleep(0.02)
    assert rate is not None and 30_000 < rate <= 36_000 * 1.0001
    candidates = await debug_candidates(client)
    assert candidates["e0"]["cost_source"]["prefill_tokens_per_s"] == "engine"
    assert candidates["e0"]["prefill_tokens_per_s"] > 30_000
    assert candidates["e1"]["cost_source"] == {
        "prefill_tokens_per_s": "start",
        "pass_fixed_s": "start",
        "decode_s_per_request": "start",
    }
    assert candidates["e1"]["prefill_tokens_per_s"] == 10_000
    text = await (await client.get("/metrics")).text()
    assert sample(text, "kvrouter_kv_calibrated_source", replica="e0", cost="prefill_tokens_per_s") == 1.0
    assert 'source="engine"' in next(
        line for line in text.splitlines() if line.startswith("kvrouter_kv_calibrated_source{") and '"e0"' in line
    )
    assert sample(text, "kvrouter_kv_engine_metrics_fallbacks_total", replica="e1", reason="missing")


async def test_fallbacks_are_counted_logged_once_and_never_break_the_router(
    aiohttp_client: Any, engines: Any, captured: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvrouter.server.engine_costs")
    engine = await engines(captured, (0.1, 2.0, 3600.0))
    client = await router_for(aiohttp_client, [engine])
    await eventually(lambda: engine.scrapes >= 3, what="scrapes")
    # Garbage: the rate it had stays, each such scrape is counted.
    engine.override = captured.replace(
        'vllm:request_prefill_time_seconds_sum{engine="0",model_name="tiny"} 0.5012284339999269',
        'vllm:request_prefill_time_seconds_sum{engine="0",model_name="tiny"} NaN',
    )
    seen = engine.scrapes
    await eventually(lambda: engine.scrapes >= seen + 3, what="garbage scrapes")
    # A restart: the totals start again from the captured ones, far below what the router last saw.
    engine.override = None
    engine.totals = (0.0, 0.0, 0.0)
    seen = engine.scrapes
    await eventually(lambda: engine.scrapes >= seen + 3, what="scrapes after the restart")
    text = await (await client.get("/metrics")).text()
    assert (sample(text, "kvrouter_kv_engine_metrics_fallbacks_total", replica="e0", reason="invalid") or 0) >= 3
    assert sample(text, "kvrouter_kv_engine_metrics_fallbacks_total", replica="e0", reason="reset") == 1
    rate = sample(text, "kvrouter_kv_engine_prefill_tokens_per_s", replica="e0")
    assert rate is not None and rate == pytest.approx(36_000, rel=0.01)  # the restarted engine's own totals
    invalid_logs = [r for r in caplog.records if "not a finite count" in r.getMessage()]
    assert len(invalid_logs) == 1 and "e0" in invalid_logs[0].getMessage()
    assert (await client.get("/health")).status == 200


async def test_switched_off_the_router_reads_no_engine_rate(aiohttp_client: Any, engines: Any, captured: str) -> None:
    engine = await engines(captured, (0.1, 2.0, 3600.0))
    client = await router_for(aiohttp_client, [engine], kv_engine_metrics=False)
    await eventually(lambda: engine.scrapes >= 5, what="scrapes")
    text = await (await client.get("/metrics")).text()
    assert "kvrouter_kv_engine_prefill_tokens_per_s" not in text
    assert (await debug_candidates(client))["e0"]["cost_source"]["prefill_tokens_per_s"] == "start"


# --- in replay ----------------------------------------------------------------------------------------------


def test_prefill_totals_follow_admission_first_token_and_finish() -> None:
    totals = PrefillTotals()
    totals.admitted(R0, "a", now=1.0, computed_tokens=4000)
    totals.admitted(R0, "a", now=3.0, computed_tokens=100)  # re-admitted after a preemption: the first counts
    totals.admitted(R1, "b", now=1.5, computed_tokens=-5)
    totals.first_token("a", now=1.25)
    totals.first_token("b", now=2.0)
    totals.first_token("never-admitted", now=2.0)
    assert totals.totals(R0) == EngineTotals(0.0, 0.0, 0.0)  # vLLM observes them when the request finishes
    for request_id in ("a", "b", "never-admitted"):
        totals.finished(request_id)
    assert totals.totals(R0) == EngineTotals(0.25, 1.0, 4000.0)
    assert totals.totals(R1) == EngineTotals(0.5, 1.0, 0.0)
    assert totals.totals(ReplicaName("idle")) == EngineTotals(0.0, 0.0, 0.0)


def test_a_replayed_mixed_fleet_shows_each_engine_its_own_rate() -> None:
    """The first 600 conversation requests, nothing shared, on 2 engines (engine-1 at half speed), with the engine
    source fed as the live router's scrape loop feeds it: each bound is below that engine's rate, and the slow
    engine's about half the fast one's."""
    trace = unshared(load_trace(shared(MOONCAKE_CONVERSATION), speedup=1.0, limit=600))
    catalog = PromptCatalog(trace_block_tokens=trace.block_tokens, block_size=64)
    prompts = [catalog.prepare(request) for request in trace.requests]
    clock = VirtualClock()
    policy = replay_policy_object("kv_aware", Settings(), clock)
    assert isinstance(policy, KvAwarePolicy)
    replay_policy(
        requests=trace.requests,
        prompts=prompts,
        catalog=catalog,
        policy=policy,
        engine_factory=[DynamoMockerEngine, lambda: DynamoMockerEngine(MockerConfig(speedup=0.5))],
        options=ReplayOptions(replicas=2, engine_metrics=True),
        clock=clock,
    )
    rates = policy.engine_rates()
    fast, slow = rates["engine-0"], rates["engine-1"]
    assert fast <= 8192 / 0.169 * 1.05  # the mocker's full pass: 8,192 tokens in ~169 ms
    assert fast > 20_000 and slow / fast == pytest.approx(0.5, abs=0.15)


async def test_a_router_started_in_front_of_a_warm_simulated_replica_prices_it_from_its_history(
    aiohttp_client: Any,
) -> None:
    """A `kvrouter sim` replica (cpu-tiny, real sockets) serves 8 prompts before any router exists; a kv_aware
    router started then (its start mis-set at 2,000 tokens/s) prices it from the engine's history at its first
    scrapes, at or below the rate it serves at (the profile's x the time scale), where the router alone would still
    use the start (it has routed nothing). Time scale 2: passes of tens of milliseconds, so timer slack on a busy
    machine moves the measured prefill time little."""
    profile = get_profile("cpu-tiny")
    settings = ReplicaSettings(
        name="s0", model_name="tiny", max_model_len=4096, request_overhead_s=profile.request_overhead_s, time_scale=2.0
    )
    sim = TestServer(
        build_replica_app(settings, build_engine(profile, block_size=32), SimTokenizer(ensure_tokenizer()))
    )
    await sim.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            for number in range(8):
                prompt = [1000 + number * 2000 + i for i in range(2000)]  # nothing shared
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
                async with session.post(sim.make_url("/v1/completions"), json=body) as response:
                    assert response.status == 200
        fleet = parse_fleet({"replicas": [{"name": "s0", "url": str(sim.make_url("")).rstrip("/")}]}, Path("r.yaml"))
        router = await aiohttp_client(
            create_app(
                router_settings(policy="kv_aware", metrics_interval_s=0.05, kv_prefill_tokens_per_s=2000),
                fleet,
                registry=CollectorRegistry(),
            )
        )
        for _ in range(200):
            candidate = (await debug_candidates(router))["s0"]
            if candidate["cost_source"]["prefill_tokens_per_s"] == "engine":
                break
            await asyncio.sleep(0.05)
        assert candidate["cost_source"]["prefill_tokens_per_s"] == "engine"
        assert candidate["calibration_samples"] == 0  # nothing of its own yet
        # ~14.8k tokens/s in the profile's time; at time scale 2 the replica serves twice that, and its /metrics
        # (wall seconds, as a real engine's) say so.
        one_pass = 2000 / profile.step_time(2000, 0, 2000, 2000 * 1000) * settings.time_scale
        assert 0.5 * one_pass < candidate["prefill_tokens_per_s"] <= 1.01 * one_pass
        assert candidate["prefill_tokens_per_s"] > 3 * 2000  # the start it replaced
    finally:
        await sim.close()


def test_a_replica_that_is_gone_loses_its_engine_history() -> None:
    """Refused connection or removed from the fleet: `forget_replica` drops its engine totals and bound too."""
    policy = KvAwarePolicy()
    feed = EngineCostFeed(policy, RouterMetrics(CollectorRegistry()))
    feed(R0, totals(10.0, 100, 300_000))
    assert policy.costs(R0).rate_source == "engine"
    forget_replica(None, [], lambda: 0.0, None, feed)(R0)
    assert policy.costs(R0).rate_source == "start" and feed.rates.rate(R0) is None
    feed(R0, totals(0.1, 1, 3000))  # the engine back, its totals started again: no reset, too few prefills yet
    assert policy.costs(R0).rate_source == "start"


def test_a_replica_that_is_gone_loses_its_fitted_costs() -> None:
    """What comes back after a refused connection may be another GPU: priced like its peers, not by its old fit."""
    calibrator = CostCalibrator(ReplicaCosts(10_000.0, 0.01, 0.0005))
    for i in range(256):
        work = 500.0 + 40.0 * i
        calibrator.observe(R0, Observation(work, 0.5, 1.0, 0.0, work / 20_000.0 + 0.005))  # 20k tokens/s
        calibrator.observe(R1, Observation(work, 0.5, 1.0, 0.0, work / 60_000.0 + 0.005))  # 60k tokens/s
    assert calibrator.costs(R0).source == "fit"
    assert calibrator.costs(R0).prefill_tokens_per_s < 30_000.0
    forget_replica(None, [], lambda: 0.0, None, None, calibrator)(R0)
    assert calibrator.costs(R0).source == "peers"
    assert calibrator.costs(R0).prefill_tokens_per_s == calibrator.costs(R1).prefill_tokens_per_s > 50_000.0
    assert calibrator.costs(R1).source == "fit"  # the others keep theirs
