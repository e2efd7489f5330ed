"""What the proxy does to bytes on their way through: header hygiene and reading usage without re-encoding.

Bodies are relayed as the replica sent them; this module only decides which headers cross (hop-by-hop headers
never do, nor the client's Authorization unless `forward_authorization`), and reads the engine's reported
`usage.prompt_tokens_details.cached_tokens` — from a whole JSON body, or from the SSE events of a stream as they
pass (`UsageScanner`), so the router can compare what it predicted with what the engine served from cache.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import aiohttp
from multidict import CIMultiDict

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
# Recomputed by aiohttp for the hop it writes; copying them would contradict the framing it chooses.
_FRAMING = frozenset({"content-length", "host"})
REPLICA_HEADER = "x-kvrouter-replica"
REQUEST_ID_HEADER = "x-request-id"
_CACHED_TOKENS = b'"cached_tokens"'
_MAX_PENDING_EVENT = 1 << 20
"""The most bytes `UsageScanner` holds of one unfinished event: its memory is bounded whatever a replica sends."""
REDIRECTS = frozenset({301, 302, 303, 307, 308})
"""Redirect answers; the proxy never follows them (every upstream call passes allow_redirects=False)."""


class BodyTooLarge(Exception):
    """A replica's body went past the byte bound the caller set; what was read so far is dropped."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"body larger than {limit} bytes")
        self.limit = limit


async def read_capped(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body, read incrementally and abandoned as soon as it passes `limit` bytes (`BodyTooLarge`).

    A declared Content-Length over the limit is refused before any byte is read; an undeclared or lying one is
    caught by counting, so a replica can never make the router hold more than `limit` (+ one read) bytes.
    """
    if response.content_length is not None and response.content_length > limit:
        raise BodyTooLarge(limit)
    parts: list[bytes] = []
    size = 0
    while True:
        chunk = await response.content.readany()
        if not chunk:
            return b"".join(parts)
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        parts.append(chunk)


def _connection_listed(headers: Mapping[str, str]) -> frozenset[str]:
    listed = headers.get("connection")
    if not listed:
        return frozenset()
    return frozenset(token.strip().lower() for token in listed.split(",") if token.strip())


def _end_to_end(items: Iterable[tuple[str, str]], named: frozenset[str]) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in items:
        lower = name.lower()
        if lower in HOP_BY_HOP or lower in _FRAMING or lower in named:
            continue
        out.add(name, value)
    return out


def upstream_headers(
    incoming: Mapping[str, str], items: Iterable[tuple[str, str]], request_id: str, *, forward_authorization: bool
) -> CIMultiDict[str]:
    """Headers for the replica: the client's end-to-end headers plus the request id."""
    out = _end_to_end(items, _connection_listed(incoming))
    if not forward_authorization:
        out.popall("authorization", None)
    out[REQUEST_ID_HEADER] = request_id
    return out


def downstream_headers(
    incoming: Mapping[str, str], items: Iterable[tuple[str, str]], replica: str, request_id: str
) -> CIMultiDict[str]:
    """Headers for the client: the replica's end-to-end headers, the chosen replica and the request id."""
    out = _end_to_end(items, _connection_listed(incoming))
    out[REPLICA_HEADER] = replica
    out[REQUEST_ID_HEADER] = request_id
    return out


def cached_tokens_of(payload: Any) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` of a decoded response object, when the engine reported it."""
    if not isinstance(payload, dict):
        return None
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        return None
    cached = details.get("cached_tokens")
    if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0:
        return cached
    return None


def completion_tokens_of(payload: Any) -> int | None:
    """`usage.completion_tokens` of a decoded response object, when the engine reported it."""
    usage = payload.get("usage") if isinstance(payload, dict) else None
    generated = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if isinstance(generated, int) and not isinstance(generated, bool) and generated >= 0:
        return generated
    return None


def usage_in_body(body: bytes) -> tuple[int | None, int | None]:
    """(cached prompt tokens, completion tokens) reported in a whole JSON response, each None when absent."""
    if _CACHED_TOKENS not in body and b'"completion_tokens"' not in body:
        return None, None
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        return None, None
    return cached_tokens_of(payload), completion_tokens_of(payload)


def cached_tokens_in_body(body: bytes) -> int | None:
    """Cached tokens reported in a whole JSON response; the byte test skips decoding bodies without usage."""
    if _CACHED_TOKENS not in body:
        return None
    try:
        return cached_tokens_of(json.loads(body))
    except (ValueError, RecursionError):
        return None


class UsageScanner:
    """Follows an SSE stream's bytes and remembers the last usage report with cached tokens.

    Events are separated by a blank line; only complete events that contain the `"cached_tokens"` bytes are
    decoded (with `stream_options.include_usage` that is the final usage chunk; with continuous usage stats,
    every chunk), so a stream without usage costs one byte search per chunk.
    """

    __slots__ = ("_pending", "cached_tokens", "completion_tokens")

    def __init__(self) -> None:
        self._pending = b""
        self.cached_tokens: int | None = None
        self.completion_tokens: int | None = None
        """From the same usage report (the flow queue charges a tenant's generated tokens with it)."""

    def feed(self, chunk: bytes) -> None:
        data = self._pending + chunk if self._pending else chunk
        boundary = data.rfind(b"\n\n")
        if boundary < 0:
            # An event larger than any usage chunk is not worth holding on to.
            self._pending = data if len(data) <= _MAX_PENDING_EVENT else b""
            return
        self._pending = data[boundary + 2 :]
        # Searched in place: a slice would copy every chunk of a stream that carries no usage.
        if data.find(_CACHED_TOKENS, 0, boundary) >= 0:
            self._scan(data[:boundary])

    def close(self) -> None:
        if self._pending and _CACHED_TOKENS in self._pending:
            self._scan(self._pending)
        self._pending = b""

    def _scan(self, events: bytes) -> None:
        for event in events.split(b"\n\n"):
            if _CACHED_TOKENS not in event:
                continue
            payload = b"".join(line[5:].strip() for line in event.splitlines() if line.startswith(b"data:"))
            try:
                decoded = json.loads(payload)
            except (ValueError, RecursionError):
                continue
            cached = cached_tokens_of(decoded)
            if cached is not None:
                self.cached_tokens = cached
                self.completion_tokens = completion_tokens_of(decoded)
