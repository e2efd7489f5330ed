"""The request body decoder is `json.loads` exactly: the same values, and the same refusals, on any bytes; the body
forwarded as a stream carries the same values again."""

from __future__ import annotations

import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.openai_request import decode_json, parse_request
from kvrouter.server.assembly import streamed_body

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=False),
    st.text(),  # lone surrogates included: json.dumps escapes them, msgspec refuses the escape
)
VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4), max_leaves=30
)


HOSTILE = [
    b'{"a":NaN}',
    b'{"a":1e400}',
    b'{"a":"\\ud800"}',
    b"\xef\xbb\xbf{}",
    '{"a":1}'.encode("utf-16"),
    b"[" * 5000 + b"]" * 5000,
    b'{"a":1,"a":2}',
    b" [1] ",
    b"[1,]",
    b"{'a':1}",
]


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@settings(max_examples=400, deadline=None)
@given(VALUES, st.booleans())
def test_every_json_document_decodes_to_what_json_loads_gives(value: object, ascii_only: bool) -> None:
    raw = json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    assert _same(decode_json(raw), json.loads(raw))


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=64),
        st.sampled_from(HOSTILE),
    )
)
def test_any_bytes_give_json_loads_value_or_its_error(raw: bytes) -> None:
    try:
        expected: object = json.loads(raw)
    except Exception as error:  # the error's type is what is compared
        expected = type(error)
    try:
        got: object = decode_json(raw)
    except Exception as error:
        got = type(error)
    assert _same(got, expected)


INTERPRETED = frozenset({"model", "prompt", "stream", "max_tokens", "cache_salt"})
"""The completion fields parse_request checks (a wrong type is a 400: test_proxy_bad_input.py)."""


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.text().filter(lambda key: key not in INTERPRETED), VALUES, max_size=6), st.booleans())
def test_the_streamed_body_carries_the_values_json_would(extra: dict[str, object], ascii_only: bool) -> None:
    """A non-streaming request is forwarded as a stream: msgspec re-encodes a body it decoded, json one that only
    json.loads accepts; either way the replica reads back exactly what the client sent, plus the stream fields."""
    body = {**extra, "model": "m", "prompt": "p"}
    raw = json.dumps(body, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    forwarded = streamed_body(parse_request("completion", raw))
    expected = {**json.loads(raw), "stream": True, "stream_options": {"include_usage": True}}
    assert _same(json.loads(forwarded), expected)


def test_a_streamed_body_keeps_nan_and_infinity_as_the_client_sent_them() -> None:
    parsed = parse_request("completion", b'{"model":"m","prompt":"p","temperature":NaN,"top_p":-Infinity}')
    assert not parsed.finite_json
    forwarded = json.loads(streamed_body(parsed))
    assert math.isnan(forwarded["temperature"]) and forwarded["top_p"] == -math.inf
    assert parse_request("completion", b'{"model":"m","prompt":"p"}').finite_json
