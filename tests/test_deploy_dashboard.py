"""The Grafana dashboard's queries name metrics that kvrouter and the engines really export, and they evaluate.

A real stack on 127.0.0.1: `kvrouter sim` (two simulated vLLM replicas, a subprocess) behind a real kvrouter
(`create_app` on a real port) with traffic flowing. Every `kvrouter_*` name in the dashboard must appear in the
router's /metrics, every `vllm:*` name in a replica's. When Prometheus is installed (Debian's `prometheus`
package), it scrapes both and every panel query is evaluated through its HTTP API: no query may fail, and the
panels an operator looks at first must have data.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp.test_utils import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvrouter.config import load_fleet
from kvrouter.server.app import FLEET, create_app
from tests.conftest import router_settings, stop_process
from tests.deploy_support import DEPLOY, free_block
from tests.shared_data import ci_tool

DASHBOARD = DEPLOY / "grafana" / "dashboards" / "kvrouter.json"
METRIC = re.compile(r"\b(kvrouter_[a-z0-9_]+|vllm:[a-z0-9_:]+)")
MUST_HAVE_DATA = (
    "TTFT p50 per replica",
    "Routing share per replica",
    "Requests per second by status",
    "Cached prompt tokens per second: predicted vs actual",
    "In flight per replica (router)",
    "Engine queue per replica (vLLM waiting)",
    "Engine prefix-cache hit ratio (vLLM)",
    "Replica routable (per router instance)",
)


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target, Grafana's variables filled in as Grafana would for "All"."""
    found = []
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", "1m").replace("$replica", ".*")
            found.append((panel["title"], expr))
    return found


def exported_names(exposition: str) -> set[str]:
    """Every series name a scrape can yield, including families that have no sample yet."""
    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        names.add(family.name)
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ()))
        names.update(sample.name for sample in family.samples)
    return names


def test_dashboard_shape() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    ids = [panel["id"] for panel in panels(dashboard)]
    assert len(ids) == len(set(ids))
    titles = {panel["title"] for panel in panels(dashboard)}
    assert set(MUST_HAVE_DATA) <= titles
    for required in ("TTFT p99 per replica", "Event lag per replica", "Index size per replica (blocks)"):
        assert required in titles
    for panel in panels(dashboard):
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            assert panel["datasource"]["uid"] == "${datasource}"
            assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24


@pytest.fixture(scope="module")
def sim_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Two simulated replicas in a `kvrouter sim` subprocess; yields the replicas.yaml it wrote."""
    fleet_file = tmp_path_factory.mktemp("sim") / "replicas.yaml"
    base = free_block(2)
    kv_base = free_block(4)
    command = [
        sys.executable,
        "-m",
        "kvrouter.cli",
        "sim",
        "--replicas",
        "2",
        "--profile",
        "cpu-tiny",
        "--base-port",
        str(base),
        "--kv-base-port",
        str(kv_base),
        "--write-replicas",
        str(fleet_file),
        "--time-scale",
        "20",
        "--log-level",
        "warning",
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"kvrouter sim exited: {process.stderr.read() if process.stderr else ''}")
            if fleet_file.exists() and all(_answers(f"http://127.0.0.1:{base + i}/health") for i in range(2)):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("kvrouter sim did not start in 60 s")
            time.sleep(0.1)
        yield fleet_file
    finally:
        stop_process(process)


def _answers(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@pytest.fixture
async def stack(sim_fleet: Path, aiohttp_client: Any) -> AsyncIterator[tuple[TestClient[Any, Any], list[str]]]:
    """A kvrouter in front of the simulated fleet, and the replicas' base URLs."""
    fleet = load_fleet(sim_fleet)
    settings = router_settings(
        policy="least_loaded", health_interval_s=0.5, metrics_interval_s=0.5, read_timeout_s=30.0
    )
    client: TestClient[Any, Any] = await aiohttp_client(create_app(settings, fleet, registry=CollectorRegistry()))
    yield client, [replica.base_url for replica in fleet.replicas]


SYSTEM = "You are a careful assistant for a Japanese trading company. " * 20


async def send_traffic(client: TestClient[Any, Any], count: int, model: str) -> None:
    for turn in range(count):
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {turn}"}],
            "max_tokens": 4,
        }
        if turn % 2:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        async with client.post("/v1/chat/completions", json=body) as response:
            await response.read()
            assert response.status == 200, await response.text()


