"""A real redis-server for tests: Debian's binary on a free 127.0.0.1 port in a temporary directory.

`RedisServer` starts, kills (SIGKILL, like a crash) and restarts one server by PID, with or without persistence
(append-only file fsynced on every write, so "restarted with its data" means exactly the data written). Test
modules import the fixtures: ``from tests.redis_fixtures import redis_server, redis_server_persistent``.
Tests are skipped with a clear reason when no ``redis-server`` binary is on PATH.

Access: ``password`` starts it with ``--requirepass`` (the URL carries it); ``tls`` (from `make_tls`, which runs
the ``openssl`` CLI to make a CA and a server certificate for 127.0.0.1) serves TLS only (``--port 0``) and the
URL becomes ``rediss://...?ssl_ca_certs=<ca>&ssl_cert_reqs=required``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from tests.shared_data import ci_tool


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path


def make_tls(directory: Path) -> TlsFiles:
    """A throw-away CA and a server certificate for 127.0.0.1 (IP SAN), made with the openssl CLI."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl CLI is not installed")
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = directory / "ca.pem", directory / "ca.key"
    cert, key, csr = directory / "server.pem", directory / "server.key", directory / "server.csr"
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca), "-days", "2",
        "-subj", "/CN=kvrouter-test-ca")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial", "-out",
        str(cert), "-days", "2", "-extfile", str(ext))  # fmt: skip
    return TlsFiles(ca, cert, key)


class RedisServer:
    """One redis-server process this test owns; `url` stays the same across restarts."""

    def __init__(
        self,
        directory: Path,
        *,
        persistent: bool = False,
        port: int | None = None,
        password: str | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        self.binary = ci_tool("redis-server", "redis-server")
        self.directory = directory
        self.persistent = persistent
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.password = password
        self.tls = tls
        directory.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return self.url_with(self.password)

    def url_with(self, password: str | None, *, user: str = "") -> str:
        """The URL with these credentials (None: none at all), TLS options included when it serves TLS."""
        credentials = f"{user}:{quote(password, safe='')}@" if password is not None else ""
        if self.tls is None:
            return f"redis://{credentials}127.0.0.1:{self.port}/0"
        return f"rediss://{credentials}127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls.ca}&ssl_cert_reqs=required"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def command(self) -> list[str]:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.directory),
            "--daemonize",
            "no",
            "--save",
            "",
            "--protected-mode",
            "yes",
            "--loglevel",
            "warning",
            "--logfile",
            str(self.directory / "redis.log"),
        ]
        if self.persistent:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        if self.password is not None:
            args += ["--requirepass", self.password]
        if self.tls is not None:
            args[1:3] = ["--port", "0", "--tls-port", str(self.port)]
            args += ["--tls-cert-file", str(self.tls.cert), "--tls-key-file", str(self.tls.key),
                     "--tls-ca-cert-file", str(self.tls.ca), "--tls-auth-clients", "no"]  # fmt: skip
        return args

    def start(self, timeout_s: float = 10.0) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        self.process = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                log = (self.directory / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server exited with {self.process.returncode}: {log}")
            if self._answers_ping():
                return
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING within {timeout_s}s")

    def _answers_ping(self) -> bool:
        """PONG, or NOAUTH from a server that wants a password: either way it serves."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw:
                conn = raw
                if self.tls is not None:
                    context = ssl.create_default_context(cafile=str(self.tls.ca))
                    conn = context.wrap_socket(raw, server_hostname="127.0.0.1")
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL by PID: no shutdown save, like a crash or an OOM kill."""
        if self.process is None:
            return
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        self.process = None

    def wipe(self) -> None:
        """Forget the data on disk, so the next start comes back empty."""
        for name in os.listdir(self.directory):
            if name.startswith(("appendonly", "dump")):
                path = self.directory / name
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink()

    def restart(self, *, keep_data: bool = True) -> None:
        self.kill()
        if not keep_data:
            self.wipe()
        self.start()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        self.process = None


@contextlib.contextmanager
def running_redis(directory: Path, **options: Any) -> Iterator[RedisServer]:
    """A started `RedisServer(directory, **options)`, killed on the way out (the fixtures below and tests that
    need another kind: a password, TLS)."""
    server = RedisServer(directory, **options)
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server without persistence: a restart comes back empty."""
    with running_redis(tmp_path / "redis", persistent=False) as server:
        yield server


@pytest.fixture
def redis_server_persistent(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server with an fsync-always append-only file: a restart comes back with every write."""
    with running_redis(tmp_path / "redis-aof", persistent=True) as server:
        yield server
