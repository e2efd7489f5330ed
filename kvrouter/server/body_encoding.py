"""Compressed request bodies, inflated by the router in bounded slices rather than by aiohttp's parser.

aiohttp's parser inflates a body as its bytes arrive, inside the event loop's read callback: a 64 KiB read of a
gzip bomb becomes tens of megabytes of output in one call, stalling every other request for tens of milliseconds
per read (measured with loadtest/attack_soak.py: a bomb every 0.3 s raised honest TTFT p99 2.6x). The server runs
with `auto_decompress=False` and the edge middleware (kvrouter/server/client_limits.py) feeds the compressed bytes to an
`Inflater`, which yields at most `slice_bytes` of output per step, so the middleware can give the loop back
between steps and stop at the body cap before inflating more than it allows.

Accepted: `gzip` (and `x-gzip`, several members too), `deflate` (zlib-wrapped, or raw as some clients send it) and
`identity`. Anything else — brotli, zstd, a list of encodings — is refused with 415 by the caller: engines accept
no compressed bodies at all, so a client that needs more can send the body plain.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

SUPPORTED = ("gzip", "x-gzip", "deflate", "identity")
SLICE_BYTES = 256 * 1024


class BadEncoding(ValueError):
    """The bytes do not match their Content-Encoding (corrupt, or truncated at the end)."""


class Inflater:
    def __init__(self, encoding: str, *, slice_bytes: int = SLICE_BYTES) -> None:
        self.encoding = encoding.strip().lower()
        if self.encoding not in SUPPORTED:
            raise ValueError(f"unsupported Content-Encoding {encoding!r}")
        self.slice_bytes = slice_bytes
        self._gzip = self.encoding in ("gzip", "x-gzip")
        self._identity = self.encoding == "identity"
        self._decoder: zlib._Decompress | None = self._new() if self._gzip else None
        self._head = b""
        """deflate: its first two bytes, until they tell a zlib wrapper from a raw stream."""
        self._started = False

    def _new(self) -> zlib._Decompress:
        return zlib.decompressobj(16 + zlib.MAX_WBITS)

    def _deflate_decoder(self, head: bytes) -> zlib._Decompress:
        # A zlib header is CMF FLG with method 8 and (CMF*256 + FLG) divisible by 31; anything else is raw deflate.
        wrapped = head[0] & 0x0F == 8 and (head[0] << 8 | head[1]) % 31 == 0
        return zlib.decompressobj(zlib.MAX_WBITS if wrapped else -zlib.MAX_WBITS)

    def feed(self, data: bytes) -> Iterator[bytes]:
        """Inflate `data`, at most `slice_bytes` per piece yielded (the caller may stop, or await, between)."""
        if self._identity:
            if data:
                yield data
            return
        if self._decoder is None:
            self._head += data
            if len(self._head) < 2:
                return
            self._decoder = self._deflate_decoder(self._head)  # `deflate` with or without the zlib wrapper
            data, self._head = self._head, b""
        pending = data
        while True:
            try:
                out = self._decoder.decompress(pending, self.slice_bytes)
            except zlib.error as error:
                raise BadEncoding(f"{self.encoding} body is corrupt: {error}") from None
            self._started = True
            pending = self._decoder.unconsumed_tail
            if self._decoder.eof:
                rest = self._decoder.unused_data
                if self._gzip and rest.strip(b"\0"):
                    self._decoder = self._new()  # the next gzip member
                    self._started = False
                    pending = rest + pending
                elif rest.strip(b"\0") or pending:
                    raise BadEncoding(f"{self.encoding} body has bytes after its end")
            if out:
                yield out
            # A full slice may leave output inside zlib even with no input left: ask again until it runs dry.
            if not pending and len(out) < self.slice_bytes:
                return

    def close(self) -> None:
        """The body ended: anything short of the stream's end is a truncated body."""
        if self._identity:
            return
        if self._decoder is None or not self._started:
            raise BadEncoding(f"{self.encoding} body is too short to be one")
        if not self._decoder.eof:
            raise BadEncoding(f"{self.encoding} body ends before its compressed stream does")
