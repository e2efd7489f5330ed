"""Redis access (issue 15): a Redis that requires a password, and one that speaks only TLS, end to end.

A real redis-server with ``--requirepass`` (and one with ``--tls-port``/``--port 0`` and a CA made by the openssl
CLI): the relay writes, a router app follows to /ready 200, and the shared admin state works through the same
URL. A missing or wrong password is a clear, counted, logged error that keeps /ready at 503 — never a crash —
and no log line ever carries the password.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvrouter.admin.shared import RedisAdminState
from kvrouter.index import PrefixIndex
from kvrouter.redisplane.clients import masked_url, redis_from_url
from kvrouter.redisplane.follower import connect_redis
from kvrouter.relay import Relay
from kvrouter.server.app import ROUTER, create_app
from kvrouter.typedefs import ReplicaName
from tests.conftest import eventually, router_settings
from tests.redis_fixtures import RedisServer, make_tls, running_redis
from tests.redis_plane_support import SyntheticEngine, TwoReplicaPlane, synthetic_fleet

pytestmark = pytest.mark.redis

PASSWORD = "s3cret-pa$$ w0rd"
SYN = ReplicaName("syn")


@pytest.fixture
def locked_redis(tmp_path: Path) -> Iterator[RedisServer]:
    with running_redis(tmp_path / "redis", password=PASSWORD) as server:
        yield server


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[RedisServer]:
    with running_redis(tmp_path / "redis-tls", password=PASSWORD, tls=make_tls(tmp_path / "tls")) as server:
        yield server


async def fill(url: str) -> Relay:
    from kvrouter.events.wire import WireDecoder

    relay = Relay(connect_redis(url, socket_timeout_s=5.0), synthetic_fleet(SYN), [SYN], clock_ms=lambda: 10**12)
    await relay.open()
    engine, decoder = SyntheticEngine(3), WireDecoder()
    for seq in range(20):
        batch, _ = decoder.decode_payload(SYN, seq, engine.step())
        assert batch is not None
        relay.accept(batch)
    await relay.flush()
    return relay


async def router_follows(url: str, relay: Relay, aiohttp_client: Any) -> None:
    app = create_app(router_settings(redis_url=url), synthetic_fleet(SYN))
    client = await aiohttp_client(app)
    index = app[ROUTER].index
    assert isinstance(index, PrefixIndex)
    await eventually(lambda: index.blocks_of(SYN) == len(relay.book[SYN]) > 0, within_s=15, what="index loaded")
    assert (await client.get("/ready")).status == 200


def assert_no_password(caplog: pytest.LogCaptureFixture) -> None:
    for record in caplog.records:
        assert PASSWORD not in record.getMessage(), record.getMessage()
        assert "pa%24%24" not in record.getMessage()


async def test_password_end_to_end_relay_router_and_admin(
    locked_redis: RedisServer, aiohttp_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    relay = await fill(locked_redis.url)
    await router_follows(locked_redis.url, relay, aiohttp_client)
    shared = RedisAdminState(locked_redis.url)
    assert await shared.set_draining("syn", True)
    view = await shared.read()
    assert view is not None and view.draining == {"syn"}
    await shared.close()
    await relay.redis.aclose()
    assert any("redis://:***@127.0.0.1" in r.getMessage() for r in caplog.records), "the masked URL is logged"
    assert_no_password(caplog)


@pytest.mark.parametrize("password", [None, "wrong"])
async def test_missing_or_wrong_password_is_clear_counted_and_not_ready(
    locked_redis: RedisServer, aiohttp_client: Any, caplog: pytest.LogCaptureFixture, password: str | None
) -> None:
    now = [0.0]
    url = locked_redis.url_with(password)
    app = create_app(router_settings(redis_url=url), synthetic_fleet(SYN), clock=lambda: now[0])
    client = await aiohttp_client(app)

    async def auth_errors() -> str:
        return await (await client.get("/metrics")).text()

    text = ""
    for _ in range(200):
        text = await auth_errors()
        if 'kvrouter_redis_events_session_errors_total{reason="auth"}' in text:
            break
        await asyncio.sleep(0.05)
    assert 'kvrouter_redis_events_session_errors_total{reason="auth"}' in text
    now[0] = 3600.0  # far past the start-up grace that lets a router serve while Redis is merely away
    response = await client.get("/ready")
    assert response.status == 503
    assert any("refused our credentials" in r.getMessage() for r in caplog.records)
    # The shared admin state says "not shared" rather than raising.
    shared = RedisAdminState(url)
    assert not await shared.set_draining("syn", True)
    assert await shared.read() is None
    await shared.close()
    assert_no_password(caplog)


async def test_relay_with_a_wrong_password_retries_and_never_dies(locked_redis: RedisServer) -> None:
    relay = Relay(
        connect_redis(locked_redis.url_with("wrong"), socket_timeout_s=2.0),
        synthetic_fleet(SYN),
        [SYN],
        clock_ms=lambda: time.time_ns() // 10**6,
    )
    task = asyncio.create_task(relay.run())
    await asyncio.sleep(0.5)
    assert not task.done() and not relay.redis_up and not relay.opened
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await relay.redis.aclose()


async def test_tls_end_to_end_relay_router_and_admin(tls_redis: RedisServer, aiohttp_client: Any) -> None:
    assert tls_redis.url.startswith("rediss://") and "ssl_ca_certs=" in tls_redis.url
    relay = await fill(tls_redis.url)
    await router_follows(tls_redis.url, relay, aiohttp_client)
    shared = RedisAdminState(tls_redis.url)
    assert await shared.set_draining("syn", True)
    await shared.close()
    await relay.redis.aclose()


async def test_tls_hostile_plane_over_rediss(tls_redis: RedisServer) -> None:
    """The two-replica plane (relay core + follower) over rediss:// with a password: both replicas flow."""
    plane = TwoReplicaPlane(tls_redis.url)
    try:
        await plane.start()
        await plane.write(TwoReplicaPlane.GOOD)
        await plane.write(TwoReplicaPlane.BAD)
        await eventually(lambda: plane.agrees(TwoReplicaPlane.GOOD) and plane.agrees(TwoReplicaPlane.BAD))
    finally:
        await plane.close()


