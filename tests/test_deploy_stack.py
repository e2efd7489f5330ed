"""The compose `sim` stack, run as local processes: what deploy/docker-compose.yaml would start, minus Docker.

Each service's own command line and environment are taken from the compose file; only what Docker would provide
is rewritten — host names become 127.0.0.1, fixed ports become free ones, the image's tokenizer path becomes
the locally built tiny tokenizer, Redis is a redis-server this test starts. Then: both routers report ready,
requests sharing a long system prompt sent alternately to the two routers all land on the replica that holds the
prefix (the routers share one index through the relay and Redis), and a drain sent to one router moves the
other router's traffic too.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from kvrouter.config import load_fleet
from tests.conftest import stop_process
from tests.deploy_support import (
    COMPOSE_TEST_PASSWORD,
    DEPLOY,
    compose_environment,
    free_block,
    load_compose,
    services_in,
)
from tests.redis_fixtures import RedisServer, free_port, running_redis

pytestmark = [pytest.mark.redis, pytest.mark.slow]

TOKEN = "stack-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROVISIONAL_TTL_S = 0.2
"""A router's own just-routed prompts lapse this fast in the stack under test."""
IMAGE_TOKENIZER = "/opt/kvrouter/tiny-tokenizer"


def replace_value(command: list[str], flag: str, value: str) -> list[str]:
    index = command.index(flag)
    return [*command[: index + 1], value, *command[index + 2 :]]


@dataclass
class Service:
    process: subprocess.Popen[bytes]
    log: Path


@dataclass
class Stack:
    workdir: Path
    tokenizer: str
    redis_url: str
    fleet: dict[str, Any] = field(default_factory=dict)
    routers: list[str] = field(default_factory=list)
    relay_metrics: str = ""
    relay_command: list[str] = field(default_factory=list)
    sim_command: list[str] = field(default_factory=list)
    services: dict[str, Service] = field(default_factory=dict)

    @property
    def fleet_file(self) -> Path:
        return self.workdir / "replicas-sim.yaml"

    def start(self, name: str, command: list[str], env: dict[str, str] | None = None) -> None:
        log = self.workdir / f"{name}.log"
        with log.open("ab") as sink:
            process = subprocess.Popen(
                [sys.executable, "-m", "kvrouter.cli", *command],
                stdout=sink,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
            )
        self.services[name] = Service(process, log)

    def stop_service(self, name: str) -> None:
        service = self.services.pop(name)
        if service.process.poll() is None:
            stop_process(service.process, timeout_s=15)

    def add_sim(self, name: str, command: list[str]) -> None:
        """Start one simulated replica on free ports with `command` (a compose sim service's) and list it."""
        http = free_port()
        publish = free_block(2)  # the simulator lays its replay socket next to its publisher
        command = replace_value(command, "--base-port", str(http))
        command = replace_value(command, "--kv-base-port", str(publish))
        command = replace_value(command, "--host", "127.0.0.1")
        command = replace_value(command, "--tokenizer", self.tokenizer)
        self.start(name, command)
        replicas = [r for r in self.fleet["replicas"] if r["name"] != name]
        replicas.append(
            {
                "name": name,
                "url": f"http://127.0.0.1:{http}",
                "kv_events": {
                    "endpoint": f"tcp://127.0.0.1:{publish}",
                    "replay_endpoint": f"tcp://127.0.0.1:{publish + 1}",
                    "topic": "kv-events",
                },
            }
        )
        self.fleet["replicas"] = replicas

    def write_fleet(self) -> None:
        self.fleet_file.write_text(yaml.safe_dump(self.fleet), encoding="utf-8")
        load_fleet(self.fleet_file)

    def start_relay(self) -> None:
        # As in compose: the Redis URL, password included, comes from the environment.
        self.start("relay", self.relay_command, {"KVROUTER_REDIS_URL": self.redis_url})

    def check_alive(self) -> None:
        for name, service in self.services.items():
            if service.process.poll() is not None:
                tail = service.log.read_text(errors="replace")[-3000:]
                raise AssertionError(f"{name} exited with {service.process.returncode}:\n{tail}")

    def stop(self) -> None:
        for name in list(self.services):
            self.stop_service(name)


