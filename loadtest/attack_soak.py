"""Mixed-attack soak: honest clients through one kvrouter while slow clients, hostile KV events and poison requests
hit it at the same time. Loopback only; every attack is bounded in count and time and stops by itself.

One simulated fleet (`kvrouter sim`, 3 replicas publishing KV events) and one kv_aware router in front of it, as
child processes. A fourth replica entry, `hostile`, points at the third replica's HTTP server but takes its KV
events from a publisher this script binds, so the router follows a compromised or broken engine's event stream.
Two phases of `--duration` seconds each, on the same router, honest traffic identical in shape (the attack phase
uses other system prompts, so neither phase finds the other's prefixes cached):

1. attack-free: honest clients only — open-loop streaming chat requests at `--rate`/s, shared system prompts;
2. under attack: the same honest load, plus
   * slow clients: `--slow` connections each trickling request headers, `--slow` trickling a body that announces
     1 MB, `--slow` sitting idle on a keep-alive connection; each reconnects when the router drops it;
   * poison requests, one every `--poison-every` seconds, cycling through: `OPTIONS *`, an absolute-form target,
     a pass-through to an engine control path (`/reset_prefix_cache`), a 2M-character prompt, a gzip bomb
     (1 MB that inflates to 256 MB), a JSON nesting bomb, token ids >= 2**32, broken JSON;
   * hostile KV events on `hostile`'s stream, ~`--event-rate` messages/s: engine-hash reuse across different
     tokens, removal of unknown blocks, ranks -1 and in the thousands, clears in the middle of chains, sequence
     numbers jumping and going backwards, random bytes, wrong frame counts, and a 32 MB message every 2 s.

Then a short honest check shows the router still serves. Pass: honest requests of the attack phase >= 99% OK,
their TTFT p99 within `--max-ttft-ratio` (2) of the attack-free phase's, no poison request answered 5xx, the router
alive, its RSS peak under `--max-rss-mb`. Prints a summary; `--json` writes it for docs/reliability.md.
Exit 0 on pass, 1 on fail. Run from the repository root: `python loadtest/attack_soak.py` (2 x 60 s);
`--duration 15` is the CI-sized run (tests/test_attack_soak.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import io
import json
import multiprocessing
import random
import socket
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import yaml
import zmq
import zmq.asyncio

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from soak import WORDS, rss_mb  # noqa: E402  (loadtest/soak.py: the same words and the same RSS reading)

from kvrouter.loadgen.fleet import free_port_range, start_kvrouter, start_sim  # noqa: E402

HOSTILE = "hostile"


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


@dataclass
class Honest:
    sent: int = 0
    ok: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    ttft_s: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, object]:
        p50, p99 = percentile(self.ttft_s, 0.5), percentile(self.ttft_s, 0.99)
        return {
            "sent": self.sent,
            "ok": self.ok,
            "success": round(self.ok / self.sent, 4) if self.sent else None,
            "failures": dict(self.failures),
            "ttft_p50_s": None if p50 is None else round(p50, 4),
            "ttft_p99_s": None if p99 is None else round(p99, 4),
        }


@dataclass
class Attack:
    poison: Counter[str] = field(default_factory=Counter)
    """`kind status` -> count."""
    poison_5xx: Counter[str] = field(default_factory=Counter)
    slow_connections: int = 0
    slow_dropped_by_router: int = 0
    event_messages: int = 0
    event_bytes: int = 0


# ---- honest clients -----------------------------------------------------------------------------------------


def honest_body(rng: random.Random, prefixes: list[str]) -> dict[str, object]:
    history = [
        {"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(5, 40)))}
        for _ in range(rng.randint(1, 3))
    ]
    return {
        "model": "sim",
        "messages": [{"role": "system", "content": rng.choice(prefixes)}, *history],
        "max_tokens": rng.randint(4, 24),
        "stream": True,
    }


async def honest_request(session: aiohttp.ClientSession, url: str, body: dict[str, object], out: Honest) -> None:
    started = time.perf_counter()
    first: float | None = None
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=60)) as response:
            tail = b""
            async for chunk in response.content.iter_any():
                if first is None and b"data: " in chunk:
                    first = time.perf_counter() - started
                tail = (tail + chunk)[-64:]
            if response.status != 200:
                out.failures[f"status {response.status}"] += 1
            elif first is None or not tail.rstrip().endswith(b"data: [DONE]"):
                out.failures["stream without [DONE]"] += 1
            else:
                out.ok += 1
                out.ttft_s.append(first)
    except TimeoutError:
        out.failures["timeout"] += 1
    except aiohttp.ClientError as error:
        out.failures[type(error).__name__] += 1


async def honest_load(url: str, *, duration_s: float, rate: float, seed: int, words: int = 300) -> Honest:
    rng = random.Random(seed)
    prefixes = [
        f"System prompt {seed}-{n}: " + " ".join(rng.choices(WORDS, k=rng.randint(words // 2, words * 3 // 2)))
        for n in range(8)
    ]
    out = Honest()
    tasks: set[asyncio.Task[None]] = set()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        n = 0
        while (now := time.perf_counter() - start) < duration_s:
            due = n / rate
            if due > now:
                await asyncio.sleep(due - now)
                continue
            task = asyncio.create_task(honest_request(session, url, honest_body(rng, prefixes), out))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            out.sent += 1
            n += 1
        if tasks:
            await asyncio.wait(tasks, timeout=90)
    return out


# ---- slow clients -------------------------------------------------------------------------------------------


async def slow_client(port: int, mode: str, until: float, attack: Attack) -> None:
    """One attacker connection at a time, reconnecting whenever the router drops it, until `until`."""
    loop = asyncio.get_running_loop()
    while loop.time() < until:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.5)
            continue
        attack.slow_connections += 1
        try:
            if mode == "headers":
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\n")
                trickle = b"X-Slow: " + b"a" * 4000 + b"\r\n"
            elif mode == "body":
                writer.write(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 1000000\r\n\r\n"
                )
                trickle = b'{"messages": [' + b" " * 4000
            else:  # idle keep-alive after one cheap request
                writer.write(b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n")
                trickle = b""
            await writer.drain()
            position = 0
            while loop.time() < until:
                if trickle:
                    writer.write(trickle[position % len(trickle) : position % len(trickle) + 1])
                    position += 1
                    await writer.drain()
                # The router's answer, or its closing the connection, ends this connection.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        data = await reader.read(65536)
                        if not data:
                            attack.slow_dropped_by_router += 1
                            break
        except (ConnectionError, OSError):
            attack.slow_dropped_by_router += 1
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()


# ---- poison requests ----------------------------------------------------------------------------------------


def gzip_bomb(inflated_bytes: int) -> bytes:
    buffer = io.BytesIO()
    zeros = b"\0" * (1 << 20)
    with gzip.GzipFile(fileobj=buffer, mode="wb", compresslevel=9) as bomb:
        for _ in range(inflated_bytes >> 20):
            bomb.write(zeros)
    return buffer.getvalue()


def poison_requests() -> list[tuple[str, bytes]]:
    """(kind, the raw HTTP request) — each is the client's fault and deserves a 4xx, never a 5xx."""

    def post(path: str, body: bytes, extra: str = "") -> bytes:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        return head.encode() + body

    huge_prompt = json.dumps({"model": "sim", "prompt": "word " * 400_000, "max_tokens": 1}).encode()
    nesting = b'{"model": "sim", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    wide_ids = json.dumps({"model": "sim", "prompt": [2**40, 1, 2], "max_tokens": 1}).encode()
    return [
        ("options-asterisk", b"OPTIONS * HTTP/1.1\r\nHost: router\r\nConnection: close\r\n\r\n"),
        ("absolute-form", b"GET http://127.0.0.1:9/v1/models HTTP/1.1\r\nHost: router\r\nConnection: close\r\n\r\n"),
        ("engine-control-path", post("/reset_prefix_cache", b"")),
        ("huge-prompt", post("/v1/completions", huge_prompt)),
        ("gzip-bomb", post("/v1/chat/completions", gzip_bomb(256 << 20), "Content-Encoding: gzip\r\n")),
        ("nesting-bomb", post("/v1/chat/completions", nesting)),
        ("token-ids-over-32-bits", post("/v1/completions", wide_ids)),
        ("broken-json", post("/v1/chat/completions", b'{"messages": [')),
    ]


