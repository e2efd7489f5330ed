"""Stopping a task that talks to Redis: cancel it and wait, never forever.

redis-py can swallow a cancel that lands as a blocking read starts, or while a command is being retried: the
awaited call then returns (or fails) normally and the task's loop goes on as if nothing had been asked of it. A
shutdown that cancels such a task and awaits it waits forever: a router instance stopped while its Redis went away
(`loadtest/router_pool.py` stops Redis and the instances together) stayed up, listening socket closed, in
`runner.cleanup()` — an orphan that had to be killed by hand, and in Kubernetes a pod that sits out its whole
termination grace period. `stop_task` cancels, waits `first_wait_s`; then closes the task's Redis connections
(`disconnect`: a blocked read ends at once), cancels again and waits `last_wait_s`; a task still running after
that is logged and left behind, so the shutdown goes on. Loops that poll Redis also end on their own once their
task is being cancelled (`cancel_requested`), so a swallowed cancel costs at most one poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

FIRST_WAIT_S = 1.0
"""How long a cancelled task gets before its connections are closed under it."""
LAST_WAIT_S = 5.0
"""How long it gets after that before the shutdown goes on without it."""


async def stop_task(
    task: asyncio.Task[None],
    name: str,
    disconnect: Callable[[], Awaitable[object]] | None = None,
    *,
    first_wait_s: float = FIRST_WAIT_S,
    last_wait_s: float = LAST_WAIT_S,
) -> bool:
    """Cancel `task` and wait for it, at most `first_wait_s + last_wait_s`. True when it ended."""
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=first_wait_s)
    if done:
        return True
    log.warning("%s: a Redis call did not take the cancel; closing its connections", name)
    if disconnect is not None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(disconnect(), last_wait_s)
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=last_wait_s)
    if not done:
        log.error(
            "%s did not stop within %.0fs of its cancel; shutting down without it", name, first_wait_s + last_wait_s
        )
    return bool(done)


def cancel_requested() -> bool:
    """The running task is being cancelled (a cancel it may not have seen: one swallowed inside a Redis call)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
