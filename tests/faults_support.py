"""What the fault tests need beyond the shared fixtures: replicas as real processes (killed by PID), simulated
replicas as `kvrouter sim` processes (restarted on the same ports), raw TCP servers that hang or answer garbage,
and reading the router's own state.

Every process is started here and stopped by its own PID; nothing is killed by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from kvrouter.loadgen.fleet import free_port_range
from kvrouter.ports import fixed_port_window

ROOT = Path(__file__).resolve().parents[1]

_REPLICA_MAIN = """
import asyncio, json, sys
from tests.fake_replica import FakeBehaviour, FakeReplica

async def main() -> None:
    replica = FakeReplica(sys.argv[1], behaviour=FakeBehaviour(**json.loads(sys.argv[2])), port=int(sys.argv[3]))
    await replica.start()
    print(replica.port, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def _free_ports(count: int) -> int:
    """A base port with `count` free ports after it; a random start, so processes made one after another (before
    any of them binds) get different ports."""
    low, high = fixed_port_window()
    return free_port_range(count, start=random.randrange(low, high - 4 * count), end=high)


def _wait_http(url: str, process: subprocess.Popen[bytes], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{what} not ready at {url} within {timeout_s} s")


class ReplicaProcess:
    """A `tests.fake_replica.FakeReplica` in its own Python process, on a fixed port across restarts."""

    def __init__(self, name: str, **behaviour: Any) -> None:
        self.name = name
        self.behaviour = behaviour
        self.port = _free_ports(1)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ReplicaProcess:
        argv = [sys.executable, "-c", _REPLICA_MAIN, self.name, json.dumps(self.behaviour), str(self.port)]
        self.process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_http(self.url + "/health", self.process, 30, f"replica {self.name}")
        return self

    def kill(self) -> None:
        """SIGKILL by PID: the process dies at once, its sockets are reset by the kernel."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        self.process = None


class SimProcess:
    """`kvrouter sim --replicas 1` on fixed HTTP and KV-event ports, so a restart comes back at the same address."""

    def __init__(self, name: str, work: Path, *, block_size: int = 16) -> None:
        self.name = name
        self.work = work
        self.block_size = block_size
        self.base_port = _free_ports(4)
        self.process: subprocess.Popen[bytes] | None = None
        self.replicas_file = work / f"{name}.yaml"
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.base_port}"

    def start(self) -> SimProcess:
        argv = [
            sys.executable, "-m", "kvrouter.cli", "sim", "--replicas", "1", "--profile", "cpu-tiny",
            "--base-port", str(self.base_port), "--kv-base-port", str(self.base_port + 2),
            "--block-size", str(self.block_size), "--write-replicas", str(self.replicas_file), "--log-level", "warning",
        ]  # fmt: skip
        self.starts += 1
        log = (self.work / f"{self.name}-{self.starts}.log").open("wb")
        self.process = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        _wait_http(self.url + "/health", self.process, 60, f"sim {self.name}")
        deadline = time.monotonic() + 30
        while not self.replicas_file.is_file() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self

    def replica_entry(self) -> dict[str, Any]:
        document = yaml.safe_load(self.replicas_file.read_text())
        entry = dict(document["replicas"][0])
        entry["name"] = self.name
        return entry

    def tokenizer(self) -> str:
        return str(yaml.safe_load(self.replicas_file.read_text())["tokenizer"])

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        self.process = None


class RawServer:
    """A TCP server on 127.0.0.1 that reads a request and then does what `answer` says: bytes to send then close
    (a list: sent part by part, 0.1 s apart), or None to hold the connection open and send nothing."""

    def __init__(self, name: str, answer: bytes | list[bytes] | None) -> None:
        self.name = name
        self.answer = answer
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._held: list[asyncio.StreamWriter] = []
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> RawServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        with contextlib.suppress(Exception):
            await reader.readuntil(b"\r\n\r\n")
        if self.answer is None:
            self._held.append(writer)
            return
        parts = [self.answer] if isinstance(self.answer, bytes) else self.answer
        with contextlib.suppress(ConnectionError):
            for number, part in enumerate(parts):
                if number:
                    await asyncio.sleep(0.1)
                writer.write(part)
                await writer.drain()
        writer.close()

    async def stop(self) -> None:
        for writer in self._held:
            writer.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")