async def send_raw(port: int, raw: bytes, timeout_s: float = 30.0) -> int:
    """The status of the router's answer to `raw`; 0 when the router closed without one (fine for an attacker)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        async with asyncio.timeout(timeout_s):
            line = await reader.readline()
        parts = line.split()
        return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else 0
    except (ConnectionError, OSError):
        return 0
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()


async def poison_loop(
    port: int, until: float, every_s: float, attack: Attack, requests: list[tuple[str, bytes]]
) -> None:
    loop = asyncio.get_running_loop()
    turn = 0
    pending: set[asyncio.Task[None]] = set()

    async def one(kind: str, raw: bytes) -> None:
        try:
            status = await send_raw(port, raw)
        except TimeoutError:
            status = -1  # the router held the attacker: reported, not a 5xx
        attack.poison[f"{kind} {status}"] += 1
        if status >= 500:
            attack.poison_5xx[f"{kind} {status}"] += 1

    while loop.time() < until:
        kind, raw = requests[turn % len(requests)]
        turn += 1
        task = asyncio.create_task(one(kind, raw))
        pending.add(task)
        task.add_done_callback(pending.discard)
        await asyncio.sleep(every_s)
    if pending:
        await asyncio.wait(pending, timeout=40)


# ---- hostile KV events --------------------------------------------------------------------------------------


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> dict[str, object]:
    return {
        "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
        "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None,
        "extra_keys": None, "group_idx": 0, "kv_cache_spec_kind": "full_attention",
    }  # fmt: skip


def hostile_messages(rng: random.Random, topic: bytes, seq: int) -> list[list[bytes]]:
    """One round of adversarial messages; `seq` is where this round's sequence numbers start."""

    def message(events: list[dict[str, object]], rank: int = 0, at: int | None = None) -> list[bytes]:
        payload = msgspec.msgpack.encode([time.time(), events, rank])
        return [topic, (seq if at is None else at).to_bytes(8, "big"), payload]

    chain = [rng.getrandbits(63) for _ in range(8)]
    tokens = [rng.randrange(8192) for _ in range(16 * len(chain))]
    other = [rng.randrange(8192) for _ in range(16 * len(chain))]
    rounds = [
        message([stored(chain, None, tokens)]),
        message([stored(chain, None, other)]),  # the same engine hashes for different tokens
        message([{"type": "BlockRemoved", "block_hashes": [rng.getrandbits(63) for _ in range(50)], "medium": "GPU"}]),
        message([stored(chain[4:], chain[3], tokens[64:])], rank=-1),
        message([stored(chain[:2], None, tokens[:32])], rank=rng.randrange(2, 5000)),
        message([{"type": "BlockRemoved", "block_hashes": chain[3:5], "medium": "GPU"}]),
        message([{"type": "AllBlocksCleared"}, stored(chain[5:], chain[4], tokens[80:])]),
        message([stored([rng.getrandbits(63)], rng.getrandbits(63), tokens[:16])]),  # a parent never stored
        message([stored(chain, None, tokens)], at=seq + rng.randrange(2, 1000)),  # a gap
        message([stored(chain, None, tokens)], at=max(0, seq - rng.randrange(1, 50))),  # seq going backwards
        [topic, rng.randbytes(rng.randrange(0, 12)), rng.randbytes(rng.randrange(0, 200))],
        [rng.randbytes(20)],
        [topic, seq.to_bytes(8, "big"), rng.randbytes(rng.randrange(1, 400))],
    ]
    return rounds


