"""A request's session key, read once at the edge: the `x-session-id` header or the OpenAI `user` field.

`session_key_from` picks the source: `header`, `user`, `both` (the header when present, else `user`) or `off`.
The two namespaces never mix (`h:` and `u:` prefixes), so a header value equal to some user's name is another
session. A header that is present but malformed — longer than `MAX_SESSION_ID_CHARS`, or holding control
characters (C0, DEL, C1) — is the client's mistake and gets a 400 in OpenAI's error shape; an empty one counts as
absent. `user` is the client's own field, forwarded untouched: a non-string is a 400 (OpenAI and vLLM refuse it
too), a long one is keyed by its hash, so no valid request is refused for it.
"""

from __future__ import annotations

import re

import xxhash

from kvrouter.config import SessionKeySource
from kvrouter.openai_request import ParsedRequest, RequestError

SESSION_HEADER = "x-session-id"
MAX_SESSION_ID_CHARS = 256
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def session_key(header: str | None, parsed: ParsedRequest, source: SessionKeySource) -> str | None:
    """The session key of a request whose `x-session-id` header is `header` (None: absent); raises RequestError."""
    if source in ("header", "both") and header:
        if len(header) > MAX_SESSION_ID_CHARS or _CONTROL.search(header):
            raise RequestError(
                f"the {SESSION_HEADER} header must be at most {MAX_SESSION_ID_CHARS} characters without control "
                "characters",
                code="invalid_session_id",
            )
        return "h:" + header
    if source in ("user", "both"):
        user = parsed.body.get("user")
        if user is None or user == "":
            return None
        if not isinstance(user, str):
            raise RequestError("'user' must be a string", param="user")
        if len(user) > MAX_SESSION_ID_CHARS:
            return "u#" + xxhash.xxh3_64_hexdigest(user.encode("utf-8", "surrogatepass"))
        return "u:" + user
    return None


__all__ = ["MAX_SESSION_ID_CHARS", "SESSION_HEADER", "session_key"]
