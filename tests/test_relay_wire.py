"""The streaming relay on the wire, byte for byte, and the per-read deadline of a replica's answer (ChunkReader).

Real sockets on 127.0.0.1 throughout: a raw replica that writes a vLLM-shaped SSE answer event by event, the router
in front of it, and a raw client that reads every byte the router sends.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvrouter.server.chunk_reads import ChunkReader
from tests.conftest import RouterFactory
from tests.faults_support import RawServer

EVENTS = [
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n',
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    b'"delta":{"content":"Hel"},"logprobs":null,"finish_reason":null}]}\n\n',
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    b'"delta":{"content":"lo"},"logprobs":null,"finish_reason":"stop","stop_reason":null}]}\n\n',
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":'
    b'{"prompt_tokens":40,"total_tokens":42,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":32}}}\n\n',
    b"data: [DONE]\n\n",
]
UPSTREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ndate: Fri, 04 Dec 2026 12:00:00 GMT\r\nserver: uvicorn\r\n"
    b"content-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
)


def framed(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def exchange(port: int, body: bytes) -> bytes:
    """Every byte the router sends for one request, up to the chunked terminator (or the connection's end)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        b"X-Request-Id: wire-1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    received = b""
    try:
        while not received.endswith(b"\r\n0\r\n\r\n"):
            data = await asyncio.wait_for(reader.read(65536), timeout=10)
            if not data:
                break
            received += data
    finally:
        writer.close()
    return received


def dechunk(body: bytes) -> list[bytes]:
    chunks = []
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert body == b"\r\n", "nothing may follow the terminator"
            return chunks
        chunks.append(body[:size])
        assert body[size : size + 2] == b"\r\n"
        body = body[size + 2 :]


FRAMED = [framed(event) for event in EVENTS]
PACINGS = {
    # Each event in its own write, 0.1 s apart, as an engine decodes: the router relays each as it comes.
    "event_by_event": [UPSTREAM_HEAD + FRAMED[0], *FRAMED[1:], b"0\r\n\r\n"],
    # The last event and the terminator in one write: the router sends them on in one write too.
    "end_with_last_event": [UPSTREAM_HEAD + FRAMED[0], *FRAMED[1:-1], FRAMED[-1] + b"0\r\n\r\n"],
    # Everything at once (how a fast engine's short answer can come): how many chunks the router reads it in is
    # up to the socket, so only the bytes are compared.
    "all_at_once": [UPSTREAM_HEAD + b"".join(FRAMED) + b"0\r\n\r\n"],
}


@pytest.mark.parametrize("pacing", list(PACINGS))
async def test_a_relayed_stream_reaches_the_client_as_the_replica_framed_it(
    make_router: RouterFactory, pacing: str
) -> None:
    replica = await RawServer("r0", PACINGS[pacing]).start()
    try:
        client = await make_router([replica], max_retries=0)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        received = await exchange(client.port, json.dumps(body).encode())
    finally:
        await replica.stop()
    head, _, rest = received.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    assert status == b"HTTP/1.1 200 OK"
    headers = [tuple(line.split(b": ", 1)) for line in lines]
    names = [name.lower() for name, _ in headers]
    assert sorted(names) == sorted(
        [b"date", b"server", b"content-type", b"transfer-encoding", b"x-kvrouter-replica", b"x-request-id"]
    ), names
    values = {name.lower(): value for name, value in headers}
    assert values[b"content-type"] == b"text/event-stream; charset=utf-8"
    assert values[b"transfer-encoding"] == b"chunked"
    assert values[b"x-kvrouter-replica"] == b"r0" and values[b"x-request-id"] == b"wire-1"
    # The replica's end-to-end headers cross as it sent them (aiohttp adds no Date or Server of its own then).
    assert values[b"date"] == b"Fri, 04 Dec 2026 12:00:00 GMT" and values[b"server"] == b"uvicorn"
    # The body: the events byte for byte (each in its own chunk where the replica wrote them apart), then the
    # terminator and nothing else.
    chunks = dechunk(rest)
    assert b"".join(chunks) == b"".join(EVENTS)
    if pacing != "all_at_once":
        assert chunks == EVENTS


async def reads_of(port: int, body: bytes) -> list[bytes]:
    """What the router sends for one request, read by read (a write 0.1 s apart from the next is its own read)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    reads: list[bytes] = []
    try:
        while not b"".join(reads).endswith(b"\r\n0\r\n\r\n"):
            data = await asyncio.wait_for(reader.read(65536), timeout=10)
            if not data:
                break
            reads.append(data)
    finally:
        writer.close()
    return reads


STREAM_BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()


async def test_done_goes_out_with_the_terminator_when_the_replica_writes_them_apart(make_router: RouterFactory) -> None:
    # The replica writes [DONE] and, 0.1 s later, its terminator: the router holds [DONE] for that read and sends
    # both in one write; every other event still goes out as it comes.
    replica = await RawServer("r0", PACINGS["event_by_event"]).start()
    try:
        client = await make_router([replica], max_retries=0)
        reads = await reads_of(client.port, STREAM_BODY)
    finally:
        await replica.stop()
    assert reads[-1] == FRAMED[-1] + b"0\r\n\r\n"
    assert dechunk(b"".join(reads).partition(b"\r\n\r\n")[2]) == EVENTS
    assert len(reads) == len(EVENTS), "one read per event, the last with the terminator"


async def test_what_follows_done_is_relayed_after_it(make_router: RouterFactory) -> None:
    # Not what an engine sends, but whatever comes after [DONE] reaches the client after it, unchanged.
    extra = b'data: {"late":true}\n\n'
    parts = [UPSTREAM_HEAD + FRAMED[0], FRAMED[-1], framed(extra), b"0\r\n\r\n"]
    replica = await RawServer("r0", parts).start()
    try:
        client = await make_router([replica], max_retries=0)
        received = await exchange(client.port, STREAM_BODY)
    finally:
        await replica.stop()
    assert dechunk(received.partition(b"\r\n\r\n")[2]) == [EVENTS[0], EVENTS[-1], extra]


async def test_a_stream_that_breaks_after_done_still_delivers_done_then_the_error(make_router: RouterFactory) -> None:
    # The replica sends [DONE] and closes without its terminator: the held [DONE] goes out, then the error event,
    # and the connection is cut without a terminator, as for any broken stream.
    replica = await RawServer("r0", [UPSTREAM_HEAD + FRAMED[0], FRAMED[-1]]).start()
    try:
        client = await make_router([replica], max_retries=0)
        received = await exchange(client.port, STREAM_BODY)
    finally:
        await replica.stop()
    body = received.partition(b"\r\n\r\n")[2]
    assert not body.endswith(b"\r\n0\r\n\r\n")
    events = b""
    while body:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        events += body[:size]
        body = body[size + 2 :]
    assert events.startswith(EVENTS[0] + EVENTS[-1] + b'data: {"error"')
    assert b"stream broke" in events


# -- ChunkReader: one deadline per read, one timer per answer ---------------------------------------------------


@pytest.fixture
async def paced_upstream() -> AsyncIterator[tuple[str, list[float]]]:
    """A real HTTP server whose /paced answer writes one chunk after each of the gaps in the list (seconds); the
    list is the test's to fill before it asks."""
    gaps: list[float] = []

    async def paced(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for number, gap in enumerate(gaps):
            await asyncio.sleep(gap)
            await response.write(b"chunk %d\n" % number)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/paced", paced)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("/paced")), gaps
    finally:
        await server.close()


async def read_all(reader: ChunkReader) -> list[bytes]:
    chunks = []
    while chunk := await reader.read():
        chunks.append(chunk)
    return chunks


async def test_each_read_has_its_own_deadline(paced_upstream: tuple[str, list[float]]) -> None:
    url, gaps = paced_upstream
    gaps[:] = [0.0, 0.15, 0.15, 0.15, 0.15]  # 0.6 s in all, every wait well under the 0.4 s deadline
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        reader = ChunkReader(response.content, 0.4)
        try:
            chunks = await read_all(reader)
        finally:
            reader.close()
    assert b"".join(chunks) == b"".join(b"chunk %d\n" % n for n in range(5))


async def test_a_read_that_waits_the_whole_deadline_fails_with_timeout(paced_upstream: tuple[str, list[float]]) -> None:
    url, gaps = paced_upstream
    gaps[:] = [0.0, 0.1, 3.0]
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        reader = ChunkReader(response.content, 0.4)
        try:
            got = b""
            while not got.endswith(b"chunk 1\n"):
                got += await reader.read()
            started = time.perf_counter()
            with pytest.raises(TimeoutError):
                await reader.read()
            waited = time.perf_counter() - started
            with pytest.raises(TimeoutError):
                await reader.read()  # the answer stays failed
        finally:
            reader.close()
    assert 0.35 < waited < 1.5, waited


async def test_time_between_reads_does_not_count(paced_upstream: tuple[str, list[float]]) -> None:
    url, gaps = paced_upstream
    gaps[:] = [0.0, 0.5, 0.9]  # chunks at 0, 0.5 and 1.4 s
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        reader = ChunkReader(response.content, 0.25)
        try:
            assert await reader.read() == b"chunk 0\n"
            # Busy elsewhere for longer than the deadline (a slow client): no read waits, so nothing expires; the
            # next read then waits ~0.1 s for chunk 1.
            await asyncio.sleep(0.4)
            assert await reader.read() == b"chunk 1\n"
            started = time.perf_counter()
            with pytest.raises(TimeoutError):
                await reader.read()  # chunk 2 comes 0.9 s after chunk 1, past the 0.25 s this read may wait
            assert time.perf_counter() - started < 0.8
        finally:
            reader.close()


async def test_buffered_takes_what_has_arrived_without_waiting(paced_upstream: tuple[str, list[float]]) -> None:
    url, gaps = paced_upstream
    gaps[:] = [0.0, 0.3]
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        reader = ChunkReader(response.content, 2.0)
        try:
            got = b""
            while not got:
                await asyncio.sleep(0.05)
                got = reader.buffered()
            assert got == b"chunk 0\n"
            assert reader.buffered() == b""  # chunk 1 is not here yet: no wait, nothing
            assert await reader.read() == b"chunk 1\n"
            assert await reader.read() == b""
            assert reader.at_end() and reader.buffered() == b""
        finally:
            reader.close()


@pytest.mark.parametrize(
    ("parts", "watches"), [(PACINGS["event_by_event"], 1), ([UPSTREAM_HEAD, *FRAMED, b"0\r\n\r\n"], 2)]
)
async def test_a_first_chunk_that_came_with_the_head_needs_no_first_byte_watch(
    make_router: RouterFactory, monkeypatch: pytest.MonkeyPatch, parts: list[bytes], watches: int
) -> None:
    # The head's wait is always watched; the first chunk's only when it was not already there with the head.
    from kvrouter.server.proxy import Proxy

    waits = []
    watched = Proxy._until_first_byte

    async def counting(self: Proxy, replica: object, pending: object) -> object:
        waits.append(replica)
        return await watched(self, replica, pending)  # type: ignore[arg-type]

    monkeypatch.setattr(Proxy, "_until_first_byte", counting)
    replica = await RawServer("r0", parts).start()
    try:
        client = await make_router([replica], max_retries=0)
        received = await exchange(client.port, STREAM_BODY)
    finally:
        await replica.stop()
    assert dechunk(received.partition(b"\r\n\r\n")[2]) == EVENTS
    assert len(waits) == watches