async def hostile_publisher(endpoint: str, until: float, rate: float, seed: int, attack: Attack) -> None:
    context = zmq.asyncio.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 100_000)
    pub.bind(endpoint)
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    topic = b"kv-events"
    big = [stored([n], n - 1 if n else None, [7] * 16) for n in range(170_000)]  # ~32 MB encoded
    big_payload = msgspec.msgpack.encode([time.time(), big, 0])
    seq = 0
    next_big = loop.time() + 2.0
    try:
        while loop.time() < until:
            batch = hostile_messages(rng, topic, seq)
            seq += len(batch)
            if loop.time() >= next_big:
                batch.append([topic, seq.to_bytes(8, "big"), big_payload])
                seq += 1
                next_big += 2.0
            for frames in batch:
                await pub.send_multipart(frames)
                attack.event_messages += 1
                attack.event_bytes += sum(len(frame) for frame in frames)
            await asyncio.sleep(len(batch) / rate)
    finally:
        pub.close(0)
        context.term()


# ---- the run ------------------------------------------------------------------------------------------------


async def sample_rss(pid: int, until: float, peak: list[float]) -> None:
    loop = asyncio.get_running_loop()
    while loop.time() < until:
        rss = rss_mb(pid)
        if rss is not None:
            peak.append(rss)
        await asyncio.sleep(0.5)


