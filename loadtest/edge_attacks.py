"""Two client-edge attacks against a `kvrouter` process, for before/after figures (docs/reliability.md).

* slow bodies: 600 clients send a 100 kB body at 1 byte/s to a router with max_concurrency 500, then 50 honest
  completions are sent one after another; prints their statuses.
* gzip bombs: six concurrent 1 MB gzip bodies that inflate to 1 GiB each; prints what each client got within 60 s
  and the router's peak RSS (VmHWM).

Run from the repository root: `python loadtest/edge_attacks.py [--checkout DIR]` (the router's code is taken from
DIR, default this checkout, so an older checkout gives the "before" figures; about 90 s).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fake_replica import FakeReplica  # noqa: E402


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_router(
    checkout: Path, replica_url: str, config: Path, **env_extra: str
) -> tuple[subprocess.Popen[bytes], int]:
    config.write_text(f"replicas:\n  - {{name: r0, url: '{replica_url}'}}\n")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTER_")}
    env.update(env_extra)
    command = [sys.executable, "-m", "kvrouter.cli", "--replicas", str(config), "--host", "127.0.0.1"]
    command += ["--port", str(port), "--log-level", "error"]
    return subprocess.Popen(command, cwd=checkout, env=env), port


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def slow_bodies(checkout: Path, config: Path) -> None:
    replica = FakeReplica("r0")
    await replica.start()
    process, port = start_router(checkout, replica.url, config, KVROUTER_MAX_CONCURRENCY="500")
    try:
        await asyncio.sleep(4)
        writers = []
        for _ in range(600):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{")
            writers.append(writer)

        async def trickle() -> None:
            while True:
                for writer in writers:
                    writer.write(b" ")
                await asyncio.sleep(1.0)

        trickling = asyncio.ensure_future(trickle())
        await asyncio.sleep(2)
        body = b'{"prompt": "hi", "max_tokens": 2}'
        statuses: dict[int, int] = {}
        started = time.perf_counter()
        for _ in range(50):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
            writer.write(head % len(body) + body)
            answer = await asyncio.wait_for(reader.read(), 30)
            status = int(answer.split(b" ")[1])
            statuses[status] = statuses.get(status, 0) + 1
            writer.close()
        print(
            f"slow bodies: 50 honest requests while 600 slow bodies trickle: {statuses} in "
            f"{time.perf_counter() - started:.1f}s"
        )
        trickling.cancel()
    finally:
        process.terminate()
        process.wait()
        await replica.stop()


async def gzip_bombs(checkout: Path, config: Path) -> None:
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    bomb = b"".join(packer.compress(b"\0" * (64 << 20)) for _ in range(16)) + packer.flush()
    process, port = start_router(checkout, "http://127.0.0.1:9", config)
    try:
        await asyncio.sleep(4)
        before = peak_rss_mib(process.pid)

        async def one() -> str:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n"
            writer.write(head % len(bomb) + bomb)
            try:
                answer = await asyncio.wait_for(reader.read(), 60)
                return answer[:12].decode(errors="replace") or "closed"
            except (ConnectionError, TimeoutError) as error:
                return type(error).__name__

        started = time.perf_counter()
        outcomes = await asyncio.gather(*(one() for _ in range(6)))
        print(
            f"gzip bombs: six {len(bomb)}-byte bombs -> {outcomes} in {time.perf_counter() - started:.1f}s; "
            f"router peak RSS {before:.0f} -> {peak_rss_mib(process.pid):.0f} MiB"
        )
    finally:
        process.terminate()
        process.wait()


async def attacks(checkout: Path, config: Path) -> None:
    await slow_bodies(checkout, config)
    await gzip_bombs(checkout, config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", type=Path, default=REPO)
    args = parser.parse_args()
    config = Path(f"/tmp/kvrouter-edge-attacks-{os.getpid()}.yaml")
    try:
        asyncio.run(attacks(args.checkout, config))
    finally:
        config.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
