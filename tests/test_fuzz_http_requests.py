"""Fuzz raw HTTP request lines and headers against a real `kvrouter` process (issue 15, hostile clients).

Cases are built from a grammar and mutated at the byte level: methods (known, unknown, lower-case, with odd
bytes), every target form (origin, absolute, authority, asterisk, odd escapes, huge), versions, bare LF / bare CR
line ends, header names and values with NULs, control bytes, obs-fold, UTF-8 and 0xff bytes, headers larger than
the field limit and more of them than the count limit, duplicated or conflicting Content-Length and
Transfer-Encoding, malformed chunked framing, Expect/Upgrade/Connection, content encodings that lie, truncated
requests. They go over raw TCP sockets from 32 concurrent clients (a connection is reused while the router keeps
it alive) to a router process in front of two healthy fake replicas.

Properties: no 5xx (the replicas are healthy, so any 5xx is the input's doing), no case left unanswered and open
past its bound, the process alive with its RSS bounded, and an honest request served afterwards. CI runs
10,000 cases (about 20 s here); KVROUTER_FUZZ_HTTP_REQUESTS sets the count, KVROUTER_FUZZ_HTTP_SEED the seed.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import ReplicaFactory
from tests.edge_support import edge_router
from tests.redis_fixtures import free_port

CASES = int(os.environ.get("KVROUTER_FUZZ_HTTP_REQUESTS", "10000"))
SEED = int(os.environ.get("KVROUTER_FUZZ_HTTP_SEED", "15"))
CLIENTS = 32
CASE_BOUND_S = 8.0
"""A case must be answered or its connection closed within this (the router's timeouts are 0.5 s here)."""
REPO = Path(__file__).resolve().parents[1]

METHODS = [b"GET", b"POST", b"HEAD", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"TRACE", b"CONNECT", b"PRI"]
ODD_METHODS = [b"get", b"FOO", b"G\x00T", b"", b"POST POST", b"A" * 300, b"\xff\xfe", b"GET\t", b"M-SEARCH"]
ORIGIN = [
    b"/health",
    b"/v1/models",
    b"/v1/completions",
    b"/v1/chat/completions",
    b"/debug/route",
    b"/tokenize",
    b"/v1/responses",
    b"/ready",
    b"/x/../health",
    b"//health",
    b"/health?x=1&y",
    b"/%00",
    b"/%ff%fe?%zz",
    b"/\xff\xfe",
    b"/a b",
    b"/" + b"a" * 9000,
    b"/v1/completions#frag",
    b"/v1/completions?" + b"q=" * 500,
]
OTHER_FORMS = [b"http://127.0.0.1/health", b"http://localhost:1/v1/models", b"127.0.0.1:1", b"health", b""]
VERSIONS = [b"HTTP/1.1"] * 24 + [b"HTTP/1.0", b"HTTP/0.9", b"HTTP/2.0", b"HTTP/1.2", b"http/1.1", b"HTTP/1.1 x", b""]
ODD_NAMES = [b"X Space", b"X\x00Nul", b"", b":", b"X\x7fDel", b"\xc3\xa9t\xc3\xa9", b"X:Colon", b"(x)", b"X\tTab"]
ODD_VALUES = [b"a\x00b", b"\xff\xfe", b"a\rb", b" lead", b"trail ", b"\x01\x02", b"\xe3\x81\x82", b"", b"a" * 70_000]
BODIES = [
    b'{"prompt": "hello", "max_tokens": 3}',
    b'{"messages": [{"role": "user", "content": "hi"}]}',
    b"",
    b"{",
    b"\x00\xff",
    b'{"prompt": [4294967296]}',
    b"[" * 5000,
]


@dataclass
class Case:
    method: bytes
    raw: bytes


@dataclass
class Tally:
    sent: int = 0
    answered: int = 0
    closed_unanswered: int = 0
    replica_5xx: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def headers_for(rng: random.Random, body: bytes) -> tuple[list[bytes], bytes]:
    """Header lines and the body bytes actually sent, with framing chosen (and sometimes broken) at random."""
    lines: list[bytes] = []
    if rng.random() < 0.9:
        lines.append(b"Host: " + rng.choice([b"127.0.0.1", b"x", b"", b"a" * 300, b"[::1]", b"h\x00"]))
    if rng.random() < 0.05:
        lines.append(b"Host: second")
    framing = rng.random()
    if framing < 0.45:
        lines.append(b"Content-Length: %d" % len(body))
    elif framing < 0.6:
        chunks = [body[i : i + 7] for i in range(0, len(body), 7)]
        body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
        lines.append(b"Transfer-Encoding: chunked")
    elif framing < 0.75:
        lines.extend(
            rng.choice(
                [
                    [b"Content-Length: %d" % len(body), b"Content-Length: %d" % len(body)],
                    [b"Content-Length: %d" % len(body), b"Content-Length: %d" % (len(body) + 1)],
                    [b"Content-Length: -1"],
                    [b"Content-Length: +%d" % len(body)],
                    [b"Content-Length: 0x10"],
                    [b"Content-Length: %d, %d" % (len(body), len(body))],
                    [b"Content-Length: 99999999999999999999999"],
                    [b"Content-Length: %d" % len(body), b"Transfer-Encoding: chunked"],
                    [b"Transfer-Encoding: chunked", b"Transfer-Encoding: chunked"],
                    [b"Transfer-Encoding: gzip, chunked"],
                    [b"Transfer-Encoding: chunked, gzip"],
                    [b"Transfer-Encoding: identity"],
                    [b"Transfer-Encoding: Chunked"],
                    [b"Transfer-Encoding: xchunked"],
                    [b"Transfer-Encoding:\x0bchunked"],
                    [b"Content-Length: %d" % (len(body) + 5)],  # promises more than it sends: the body timer
                ]
            )
        )
        if rng.random() < 0.5 and any(b"chunked" in line.lower() for line in lines):
            body = rng.choice([b"zz\r\nab\r\n0\r\n\r\n", b"5;ext=1\r\nhello\r\n0\r\nTrailer: x\r\n\r\n", b"3\r\nabc"])
    for _ in range(rng.choice([0, 0, 1, 2, 4])):
        if rng.random() < 0.5:
            lines.append(
                rng.choice([b"Accept: */*", b"User-Agent: fuzz", b"X-Request-Id: fuzz-1", b"Accept-Encoding: gzip"])
            )
            continue
        lines.append(
            rng.choice(
                [
                    b"Content-Type: application/json",
                    b"Content-Type: " + rng.choice(ODD_VALUES[:8]),
                    b"Connection: " + rng.choice([b"close", b"keep-alive", b"upgrade", b"close, x-foo", b"\x00"]),
                    b"Upgrade: " + rng.choice([b"websocket", b"h2c", b"\xff"]),
                    b"Expect: " + rng.choice([b"100-continue", b"200-ok", b""]),
                    b"Content-Encoding: " + rng.choice([b"gzip", b"deflate", b"br", b"zstd", b"gzip, gzip", b"x"]),
                    b"Authorization: " + rng.choice([b"Bearer", b"Bearer \xff", b"Basic x", b""]),
                    b"X-Request-Id: " + rng.choice(ODD_VALUES[:8]),
                    b"X-Folded: a\r\n b",
                    b"X-Folded-Tab: a\r\n\tb",
                    rng.choice(ODD_NAMES) + b": v",
                    b"X-Odd: " + rng.choice(ODD_VALUES),
                    b"No-Colon-Here",
                    b" Leading-Space: v",
                    b"Trailing-Space : v",
                ]
            )
        )
    if rng.random() < 0.01:
        lines.extend(b"X-Many-%d: v" % i for i in range(200))
    return lines, body


def make_case(rng: random.Random) -> Case:
    method = rng.choice(METHODS) if rng.random() < 0.92 else rng.choice(ODD_METHODS)
    target = rng.choice(ORIGIN) if rng.random() < 0.9 else rng.choice(OTHER_FORMS)
    version = rng.choice(VERSIONS)
    body = rng.choice(BODIES) if method in (b"POST", b"PUT", b"PATCH") or rng.random() < 0.1 else b""
    lines, body = headers_for(rng, body)
    eol = b"\r\n" if rng.random() < 0.97 else rng.choice([b"\n", b"\r", b"\r\r\n"])
    start = b" ".join(part for part in (method, target, version) if part or rng.random() < 0.5)
    raw = eol.join([start, *lines]) + eol + eol + body
    roll = rng.random()
    if roll < 0.03:
        raw = raw[: rng.randrange(1, len(raw) + 1)]  # truncated anywhere: the header or body timer ends it
    elif roll < 0.07:
        position = rng.randrange(len(raw))
        raw = raw[:position] + bytes([rng.randrange(256)]) + raw[position + 1 :]
    elif roll < 0.09:
        position = rng.randrange(len(raw))
        raw = raw[:position] + rng.choice([b"\x00", b"\r", b"\n", b"\r\n", b" ", b":"]) + raw[position:]
    return Case(method, raw)


async def read_answer(reader: asyncio.StreamReader, method: bytes) -> tuple[int, bool, bool] | None:
    """(status, keep-alive, relayed from a replica) of the final response to one case, or None if the router
    closed without one."""
    while True:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as error:
            return None if not error.partial.strip() else (-1, False, False)
        except (ConnectionError, asyncio.LimitOverrunError):
            return None
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else -1
        if 100 <= status < 200:
            continue
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().lower()
        keep_alive = lines[0].startswith(b"HTTP/1.1") and headers.get(b"connection") != b"close"
        relayed = b"x-kvrouter-replica" in headers
        if method == b"HEAD" or status in (204, 304):
            return status, False, relayed  # framing of a body-less answer is not worth guessing: new connection
        if b"content-length" in headers:
            await reader.readexactly(int(headers[b"content-length"]))
        elif headers.get(b"transfer-encoding") == b"chunked":
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
                await reader.readexactly(size + 2)
                if size == 0:
                    break
        else:
            await reader.read()
            keep_alive = False
        return status, keep_alive, relayed


async def client(port: int, cases: list[Case], tally: Tally) -> None:
    connection: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
    for case in cases:
        if connection is None:
            connection = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
        reader, writer = connection
        tally.sent += 1
        try:
            writer.write(case.raw)
            answer = await asyncio.wait_for(read_answer(reader, case.method), CASE_BOUND_S)
        except TimeoutError:
            tally.failures.append(f"hang: no answer and still open after {CASE_BOUND_S}s: {case.raw[:200]!r}")
            answer = (0, False, False)
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            answer = None
        if answer is None:
            tally.closed_unanswered += 1
            keep = False
        else:
            status, keep, relayed = answer
            tally.answered += 1
            tally.statuses[status] = tally.statuses.get(status, 0) + 1
            if status >= 500 and relayed:
                # The pass-through relays a replica's own answer unchanged: the fake replica's 500 on a deeply
                # nested /tokenize body is the replica's verdict, not the router's.
                tally.replica_5xx += 1
            elif status >= 500:
                tally.failures.append(f"{status} for {case.raw[:200]!r}")
        if not keep:
            writer.close()
            connection = None
    if connection is not None:
        connection[1].close()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def honest_ok(url: str) -> bool:
    body = {"prompt": "honest", "max_tokens": 2}
    async with aiohttp.ClientSession() as session, session.post(f"{url}/v1/completions", json=body) as response:
        await response.read()
        return response.status == 200


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the router's RSS from /proc")
async def test_raw_http_requests_never_5xx_hang_or_grow_the_router(
    tmp_path: Path, fake_replicas: ReplicaFactory
) -> None:
    replicas = await fake_replicas(2)
    config = tmp_path / "replicas.yaml"
    config.write_text("replicas:\n" + "".join(f"  - {{name: {r.name}, url: '{r.url}'}}\n" for r in replicas))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTER_")}
    env.update(
        KVROUTER_CLIENT_HEADER_TIMEOUT_S="0.5",
        KVROUTER_CLIENT_BODY_TIMEOUT_S="0.5",
        KVROUTER_CLIENT_IDLE_TIMEOUT_S="2",
        KVROUTER_MAX_BODY_BYTES="1048576",
        KVROUTER_HEALTH_INTERVAL_S="30",
        KVROUTER_METRICS_INTERVAL_S="30",
        KVROUTER_LOG_LEVEL="error",
    )
    log_path = tmp_path / "router.log"
    log_file = log_path.open("wb")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvrouter.cli", "--replicas", str(config), "--host", "127.0.0.1",
        "--port", str(port), "--policy", "round_robin", cwd=REPO, env=env, stderr=log_file,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(400):
            try:
                if await honest_ok(url):
                    break
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.05)
        else:
            raise AssertionError("router did not start")
        rng = random.Random(SEED)
        cases = [make_case(rng) for _ in range(CASES)]
        warm = Tally()
        await asyncio.gather(*(client(port, cases[i:200:CLIENTS], warm) for i in range(CLIENTS)))
        rss_before = rss_bytes(process.pid)
        tally = Tally()
        started = time.perf_counter()
        await asyncio.gather(*(client(port, cases[i::CLIENTS], tally) for i in range(CLIENTS)))
        elapsed = time.perf_counter() - started
        rss_after = rss_bytes(process.pid)
        summary = (
            f"{tally.sent} cases in {elapsed:.1f}s: {tally.answered} answered {sorted(tally.statuses.items())}, "
            f"{tally.closed_unanswered} closed unanswered, {tally.replica_5xx} replica 5xx relayed; "
            f"RSS {rss_before >> 20} -> {rss_after >> 20} MiB"
        )
        print(summary)
        for failure in tally.failures[:20]:
            print(failure)
        logged = log_path.read_text(errors="replace")
        assert process.returncode is None, f"the router died: {logged[-2000:]}"
        assert "Traceback" not in logged, logged[-4000:]
        assert not tally.failures, f"{len(tally.failures)} failures ({summary}); first: {tally.failures[:5]}"
        assert tally.sent == CASES
        assert rss_after < rss_before + 64 * 1024 * 1024, summary
        assert await honest_ok(url)
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 15.0)
            except TimeoutError:
                process.kill()
                await process.wait()
        log_file.close()


async def test_asterisk_targets_never_5xx(fake_replicas: ReplicaFactory) -> None:
    replicas = await fake_replicas(2)
    async with edge_router(replicas) as router:
        tally = Tally()
        cases = [Case(m, m + b" * HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n") for m in METHODS * 5]
        await asyncio.gather(*(client(router.port, cases[i::4], tally) for i in range(4)))
        assert not tally.failures, tally.failures[:5]
        assert await honest_ok(router.url)