async def attacks(port: int, args: argparse.Namespace, hostile_endpoint: str) -> Attack:
    """Every attack of the phase, until its end; runs in a process of its own (`attack_process`)."""
    poison = poison_requests()  # built before the clock starts (the gzip bomb takes ~1 s)
    if args.poison_kinds:
        poison = [(kind, raw) for kind, raw in poison if kind in args.poison_kinds.split(",")]
    until = asyncio.get_running_loop().time() + args.duration
    attack = Attack()
    kinds = set(args.attacks.split(","))
    work = []
    if "slow" in kinds:
        modes = ("headers", "body", "idle")
        work += [slow_client(port, mode, until, attack) for mode in modes for _ in range(args.slow)]
    if "poison" in kinds:
        work.append(poison_loop(port, until, args.poison_every, attack, poison))
    if "events" in kinds:
        work.append(hostile_publisher(hostile_endpoint, until, args.event_rate, args.seed, attack))
    await asyncio.gather(*work)
    return attack


def attack_process(port: int, args: argparse.Namespace, hostile_endpoint: str, out: Connection) -> None:
    out.send(asyncio.run(attacks(port, args, hostile_endpoint)))
    out.close()


async def run_phase(
    port: int, pid: int, args: argparse.Namespace, *, attacked: bool, hostile_endpoint: str
) -> tuple[Honest, Attack, float]:
    """One phase: the honest load here, the attacks (if any) in a second process, so that the honest clients'
    timings are the router's and not those of an event loop busy sending attacks."""
    attack = Attack()
    attacker = None
    if attacked:
        receive, send = multiprocessing.get_context("spawn").Pipe(duplex=False)
        attacker = multiprocessing.get_context("spawn").Process(
            target=attack_process, args=(port, args, hostile_endpoint, send), daemon=True
        )
        attacker.start()
        await asyncio.sleep(2.0)  # the attacker builds its poison (the gzip bomb) and its sockets first
    until = asyncio.get_running_loop().time() + args.duration
    rss: list[float] = []
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    sampler = asyncio.create_task(sample_rss(pid, until + 5, rss))
    honest = await honest_load(
        url, duration_s=args.duration, rate=args.rate, seed=args.seed + (1 if attacked else 0), words=args.system_words
    )
    if attacker is not None:
        if await asyncio.to_thread(receive.poll, 120):
            attack = receive.recv()
        attacker.join(timeout=10)
        if attacker.is_alive():
            attacker.kill()
    await sampler
    return honest, attack, max(rss, default=0.0)


def attack_kinds(phases: dict[str, Any]) -> set[str]:
    """Poison kinds the router answered (status 0: closed without an answer; -1: held past the client's patience)."""
    poison = phases["under_attack"]["attack"]["poison"]
    return {kind.rsplit(" ", 1)[0] for kind in poison if not kind.endswith((" 0", " -1"))}


def fleet_with_hostile(replicas_file: Path, hostile_endpoint: str) -> None:
    fleet = yaml.safe_load(replicas_file.read_text(encoding="utf-8"))
    last = fleet["replicas"][-1]
    fleet["replicas"].append({"name": HOSTILE, "url": last["url"], "kv_events": {"endpoint": hostile_endpoint}})
    replicas_file.write_text(yaml.safe_dump(fleet), encoding="utf-8")


