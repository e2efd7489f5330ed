"""Fuzz the request-body edge: whatever bytes a client sends, parsing either succeeds or raises a 4xx RequestError.

CI runs 3,000 cases per property (KVROUTER_FUZZ_EXAMPLES raises it for longer runs: 10,000 and more). Nearly all
of a case's time is hypothesis drawing the nested body (~18 ms), not the parser, so CI keeps the count at what
finds shallow bugs and the longer runs go wide.
"""

import json
import os
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrouter.openai_request import RequestError, parse_request

EXAMPLES = int(os.environ.get("KVROUTER_FUZZ_REQUEST_EXAMPLES", os.environ.get("KVROUTER_FUZZ_EXAMPLES", "3000")))
fuzz = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=50),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=30,
)
field_values: dict[str, Any] = {
    "messages": st.one_of(
        json_values,
        st.lists(st.fixed_dictionaries({"role": json_values, "content": json_values}) | json_values, max_size=4),
    ),
    "prompt": st.one_of(
        json_values, st.lists(st.integers(min_value=-5, max_value=2**40), max_size=8), st.lists(st.text(), max_size=3)
    ),
    "max_tokens": json_values,
    "max_completion_tokens": json_values,
    "stream": json_values,
    "model": json_values,
    "cache_salt": json_values,
}
bodies = st.fixed_dictionaries({}, optional=field_values).flatmap(
    lambda fixed: st.dictionaries(st.text(max_size=12), json_values, max_size=3).map(lambda extra: {**extra, **fixed})
)


def check(endpoint: str, raw: bytes) -> None:
    try:
        parsed = parse_request(endpoint, raw)  # type: ignore[arg-type]
    except RequestError as error:
        assert 400 <= error.status < 500
        body = error.body()
        assert set(body["error"]) >= {"message", "type", "code"}
        json.dumps(body)
        return
    assert isinstance(parsed.stream, bool)
    assert parsed.max_tokens is None or parsed.max_tokens >= 0
    if endpoint == "chat":
        assert parsed.messages
    else:
        assert parsed.prompt


@fuzz
@given(endpoint=st.sampled_from(["chat", "completion"]), body=bodies)
def test_structured_bodies_never_crash(endpoint: str, body: dict[str, Any]) -> None:
    check(endpoint, json.dumps(body).encode())


@fuzz
@given(endpoint=st.sampled_from(["chat", "completion"]), raw=st.binary(max_size=200))
def test_random_bytes_never_crash(endpoint: str, raw: bytes) -> None:
    check(endpoint, raw)


def test_deep_nesting_is_a_clean_400() -> None:
    raw = b"[" * 200_000 + b"]" * 200_000
    for endpoint in ("chat", "completion"):
        try:
            parse_request(endpoint, raw)  # type: ignore[arg-type]
        except RequestError as error:
            assert error.status == 400
        else:
            raise AssertionError("a bare array is not a request")


def test_deeply_nested_object_inside_valid_request() -> None:
    raw = b'{"prompt": "hi", "extra": ' + b'{"a": ' * 50_000 + b'"x"' + b"}" * 50_000 + b"}"
    try:
        parsed = parse_request("completion", raw)
    except RequestError as error:
        assert error.status == 400
    else:
        assert parsed.prompt == "hi"


def test_invalid_utf8_is_a_clean_400() -> None:
    try:
        parse_request("chat", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}')
    except RequestError as error:
        assert error.status == 400
    else:
        raise AssertionError("invalid UTF-8 accepted")
