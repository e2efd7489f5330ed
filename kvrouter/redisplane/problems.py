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
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable


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