async def test_dashboard_queries_name_exported_metrics(stack: tuple[TestClient[Any, Any], list[str]]) -> None:
    client, replica_urls = stack
    model = load_model_name(client)
    await send_traffic(client, 6, model)
    router_names = exported_names(await (await client.get("/metrics")).text())
    # Metrics that exist only in Redis mode: an app built for it (not started) names them all.
    redis_registry = CollectorRegistry()
    fleet = client.app[FLEET]
    create_app(router_settings(redis_url="redis://127.0.0.1:9/0"), fleet, registry=redis_registry)
    router_names |= exported_names(generate_latest(redis_registry).decode())
    async with aiohttp.ClientSession() as session, session.get(f"{replica_urls[0]}/metrics") as response:
        engine_names = exported_names(await response.text())
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    used = {name for _, expr in queries(dashboard) for name in METRIC.findall(expr)}
    for variable in dashboard["templating"]["list"]:
        used.update(METRIC.findall(json.dumps(variable.get("query", ""))))
    missing_router = sorted(n for n in used if n.startswith("kvrouter_") and n not in router_names)
    missing_engine = sorted(n for n in used if n.startswith("vllm:") and n not in engine_names)
    assert not missing_router, f"dashboard names metrics the router does not export: {missing_router}"
    assert not missing_engine, f"dashboard names metrics the engines do not export: {missing_engine}"


def load_model_name(client: TestClient[Any, Any]) -> str:
    model = client.app[FLEET].model
    assert model is not None
    return model


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[dict[str, Any]], tuple[str, subprocess.Popen[bytes]]]]:
    """`prometheus(config)` starts a Prometheus on 127.0.0.1 with that config; yields (API URL, process)."""
    binary = ci_tool("prometheus", "prometheus")
    started: list[subprocess.Popen[bytes]] = []

    def start(config: dict[str, Any]) -> tuple[str, subprocess.Popen[bytes]]:
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
        port = free_block(1)
        command = [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ]
        process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "HOME": str(tmp_path)}
        )
        started.append(process)
        return f"http://127.0.0.1:{port}", process

    yield start
    for process in started:
        stop_process(process)


@pytest.mark.slow
async def test_every_dashboard_query_evaluates_in_prometheus(
    stack: tuple[TestClient[Any, Any], list[str]],
    prometheus: Callable[[dict[str, Any]], tuple[str, subprocess.Popen[bytes]]],
) -> None:
    client, replica_urls = stack
    model = load_model_name(client)
    router_target = f"127.0.0.1:{client.server.port}"
    engine_targets = [url.removeprefix("http://") for url in replica_urls]
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {"job_name": "kvrouter", "static_configs": [{"targets": [router_target]}]},
            {
                "job_name": "vllm",
                "static_configs": [
                    {"targets": [target], "labels": {"replica": f"sim-{i}"}} for i, target in enumerate(engine_targets)
                ],
            },
        ],
    }
    api, process = prometheus(config)
    async with aiohttp.ClientSession() as session:
        await _wait_ready(session, api, process)
        # Traffic across several scrapes, so rates and quantiles have something to show.
        await _wait_scrapes(session, api, 2)
        for _ in range(5):
            await send_traffic(client, 4, model)
            await asyncio.sleep(0.5)
        scraped = await _scrapes(session, api)
        await _wait_scrapes(session, api, scraped + 2)
        failures, empty = [], []
        for title, expr in queries(json.loads(DASHBOARD.read_text(encoding="utf-8"))):
            async with session.get(f"{api}/api/v1/query", params={"query": expr}) as response:
                answer = await response.json()
            if answer.get("status") != "success":
                failures.append((title, expr, answer.get("error")))
            elif title in MUST_HAVE_DATA and not answer["data"]["result"]:
                empty.append((title, expr))
        assert not failures, failures
        assert not empty, f"panels without data: {empty}"


async def _scrapes(session: aiohttp.ClientSession, api: str) -> int:
    query = 'count_over_time(up{job="kvrouter"}[5m])'
    async with session.get(f"{api}/api/v1/query", params={"query": query}) as response:
        result = (await response.json())["data"]["result"]
    return int(result[0]["value"][1]) if result else 0


async def _wait_scrapes(session: aiohttp.ClientSession, api: str, count: int) -> None:
    for _ in range(300):
        if await _scrapes(session, api) >= count:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"prometheus did not scrape the router {count} times in 30 s")


async def _wait_ready(session: aiohttp.ClientSession, api: str, process: subprocess.Popen[bytes]) -> None:
    for _ in range(300):
        if process.poll() is not None:
            raise RuntimeError("prometheus exited at start")
        try:
            async with session.get(f"{api}/-/ready") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError("prometheus not ready in 30 s")
