"""Decode and check an OpenAI request body once, at the edge.

The proxy forwards the client's bytes untouched; this module only reads what routing needs and rejects what no
engine would accept, with the status and OpenAI-style error the client should see. Unknown fields are allowed
(they pass through); known fields with the wrong type are a 400.

The body is decoded by msgspec (about 0.6x json's time on an 18 KB chat body); anything msgspec refuses — NaN,
lone surrogate escapes, non-UTF-8 encodings, nesting too deep — goes to the standard library's `json.loads`, so
what is accepted, and every error, is exactly `json.loads`'s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

Endpoint = Literal["chat", "completion"]


class RequestError(Exception):
    """A client mistake; becomes `{"error": {"message", "type", "code"}}` with `status`."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        code: str = "invalid_request",
        type_: str = "invalid_request_error",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.type = type_
        self.param = param
        self.headers: dict[str, str] | None = None
        """Extra response headers (a 429's Retry-After)."""

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    endpoint: Endpoint
    body: Mapping[str, Any]
    """The decoded JSON object, for reading only; the raw bytes are what gets forwarded."""
    model: str | None
    stream: bool
    max_tokens: int | None
    cache_salt: str | None
    messages: Sequence[Mapping[str, Any]] | None = None
    """Chat only."""
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    """Completions only: a string, a batch of strings, token ids, or a batch of token ids."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    finite_json: bool = False
    """The body was decoded by msgspec, so it holds plain JSON values only (no NaN or Infinity): msgspec encodes
    it back to the same values."""


def _fail(message: str, param: str | None = None) -> RequestError:
    return RequestError(message, param=param)


def _optional_int(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(f"'{name}' must be an integer", name)
    if value < 0:
        raise _fail(f"'{name}' must be non-negative", name)
    return value


MAX_TOKEN_ID = 2**32 - 1
"""Engines and block hashing take token ids as unsigned 32-bit integers."""


def _check_ids(ids: list[int]) -> None:
    if any(t < 0 or t > MAX_TOKEN_ID for t in ids):
        raise _fail(f"token ids in 'prompt' must be between 0 and {MAX_TOKEN_ID}", "prompt")


def _is_int_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _check_prompt(prompt: object) -> str | list[str] | list[int] | list[list[int]]:
    if isinstance(prompt, str):
        if not prompt:
            raise _fail("'prompt' must not be empty", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            if not all(prompt):
                raise _fail("'prompt' must not contain empty strings", "prompt")
            return prompt
        if _is_int_list(prompt):
            _check_ids(prompt)
            return prompt
        if all(_is_int_list(p) and p for p in prompt):
            for ids in prompt:
                _check_ids(ids)
            return prompt
    raise _fail(
        "'prompt' must be a non-empty string, a list of strings, a list of token ids or a list of token-id lists",
        "prompt",
    )


def _check_messages(messages: object) -> list[Mapping[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise _fail("'messages' must be a non-empty list of message objects", "messages")
    for position, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _fail(f"messages[{position}] must be an object", "messages")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise _fail(f"messages[{position}].role must be a non-empty string", "messages")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise _fail(f"messages[{position}].content must be a string, a list of parts or null", "messages")
    return messages


_JSON = msgspec.json.Decoder()
"""Stateless and immutable (a compiled decoder, like a compiled regular expression): shared, not a singleton."""


def decode_json(raw: bytes) -> Any:
    """`json.loads(raw)`, faster where msgspec agrees with it (it decodes the same values; where it refuses,
    json.loads decides: its value or its error)."""
    return _decode(raw)[0]


def _decode(raw: bytes) -> tuple[Any, bool]:
    """decode_json's value, and whether msgspec decoded it (then it holds no NaN or Infinity, which only json.loads
    accepts)."""
    try:
        return _JSON.decode(raw), True
    except (msgspec.DecodeError, RecursionError):
        return json.loads(raw), False


def parse_request(endpoint: Endpoint, raw: bytes) -> ParsedRequest:
    """Decode `raw` (already size-checked) or raise `RequestError`."""
    try:
        body, finite = _decode(raw)
    except UnicodeDecodeError:
        raise _fail("request body is not valid UTF-8") from None
    except (json.JSONDecodeError, RecursionError):
        raise _fail("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise _fail("request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _fail("'model' must be a string", "model")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _fail("'stream' must be a boolean", "stream")
    max_tokens = _optional_int(body, "max_tokens")
    if endpoint == "chat":
        completion_max = _optional_int(body, "max_completion_tokens")
        max_tokens = completion_max if completion_max is not None else max_tokens
    cache_salt = body.get("cache_salt")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise _fail("'cache_salt' must be a non-empty string", "cache_salt")
    if endpoint == "chat":
        if "messages" not in body:
            raise _fail("'messages' is required", "messages")
        messages = _check_messages(body["messages"])
        return ParsedRequest(
            endpoint, body, model, stream, max_tokens, cache_salt, messages=messages, finite_json=finite
        )
    if "prompt" not in body:
        raise _fail("'prompt' is required", "prompt")
    prompt = _check_prompt(body["prompt"])
    return ParsedRequest(endpoint, body, model, stream, max_tokens, cache_salt, prompt=prompt, finite_json=finite)
