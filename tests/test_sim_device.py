"""Replicas sharing one GPU (kvrouter.sim.device): processor sharing in the pure core, the live driver and the
replay; the h200-llama8b profile serving; the fit script on a slice of the real records."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from kvrouter.config import Settings, load_fleet
from kvrouter.loadgen.fleet import start_sim
from kvrouter.replay.cli import replay_policy_object
from kvrouter.replay.driver import ReplayOptions, VirtualClock, replay_policy
from kvrouter.replay.prompts import PromptCatalog
from kvrouter.replay.trace import load_trace
from kvrouter.sim.device import DeviceSharing, LiveDevice, SharedDevice
from kvrouter.sim.profiles import PROFILES, build_engine, get_profile
from tests.shared_data import MOONCAKE_CONVERSATION, VLLM_CAPTURES, shared

ROOT = Path(__file__).resolve().parents[1]
H200 = ROOT / "docs" / "loadtests" / "h200-multi-tenant"


def test_a_pass_alone_takes_its_duration() -> None:
    device = SharedDevice(overhead_s=0.02, overhead_share=0.2)
    assert device.begin("a", 0.3, 1.0) == []
    assert device.next_end() == pytest.approx(1.3)
    assert device.advance(2.0) == [(pytest.approx(1.3), "a")]
    assert device.next_end() is None


def test_co_located_prefills_share_the_gpu() -> None:
    device = SharedDevice(overhead_s=0.0)
    device.begin("a", 0.3, 0.0)
    device.begin("b", 0.3, 0.0)
    assert device.advance(10.0) == [(pytest.approx(0.6), "a"), (pytest.approx(0.6), "b")]
    # A pass that joins halfway: the first has 0.1 s left alone, now at half speed (0.2 s); the second's 0.3 s
    # then runs 0.1 alone-seconds shared and the rest alone.
    device.begin("a", 0.2, 10.0)
    device.begin("b", 0.3, 10.1)
    ended = device.advance(20.0)
    assert ended == [(pytest.approx(10.3), "a"), (pytest.approx(10.5), "b")]


def test_launch_bound_decodes_barely_interfere_but_wait_behind_a_prefill() -> None:
    decode, prefill = 0.022, 0.3
    device = SharedDevice(overhead_s=0.0205, overhead_share=0.2)
    for name in "abc":
        device.begin(name, decode, 0.0)
    assert device.advance(1.0)[-1][0] == pytest.approx(decode)  # three decodes' demands fit in one GPU
    device.begin("decode", decode, 2.0)
    for name in ("p1", "p2", "p3"):
        device.begin(name, prefill, 2.0)
    ended = {key: end for end, key in device.advance(5.0)}
    assert ended["decode"] - 2.0 > 2.5 * decode  # beside three prefills: ~3x
    assert ended["p1"] - 2.0 > 2.5 * prefill


@pytest.mark.timeout(60)
@pytest.mark.parametrize("origin", [0.0, 5e3, 1e5, 1e6, 1e7])
def test_every_pass_ends_on_a_clock_of_any_size(origin: float) -> None:
    # The live device runs on time.monotonic, which on a host up for days is ~1e5-1e6 s: there `end - now` loses
    # the low bits of a pass's remainder. Every pass must still end, once, in order (a CI host once spun forever).
    device = SharedDevice(overhead_s=0.002, overhead_share=0.2)
    device.now = origin
    rng = random.Random(7)
    now, ended = origin, []
    for key in range(3000):
        now += rng.expovariate(40.0)
        ended += device.begin(key, rng.uniform(0.0005, 0.05), now)
    ended += device.advance(now + 100.0)
    assert sorted(key for _, key in ended) == list(range(3000))
    assert [end for end, _ in ended] == sorted(end for end, _ in ended)
    assert device.next_end() is None


def test_existing_profiles_keep_a_device_each() -> None:
    for name, profile in PROFILES.items():
        if name != "h200-llama8b":
            assert not profile.device_sharing().shared, name
    h200 = get_profile("h200-llama8b").device_sharing()
    assert h200.shared and h200.device_of(3) == 0 and h200.device_of(4) == 1
    with pytest.raises(ValueError):
        DeviceSharing(replicas_per_device=0)


async def test_live_device_runs_co_located_passes_side_by_side() -> None:
    device = LiveDevice(SharedDevice(overhead_s=0.0))
    began = time.monotonic()
    ends = await asyncio.gather(device.run_pass(0.1, began), device.run_pass(0.1, began))
    assert ends[0] == pytest.approx(began + 0.2, abs=0.02) and ends[1] == pytest.approx(ends[0])
    assert time.monotonic() - began >= 0.19


def _replay(sharing: DeviceSharing, profile_name: str = "h200-llama8b") -> list[float]:
    trace = load_trace(shared(MOONCAKE_CONVERSATION), speedup=4.0, limit=120)
    profile = dataclasses.replace(get_profile(profile_name), replicas_per_device=1)
    catalog = PromptCatalog(trace_block_tokens=trace.block_tokens, block_size=profile.block_size)
    prompts = [catalog.prepare(request) for request in trace.requests]
    clock = VirtualClock()
    result = replay_policy(
        requests=trace.requests,
        prompts=prompts,
        catalog=catalog,
        policy=replay_policy_object("round_robin", Settings(), clock),
        engine_factory=lambda: build_engine(profile, num_gpu_blocks=20_000),
        options=ReplayOptions(replicas=4, device=sharing),
        clock=clock,
    )
    ttfts = [record.ttft for record in result.records]
    assert all(ttft is not None for ttft in ttfts)
    return [ttft for ttft in ttfts if ttft is not None]


def test_replay_with_one_replica_per_device_is_the_old_timing_and_sharing_slows_it() -> None:
    profile = get_profile("h200-llama8b")
    own = _replay(DeviceSharing())
    one_each = _replay(dataclasses.replace(profile.device_sharing(), replicas_per_device=1))
    assert one_each == own  # a device per replica: exactly the timing without devices
    shared_gpu = _replay(profile.device_sharing())
    assert sum(shared_gpu) > 1.2 * sum(own)
    assert all(s >= o - 1e-9 for s, o in zip(sorted(shared_gpu), sorted(own), strict=True))


async def test_kvrouter_sim_serves_the_h200_profile(tmp_path: Path) -> None:
    sim = start_sim(
        replicas=4, profile="h200-llama8b", replicas_file=tmp_path / "replicas.yaml", log=tmp_path / "sim.log",
        time_scale=10,
    )  # fmt: skip
    try:
        fleet = load_fleet(sim.replicas_file)
        assert fleet.block_size == 16 and len(fleet.replicas) == 4
        async with aiohttp.ClientSession() as session:
            posts = [
                session.post(f"{r.base_url}/v1/completions", json={"prompt": "hi " * 500, "max_tokens": 3})
                for r in fleet.replicas
            ]
            for response in await asyncio.gather(*posts):
                async with response:
                    assert (await response.json())["usage"]["completion_tokens"] == 3
    finally:
        sim.child.stop()


def test_the_fit_script_runs_on_a_slice_of_the_records(tmp_path: Path) -> None:
    tokenizer = shared(VLLM_CAPTURES / "model")
    out = tmp_path / "fit.json"
    command = [
        sys.executable, str(ROOT / "loadtest" / "gpu" / "fit_h200_profile.py"), "fit", str(H200 / "mt-r4-s0"),
        "--limit", "40", "--shares", "0.2", "--speedups", "1.45", "--json", str(out), "--tokenizer", str(tokenizer),
        "--switch-share", "none",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "stage 3" in done.stdout
    figures = json.loads(out.read_text())
    assert 0 < figures["per_token_s"] < 1e-4 and figures["overhead_device_share"] == 0.2
    assert figures["device_switch_share"] is None
    # The default model is time slicing with an equal slice per context: no demand share is searched.
    done = subprocess.run([*command[:-2], "--shares", "0.45"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    figures = json.loads(out.read_text())
    assert figures["device_switch_share"] == 1.0 and [row["share"] for row in figures["grid"]] == [0.3]


def _prefill_beside_decoding(device: SharedDevice, prefill: float, decode: float) -> float:
    """When a prefill pass started at 0 ends while three other engines run decode passes back to back."""
    device.begin("prefill", prefill, 0.0)
    for name in ("a", "b", "c"):
        device.begin(name, decode, 0.0)
    while True:
        end = device.next_end()
        assert end is not None
        for at, key in device.advance(end):
            if key == "prefill":
                return at
            device.begin(key, decode, at)


def test_time_slicing_slows_a_prefill_beside_decodes_more_than_decodes_beside_each_other() -> None:
    # An eager 8B decode pass: 22 ms alone, 20.5 of them launch-bound. A prefill pass: 200 ms, nearly all GPU work.
    overhead, decode, prefill = 0.0205, 0.022, 0.2
    alone = SharedDevice(overhead_s=overhead, switch_share=1.0)
    alone.begin("p", prefill, 0.0)
    assert alone.advance(1.0) == [(pytest.approx(prefill), "p")]  # one pass alone takes exactly its duration
    decodes = SharedDevice(overhead_s=overhead, switch_share=1.0)
    for name in "abcd":
        decodes.begin(name, decode, 0.0)
    end = decodes.advance(1.0)[0][0]
    assert 1.05 * decode < end < 1.5 * decode  # four launch-bound decodes interleave: ~1.2x
    # Three neighbours decoding back to back for the prefill's whole life: time slicing gives each context with
    # work its slice, so the prefill gets about a quarter of the GPU; processor sharing by demand, where a decode's
    # demand is small, gives it far more.
    sliced = _prefill_beside_decoding(SharedDevice(overhead_s=overhead, switch_share=1.0), prefill, decode)
    shared = _prefill_beside_decoding(SharedDevice(overhead_s=overhead, overhead_share=0.3), prefill, decode)
    assert sliced > 2.5 * prefill
    assert shared < 2.2 * prefill < sliced
    with pytest.raises(ValueError, match="switch_share"):
        SharedDevice(overhead_s=overhead, switch_share=1.5)


def test_agree_one_step_on_the_light_row(tmp_path: Path) -> None:
    # The real router's kv_aware decisions on the 4 req/s H200 row, replayed one step at a time in the simulated
    # state of the real history: the policy sends ~90% where the real router did (89.5% with the profile as
    # committed; 94-96% at 8 and 12 req/s); free running, the cascade of one early difference leaves far fewer.
    tokenizer = shared(VLLM_CAPTURES / "model")
    out = tmp_path / "agree.json"
    command = [
        sys.executable, str(ROOT / "loadtest" / "gpu" / "fit_h200_profile.py"), "agree", str(H200 / "mt-r4-s0"),
        "--json", str(out), "--tokenizer", str(tokenizer),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    figures = json.loads(out.read_text())
    kv = figures["mt-r4-s0/kv_aware"]
    assert kv["requests"] == 105
    assert kv["one_step"]["same_replica"] >= 0.85
    assert kv["free_running"]["same_replica"] < kv["one_step"]["same_replica"] - 0.2
    assert "mt-r4-s0/round_robin" not in figures