def wait_for(url: str, stack: Stack, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stack.check_alive()
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not answer 200 within {timeout_s:.0f}s")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """Like the compose file's Redis: it requires a password (REDIS_PASSWORD)."""
    with running_redis(tmp_path / "redis", password=COMPOSE_TEST_PASSWORD) as server:
        yield server


@pytest.fixture
def sim_stack(redis_server: RedisServer, tmp_path: Path) -> Iterator[Stack]:
    from kvrouter.tinymodel import ensure_tokenizer

    compose = load_compose({"KVROUTER_FLEET": "replicas-sim", "KVROUTER_ADMIN_TOKEN": TOKEN})
    services = services_in(compose, "sim")
    fleet = yaml.safe_load((DEPLOY / "replicas-sim.yaml").read_text(encoding="utf-8"))
    assert fleet["tokenizer"] == IMAGE_TOKENIZER
    stack = Stack(tmp_path, str(ensure_tokenizer()), redis_server.url)
    stack.fleet = {**fleet, "tokenizer": stack.tokenizer, "replicas": []}
    try:
        for replica in fleet["replicas"]:
            stack.sim_command = [str(item) for item in services[replica["name"]]["command"]]
            stack.add_sim(replica["name"], stack.sim_command)
        stack.write_fleet()

        relay = [str(item) for item in services["relay"]["command"]]
        relay = replace_value(relay, "--replicas", str(stack.fleet_file))
        assert "--redis-url" not in relay  # the URL with its password comes from the environment
        relay_port = free_port()
        stack.relay_command = [*replace_value(relay, "--metrics-port", str(relay_port)), "--metrics-host", "127.0.0.1"]
        stack.start_relay()
        stack.relay_metrics = f"http://127.0.0.1:{relay_port}/metrics"

        for name in ("router-1", "router-2"):
            service = services[name]
            env = compose_environment(service)
            port = free_port()
            env |= {"KVROUTER_REDIS_URL": redis_server.url, "KVROUTER_PORT": str(port), "KVROUTER_HOST": "127.0.0.1"}
            # Provisional entries (a router's own just-routed prompts) lapse fast, so what the routers know of
            # each other's requests can only have come through the relay and Redis.
            env["KVROUTER_PROVISIONAL_TTL_S"] = str(PROVISIONAL_TTL_S)
            command = replace_value([str(item) for item in service["command"]], "--replicas", str(stack.fleet_file))
            stack.start(name, command, env)
            stack.routers.append(f"http://127.0.0.1:{port}")
        for replica in stack.fleet["replicas"]:
            wait_for(f"{replica['url']}/health", stack)
        for router in stack.routers:
            wait_for(f"{router}/ready", stack)
        wait_for(stack.relay_metrics, stack)
        yield stack
    finally:
        stack.stop()


SYSTEM = (
    "You are the assistant of a trading company in Osaka. Answer in polite business Japanese, cite the internal "
    "catalogue by item number, never promise delivery dates, and escalate complaints to a human. " * 12
)


async def ask(
    session: aiohttp.ClientSession, router: str, question: str, model: str, system: str = SYSTEM
) -> tuple[str, int]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 4,
    }
    async with session.post(f"{router}/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        answer = await response.json()
        cached = int(((answer.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        return response.headers["x-kvrouter-replica"], cached


async def until(condition: Callable[[], Awaitable[bool]], what: str, within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    while not await condition():
        assert time.monotonic() < deadline, f"{what} not seen within {within_s:.0f} s"
        await asyncio.sleep(0.05)


async def draining_everywhere(session: aiohttp.ClientSession, routers: list[str], expected: set[str]) -> None:
    """Wait until every router lists exactly `expected` as draining (a drain travels between them through Redis)."""

    async def agreed() -> bool:
        for router in routers:
            async with session.get(f"{router}/admin/replicas", headers=AUTH) as response:
                views = (await response.json())["replicas"]
            if {view["name"] for view in views if view["draining"]} != expected:
                return False
        return True

    await until(agreed, f"draining {sorted(expected)} on every router")


async def credited_everywhere(
    session: aiohttp.ClientSession, routers: list[str], replica: str, question: str, model: str, system: str,
    asked: float,
) -> None:  # fmt: skip
    """Wait until every router credits `replica` with cached tokens for this prompt once a router's own
    provisional entries have lapsed (KVROUTER_PROVISIONAL_TTL_S) since `asked`: credit only KV events, engine ->
    relay -> Redis -> router, can have given."""
    body = {"model": model, "max_tokens": 4,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}  # fmt: skip

    async def credited() -> bool:
        if time.monotonic() - asked <= PROVISIONAL_TTL_S:
            return False
        for router in routers:
            async with session.post(f"{router}/debug/route", json=body, headers=AUTH) as response:
                assert response.status == 200, await response.text()
                candidates = (await response.json())["candidates"]
            if not any(c["replica"] == replica and int(c["cached_tokens"]) > 0 for c in candidates):
                return False
        return True

    await until(credited, f"{replica}'s cached prefix on every router")


async def drain(session: aiohttp.ClientSession, router: str, replica: str, draining: bool) -> None:
    verb = "drain" if draining else "undrain"
    async with session.post(f"{router}/admin/replicas/{replica}/{verb}", headers=AUTH) as response:
        assert response.status == 200
        assert (await response.json())["shared"] is True


async def test_the_compose_sim_stack_routes_as_one(sim_stack: Stack) -> None:
    model = str(yaml.safe_load((DEPLOY / "replicas-sim.yaml").read_text(encoding="utf-8"))["model"])
    router_1, router_2 = sim_stack.routers
    async with aiohttp.ClientSession() as session:
        # Put the prefix on sim-1 (the replica a tie would not pick) by draining sim-0 for one request.
        await drain(session, router_1, "sim-0", True)
        await draining_everywhere(session, sim_stack.routers, {"sim-0"})  # through Redis to router-2 too
        first, _ = await ask(session, router_1, "question 0", model)
        assert first == "sim-1"
        asked = time.monotonic()
        await drain(session, router_2, "sim-0", False)
        await draining_everywhere(session, sim_stack.routers, set())
        await credited_everywhere(session, sim_stack.routers, "sim-1", "question 1", model, SYSTEM, asked)
        followers = []
        for turn in range(1, 7):
            followers.append(await ask(session, (router_2, router_1)[turn % 2], f"question {turn}", model))
        assert {replica for replica, _ in followers} == {"sim-1"}, followers
        assert all(cached > 0 for _, cached in followers), followers

        await drain(session, router_2, "sim-1", True)
        moved: set[str] = set()
        for _ in range(40):
            replica, _ = await ask(session, router_1, "after the drain", model)
            moved.add(replica)
            if replica != "sim-1":
                break
            await asyncio.sleep(0.1)
        assert "sim-0" in moved, "router-1 kept routing to the replica drained through router-2"
        async with session.get(sim_stack.relay_metrics) as response:
            assert "kvrouter_kv_events_total" in await response.text()

        # Add a replica live, as docs/runbook.md says: start it, list it, reload the routers, restart the relay.
        sim_stack.add_sim("sim-2", replace_value(sim_stack.sim_command, "--hash-seed", "2"))
        await asyncio.to_thread(wait_for, f"{sim_stack.fleet['replicas'][-1]['url']}/health", sim_stack)
        sim_stack.write_fleet()
        async with session.post(f"{router_1}/admin/reload", headers=AUTH) as response:
            answer = await response.json()
        assert answer["changes"]["added"] == ["sim-2"] and answer["shared"] is True, answer
        sim_stack.stop_service("relay")
        sim_stack.start_relay()
        await asyncio.to_thread(wait_for, sim_stack.relay_metrics, sim_stack)
        for _ in range(100):  # router-2 re-reads its file when router-1's reload reaches it through Redis
            async with session.get(f"{router_2}/admin/replicas", headers=AUTH) as response:
                listed = [view["name"] for view in (await response.json())["replicas"]]
            if "sim-2" in listed:
                break
            await asyncio.sleep(0.1)
        assert listed == ["sim-0", "sim-1", "sim-2"]
        # A new prefix lands on sim-2 (the only replica left undrained), then both routers find it there.
        await drain(session, router_1, "sim-0", True)
        await draining_everywhere(session, sim_stack.routers, {"sim-0", "sim-1"})
        other = "Tu es l'assistant d'un cabinet d'avocats a Lyon. Reponds brievement et cite les articles. " * 12
        assert (await ask(session, router_2, "premiere question", model, other))[0] == "sim-2"
        asked = time.monotonic()
        await drain(session, router_1, "sim-0", False)
        await drain(session, router_1, "sim-1", False)
        await draining_everywhere(session, sim_stack.routers, set())
        await credited_everywhere(session, sim_stack.routers, "sim-2", "question 0", model, other, asked)
        for turn in range(4):
            replica, cached = await ask(session, (router_1, router_2)[turn % 2], f"question {turn}", model, other)
            assert replica == "sim-2" and cached > 0, (turn, replica, cached)
