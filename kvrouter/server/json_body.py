"""Writing back a request body the router had to change (the streamed form of an assembled answer, a band written
into `priority`, the legs of a disaggregated request); every other body goes upstream as the client's bytes.

`encode_body` uses msgspec when the decoder saw only plain JSON values (`ParsedRequest.finite_json`: it writes them
back as they were read, ~0.1x json's time on an 18 KB prompt), else `compact_json`: json with compact separators,
for what msgspec would change (NaN, which it writes as null) or cannot encode (a lone surrogate).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import msgspec

_ENCODER = msgspec.json.Encoder()
"""Stateless, like the request decoder: shared, not a singleton."""


def compact_json(value: Any) -> bytes:
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        # A lone surrogate (`"\ud800"`, valid JSON, not encodable as UTF-8) survives only as an escape.
        return json.dumps(value, ensure_ascii=True, separators=(",", ":")).encode()


def encode_body(body: Mapping[str, Any], *, finite_json: bool) -> bytes:
    if finite_json:
        try:
            return _ENCODER.encode(body)
        except (UnicodeEncodeError, OverflowError, TypeError, RecursionError):
            pass
    return compact_json(body)


__all__ = ["compact_json", "encode_body"]
