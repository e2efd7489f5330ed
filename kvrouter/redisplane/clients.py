"""Redis clients from one URL, for a single Redis, Sentinel or Redis Cluster.

* ``redis://[:password@]host:port/db``, ``rediss://...``, ``unix:///path`` — one Redis.
* ``redis+sentinel://[:password@]host1:port1,host2:port2/service_name[/db]`` — the master that the Sentinels
  name for `service_name`; a failover is followed (the password, if any, is the data nodes' and the Sentinels').
* ``redis+cluster://[:password@]host:port[,host:port...]`` — a Redis Cluster (any node is a seed). Each replica's
  keys live in one slot, so every script and every single-stream XREAD goes to one shard.

The event plane retries and backs off itself, so the clients never retry a command: a transparent reconnect
would re-issue a blocking XREAD on a Redis that restarted empty and hide that its blocks lost their voucher.
"""

from __future__ import annotations

from typing import Any, cast
from urllib.parse import unquote, urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

SENTINEL_SCHEME = "redis+sentinel"
CLUSTER_SCHEME = "redis+cluster"


def is_cluster(url: str) -> bool:
    return url.startswith(CLUSTER_SCHEME + "://")


def _hosts(netloc: str, default_port: int) -> tuple[str | None, list[tuple[str, int]]]:
    password = None
    if "@" in netloc:
        credentials, netloc = netloc.rsplit("@", 1)
        password = unquote(credentials.split(":", 1)[-1]) or None
    hosts = []
    for item in netloc.split(","):
        host, _, port = item.rpartition(":")
        if not host:
            host, port = port, str(default_port)
        hosts.append((host.strip("[]"), int(port)))
    return password, hosts


def redis_from_url(
    url: str, *, socket_timeout_s: float, connect_timeout_s: float = 2.0, decode_responses: bool = False
) -> Redis:
    options: dict[str, Any] = {
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": connect_timeout_s,
        "decode_responses": decode_responses,
        "protocol": 2,
    }
    if url.startswith(SENTINEL_SCHEME + "://"):
        parts = urlsplit(url)
        password, sentinels = _hosts(parts.netloc, 26379)
        path = [p for p in parts.path.split("/") if p]
        if not path:
            raise ValueError(f"{url}: a Sentinel URL names the service: redis+sentinel://host:port/service_name")
        db = int(path[1]) if len(path) > 1 else 0
        sentinel = Sentinel(  # type: ignore[no-untyped-call]
            sentinels, sentinel_kwargs={"password": password, "socket_timeout": connect_timeout_s}, password=password
        )
        return cast(Redis, sentinel.master_for(path[0], db=db, retry=Retry(NoBackoff(), 0), **options))
    if is_cluster(url):
        parts = urlsplit(url)
        password, nodes = _hosts(parts.netloc, 6379)
        cluster = RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in nodes],
            password=password,
            retry=Retry(NoBackoff(), 0),
            **options,
        )
        # The plane uses only commands RedisCluster routes by key (one slot per replica); typed as one client.
        return cast(Redis, cluster)
    return Redis.from_url(url, retry=Retry(NoBackoff(), 0), health_check_interval=30, **options)