def free_tcp_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per phase (default 60)")
    parser.add_argument("--rate", type=float, default=8.0, help="honest requests per second (default 8)")
    parser.add_argument("--slow", type=int, default=100, help="slow connections per kind (default 100)")
    parser.add_argument("--poison-every", type=float, default=0.1, help="seconds between poison requests")
    parser.add_argument("--event-rate", type=float, default=300.0, help="hostile event messages per second")
    parser.add_argument("--attacks", default="slow,poison,events", help="which attacks run (default all three)")
    parser.add_argument("--poison-kinds", default="", help="only these poison kinds (default: all eight)")
    parser.add_argument("--max-concurrency", type=int, default=64, help="the router's max_concurrency (default 64)")
    parser.add_argument("--max-ttft-ratio", type=float, default=2.0, help="attack / attack-free TTFT p99 allowed")
    parser.add_argument("--max-rss-mb", type=float, default=1024.0, help="router RSS peak allowed (MB)")
    parser.add_argument("--profile", default="cpu-tiny", help="simulator profile (default cpu-tiny)")
    parser.add_argument("--system-words", type=int, default=300, help="words per shared system prompt")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="write the summary here")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="kvrouter-attack-") as tmp:
        work = Path(tmp)
        replicas_file = work / "replicas.yaml"
        sim = start_sim(replicas=3, profile=args.profile, replicas_file=replicas_file, log=work / "sim.log")
        router = None
        try:
            hostile_endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
            fleet_with_hostile(replicas_file, hostile_endpoint)
            port = free_port_range(1)
            extra = ["--max-concurrency", str(args.max_concurrency)]
            router = start_kvrouter(replicas_file, port, "kv_aware", work / "router.log", extra=extra)
            pid = router.process.pid
            phases: dict[str, Any] = {}
            for name, attacked in (("attack_free", False), ("under_attack", True)):
                honest, attack, rss_peak = asyncio.run(
                    run_phase(port, pid, args, attacked=attacked, hostile_endpoint=hostile_endpoint)
                )
                phases[name] = {"honest": honest.summary(), "rss_peak_mb": round(rss_peak, 1)}
                if attacked:
                    phases[name]["attack"] = {
                        "poison": dict(sorted(attack.poison.items())),
                        "poison_5xx": dict(attack.poison_5xx),
                        "slow_connections": attack.slow_connections,
                        "slow_dropped_by_router": attack.slow_dropped_by_router,
                        "event_messages": attack.event_messages,
                        "event_mb": round(attack.event_bytes / 2**20, 1),
                    }
                print(f"{name}: {json.dumps(phases[name])}", flush=True)
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            after = asyncio.run(honest_load(url, duration_s=3, rate=5, seed=99))
            router_alive = router.alive()
            log_tail = router.log_tail(20)
        finally:
            if router is not None:
                router.stop()
            sim.child.stop()
    base, hit = phases["attack_free"]["honest"], phases["under_attack"]["honest"]
    ratio = None
    if isinstance(base["ttft_p99_s"], float) and isinstance(hit["ttft_p99_s"], float) and base["ttft_p99_s"] > 0:
        ratio = round(hit["ttft_p99_s"] / base["ttft_p99_s"], 3)
    checks = {
        "honest_success_under_attack_ge_99pct": isinstance(hit["success"], float) and hit["success"] >= 0.99,
        "ttft_p99_ratio_within_limit": ratio is not None and ratio <= args.max_ttft_ratio,
        "no_poison_5xx": not phases["under_attack"]["attack"]["poison_5xx"],
        "every_attack_ran": all(
            (
                kind != "poison"
                or len(attack_kinds(phases)) == len(args.poison_kinds.split(",") if args.poison_kinds else range(8))
            )
            and (kind != "events" or phases["under_attack"]["attack"]["event_messages"] > 0)
            and (kind != "slow" or phases["under_attack"]["attack"]["slow_connections"] > 0)
            for kind in args.attacks.split(",")
        ),
        "router_alive": router_alive,
        "serves_after": after.ok == after.sent > 0,
        "rss_bounded": max(p["rss_peak_mb"] for p in phases.values()) <= args.max_rss_mb,
    }
    summary = {"phases": phases, "ttft_p99_ratio": ratio, "after": after.summary(), "checks": checks}
    summary["passed"] = all(checks.values())
    print(json.dumps(summary, indent=2))
    if not router_alive:
        print(log_tail, file=sys.stderr)
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
