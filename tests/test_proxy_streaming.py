"""Header hygiene and reading usage from relayed bytes, without a network."""

from __future__ import annotations

import json

from multidict import CIMultiDict

from kvrouter.server.streaming import UsageScanner, cached_tokens_in_body, downstream_headers, upstream_headers


def sse(*payloads: object) -> bytes:
    return b"".join(b"data: " + json.dumps(p).encode() + b"\n\n" for p in payloads) + b"data: [DONE]\n\n"


CHUNK = {"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"}}]}
USAGE = {"id": "c", "choices": [], "usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}}


def test_usage_found_whatever_the_chunking() -> None:
    stream = sse(CHUNK, CHUNK, USAGE)
    for size in (1, 3, 7, 64, len(stream)):
        scanner = UsageScanner()
        for start in range(0, len(stream), size):
            scanner.feed(stream[start : start + size])
        scanner.close()
        assert scanner.cached_tokens == 32, size


def test_last_usage_wins_and_junk_is_ignored() -> None:
    early = {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 5}}}
    scanner = UsageScanner()
    scanner.feed(sse(early, CHUNK) + b'data: {"cached_tokens": broken\n\n')
    scanner.feed(sse(USAGE))
    scanner.close()
    assert scanner.cached_tokens == 32


def test_no_usage_no_details() -> None:
    scanner = UsageScanner()
    scanner.feed(sse(CHUNK, {"choices": [], "usage": {"prompt_tokens": 3, "prompt_tokens_details": None}}))
    scanner.close()
    assert scanner.cached_tokens is None
    unterminated = UsageScanner()
    unterminated.feed(b"data: " + json.dumps(USAGE).encode())
    unterminated.close()  # the stream ended without the blank line: still read
    assert unterminated.cached_tokens == 32


def test_cached_tokens_in_whole_body() -> None:
    assert cached_tokens_in_body(json.dumps(USAGE).encode()) == 32
    assert cached_tokens_in_body(b'{"usage": {"prompt_tokens": 1}}') is None
    assert cached_tokens_in_body(b'{"cached_tokens": ') is None
    bad = {"usage": {"prompt_tokens_details": {"cached_tokens": -1}}}
    assert cached_tokens_in_body(json.dumps(bad).encode()) is None


def test_headers_each_way() -> None:
    incoming = CIMultiDict(
        [
            ("Connection", "close, X-Hop"),
            ("X-Hop", "1"),
            ("Transfer-Encoding", "chunked"),
            ("Content-Length", "12"),
            ("Host", "router"),
            ("Authorization", "Bearer k"),
            ("X-Trace", "a"),
            ("X-Trace", "b"),
        ]
    )
    up = upstream_headers(incoming, incoming.items(), "rid", forward_authorization=False)
    assert sorted(up.items()) == [("X-Trace", "a"), ("X-Trace", "b"), ("x-request-id", "rid")]
    assert "Authorization" in upstream_headers(incoming, incoming.items(), "rid", forward_authorization=True)
    answer = CIMultiDict(
        [("Content-Type", "text/event-stream"), ("Transfer-Encoding", "chunked"), ("x-request-id", "x")]
    )
    down = downstream_headers(answer, answer.items(), "r1", "rid")
    assert dict(down) == {"Content-Type": "text/event-stream", "x-request-id": "rid", "x-kvrouter-replica": "r1"}