async def test_tls_without_the_ca_is_refused_as_tls(tls_redis: RedisServer, aiohttp_client: Any) -> None:
    url = tls_redis.url.split("?")[0]  # rediss:// without ssl_ca_certs: the test CA is not trusted
    app = create_app(router_settings(redis_url=url), synthetic_fleet(SYN))
    client = await aiohttp_client(app)
    text = ""
    for _ in range(200):
        text = await (await client.get("/metrics")).text()
        if 'kvrouter_redis_events_session_errors_total{reason="tls"}' in text:
            break
        await asyncio.sleep(0.05)
    assert 'kvrouter_redis_events_session_errors_total{reason="tls"}' in text


def test_masked_url_hides_passwords_in_every_form() -> None:
    assert masked_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert masked_url("rediss://user:pw@h:1/0?ssl_ca_certs=/ca.pem") == "rediss://user:***@h:1/0?ssl_ca_certs=/ca.pem"
    assert masked_url("redis+sentinel://:pw@a:1,b:2/mymaster") == "redis+sentinel://:***@a:1,b:2/mymaster"
    assert masked_url("redis+cluster://pw@a:1") == "redis+cluster://***@a:1"
    assert masked_url("redis://h:1/0") == "redis://h:1/0"


def test_sentinel_and_cluster_urls_carry_user_password_and_tls_options() -> None:
    """The hand-parsed forms pass the ACL user, the password and the TLS query options on (no connection made)."""
    query = "?ssl_ca_certs=/ca.pem&ssl_cert_reqs=required"
    sentinel = redis_from_url(f"rediss+sentinel://bob:pw@127.0.0.1:1,127.0.0.1:2/main/2{query}", socket_timeout_s=1)
    data = sentinel.connection_pool.connection_kwargs
    assert (data["username"], data["password"], data["ssl_ca_certs"], data["db"]) == ("bob", "pw", "/ca.pem", 2)
    manager = sentinel.connection_pool.sentinel_manager  # type: ignore[attr-defined]
    assert manager.sentinels[0].connection_pool.connection_kwargs["ssl_ca_certs"] == "/ca.pem"
    cluster = redis_from_url(f"rediss+cluster://bob:pw@127.0.0.1:1{query}", socket_timeout_s=1)
    options = cluster.connection_kwargs  # type: ignore[attr-defined]
    assert (options["username"], options["password"], options["ssl_ca_certs"]) == ("bob", "pw", "/ca.pem")
    assert "SSL" in options["connection_class"].__name__
