"""The event plane closes every ZMQ socket and context it opens, on every way out.

Why it matters beyond tidiness: pyzmq's finalizer of a context that was never terminated calls `destroy()`, and
when the garbage collector finds the context together with one of its still-open sockets (a cycle through a
task's exception traceback is enough), that socket's weak reference is already cleared, so `destroy()` cannot
close it and `term()` waits for it for good — in whatever the collecting thread was doing (in CI: a Redis read of
an unrelated test, until the 300 s timeout). A context's LINGER 0 does not help: nothing closes the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket as pysocket
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from kvrouter.config import KvEventsConfig, parse_fleet
from kvrouter.events.embedded import EmbeddedEvents
from kvrouter.events.metrics import EventMetrics
from kvrouter.events.wire import EventBatch
from kvrouter.events.zmq_source import ZmqEventSource
from kvrouter.index import PrefixIndex
from tests.test_events_zmq import FakeEngine, context, free_port, warm_up  # noqa: F401  (fixture)


@pytest.fixture
def held_port() -> Iterator[pysocket.socket]:
    """A listening TCP socket: its port cannot be bound by anyone else until it is closed."""
    holder = pysocket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    yield holder
    holder.close()


@pytest.mark.parametrize("allow_from", [None, ["127.0.0.1"]])
async def test_a_bound_endpoint_still_held_is_retried_not_a_dead_source(
    context: zmq.asyncio.Context,  # noqa: F811
    held_port: pysocket.socket,
    allow_from: list[str] | None,
) -> None:
    """Finding: a bind that failed (the port still held) ended the source, its SUB socket left open for the
    garbage collector. Now the socket is closed at once and the bind retried until the port is free."""
    port = held_port.getsockname()[1]
    config = KvEventsConfig(endpoint=f"tcp://127.0.0.1:{port}", bind=True, allow_from=allow_from)
    seen: list[EventBatch] = []
    source = ZmqEventSource("r", config, seen.append, context=context, reconnect_s=0.05)
    task = asyncio.create_task(source.run())
    engine = None
    try:
        await asyncio.sleep(0.3)  # a few binds fail meanwhile
        assert not task.done() and not source.connected.is_set()
        held_port.close()
        await asyncio.wait_for(source.connected.wait(), 5)
        engine = FakeEngine(context, bind_pub=False, pub=config.endpoint, replay=f"tcp://127.0.0.1:{free_port()}")
        await warm_up(engine, source)
        assert seen
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if engine is not None:
            await engine.close()


async def test_stop_terminates_the_context_even_after_a_source_failed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Finding: a source task that had failed made `EmbeddedEvents.stop` raise before it destroyed its context,
    leaving the context (and the other replicas' sources) to the garbage collector."""
    contexts: list[zmq.asyncio.Context] = []

    async def failing_run(source: ZmqEventSource) -> None:
        contexts.append(source.context)
        if source.replica == "a":
            raise RuntimeError("source a failed")
        await asyncio.Event().wait()

    monkeypatch.setattr(ZmqEventSource, "run", failing_run)
    fleet = parse_fleet(
        {
            "replicas": [
                {"name": name, "url": "http://127.0.0.1:9", "kv_events": {"endpoint": f"tcp://127.0.0.1:{free_port()}"}}
                for name in ("a", "b")
            ]
        },
        Path("replicas.yaml"),
    )
    events = EmbeddedEvents(fleet, PrefixIndex(), EventMetrics(CollectorRegistry()))
    await events.start()
    await asyncio.sleep(0.05)
    with caplog.at_level(logging.ERROR, logger="kvrouter.events.embedded"):
        await events.stop()
    assert len(contexts) == 2 and all(ctx.closed for ctx in contexts)
    assert "source a failed" in caplog.text
