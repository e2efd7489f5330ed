"""Counting and logging hostile or broken Redis data without flooding the log.

The event plane reads a shared store: an entry it cannot use is skipped, counted per (replica, reason) and
logged — once per `interval_s` per (replica, reason), with the number suppressed since — and the plane goes on.
The follower and the relay each own one `ProblemLog`; their collectors export `counts` as a metric with a
``reason`` label.

Reasons (a small named set, documented in docs/reliability.md): ``undecodable`` (an entry that is not msgpack of
the entry shape, or fails its range checks), ``missing_field`` (no ``e`` field), ``apply_failed`` (the index
refused an op), ``snapshot`` (the snapshot does not decode), ``wrong_type`` (a key holds another Redis type),
``bad_meta`` (the meta hash holds something that is not a number), ``gap`` (snapshot and stream never lined up),
``foreign_entry`` (the stream holds an entry this relay did not write), ``internal`` (any other exception,
caught so that one replica never stops the others).

`SESSION_ERRORS` are the errors that mean Redis itself is away or refuses us (they end a follower session, and
`session_reason` labels them ``connection``, ``auth``, ``tls`` or ``internal``); every other error is one replica's
data, labelled by `replica_reason`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from redis.exceptions import AuthenticationError, AuthorizationError, NoPermissionError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvrouter.redisplane.catchup import CatchupError


class ProblemLog:
    def __init__(self, logger: logging.Logger, clock: Callable[[], float], *, interval_s: float = 60.0) -> None:
        self.logger = logger
        self.clock = clock
        self.interval_s = interval_s
        self.counts: Counter[tuple[str, str]] = Counter()
        self._last: dict[tuple[str, str], float] = {}
        self._suppressed: Counter[tuple[str, str]] = Counter()

    def count(self, replica: str, reason: str, detail: object) -> None:
        key = (replica, reason)
        self.counts[key] += 1
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._suppressed[key] += 1
            return
        self._last[key] = now
        suppressed = self._suppressed.pop(key, 0)
        more = f" ({suppressed} more since the last report)" if suppressed else ""
        self.logger.warning("replica %s: %s in Redis, skipped: %s%s", replica, reason, detail, more)

    def total(self, replica: str) -> int:
        return sum(n for (name, _), n in self.counts.items() if name == replica)


class ApplyFailed(Exception):
    """The index refused an op: the replica's blocks there are uncertain, so it reloads."""


SESSION_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)
"""Redis itself is away (or refuses us): the session ends and is retried. Anything else is one replica's data."""


def session_reason(error: BaseException) -> str:
    """The `session_errors` label of an error that ended a session."""
    if isinstance(error, (AuthenticationError, AuthorizationError, NoPermissionError)):
        return "auth"
    text = str(error)
    if "NOAUTH" in text or "WRONGPASS" in text:
        return "auth"
    if "SSL" in text or "certificate" in text or "TLS" in text:
        return "tls"
    if isinstance(error, (RedisError, OSError)):
        return "connection"
    return "internal"


def replica_reason(error: BaseException) -> str:
    """The `problems` label of an error confined to one replica's data."""
    if isinstance(error, CatchupError):
        return {"entry": "undecodable"}.get(error.reason, error.reason)
    if isinstance(error, ApplyFailed):
        return "apply_failed"
    if isinstance(error, NoPermissionError):
        return "no_permission"
    if isinstance(error, ResponseError):
        return "wrong_type" if "WRONGTYPE" in str(error) else "redis_error"
    if isinstance(error, (ValueError, UnicodeDecodeError)):
        return "bad_meta"
    return "internal"
