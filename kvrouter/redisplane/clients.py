"""Redis clients from one URL, for a single Redis, Sentinel or Redis Cluster.

* ``redis://[[user]:password@]host:port/db``, ``rediss://...`` (TLS), ``unix:///path`` — one Redis.
* ``redis+sentinel://[[user]:password@]host1:port1,host2:port2/service_name[/db]`` — the master that the
  Sentinels name for `service_name`; a failover is followed (the credentials, if any, are the data nodes' and the
  Sentinels'). ``rediss+sentinel://`` speaks TLS to both.
* ``redis+cluster://[[user]:password@]host:port[,host:port...]`` — a Redis Cluster (any node is a seed). Each
  replica's keys live in one slot, so every script and every single-stream XREAD goes to one shard.
  ``rediss+cluster://`` speaks TLS.

Access. Passwords and ACL users come in the URL (percent-encode special characters; in deploy files the URL is
built from a Secret). TLS takes redis-py's query parameters on every form: ``ssl_ca_certs`` (CA bundle path),
``ssl_cert_reqs`` (``required`` by default; ``none`` only for tests), ``ssl_certfile`` / ``ssl_keyfile``
(client certificate, for ``tls-auth-clients``), ``ssl_check_hostname`` (``true``/``false``). `masked_url` is the
form to log: the password never reaches a log line.

The event plane retries and backs off itself, so the clients never retry a command: a transparent reconnect
would re-issue a blocking XREAD on a Redis that restarted empty and hide that its blocks lost their voucher.
"""

from __future__ import annotations

from typing import Any, cast
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")


def _scheme(url: str) -> str:
    return url.partition("://")[0].lower()


def is_cluster(url: str) -> bool:
    return _scheme(url) in CLUSTER_SCHEMES


def masked_url(url: str) -> str:
    """`url` with its password replaced by ``***`` (user names and hosts kept): the form to log."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable Redis URL>"
    if "@" not in parts.netloc:
        return url
    credentials, hosts = parts.netloc.rsplit("@", 1)
    user, colon, _ = credentials.partition(":")
    netloc = f"{user}:***@{hosts}" if colon else f"***@{hosts}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _credentials(netloc: str) -> tuple[str | None, str | None, str]:
    """(username, password, hosts) of a URL's netloc; ``:password@`` has no user (Redis's ``default``)."""
    if "@" not in netloc:
        return None, None, netloc
    credentials, hosts = netloc.rsplit("@", 1)
    user, colon, password = credentials.partition(":")
    if not colon:  # "password@host", as redis-py reads a lone credential
        return None, unquote(user) or None, hosts
    return unquote(user) or None, unquote(password) or None, hosts


def _tls_options(scheme: str, query: str) -> dict[str, Any]:
    """TLS keyword arguments for Sentinel and Cluster clients (redis-py's from_url reads them itself)."""
    options: dict[str, Any] = {}
    if scheme.startswith("rediss"):
        options["ssl"] = True
    for name, value in parse_qsl(query):
        if name in TLS_OPTIONS:
            options[name] = value.lower() in ("1", "true", "yes") if name == "ssl_check_hostname" else value
    return options


def _hosts(netloc: str, default_port: int) -> tuple[str | None, list[tuple[str, int]]]:
    _, password, netloc = _credentials(netloc)
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
    scheme = _scheme(url)
    if scheme in SENTINEL_SCHEMES:
        parts = urlsplit(url)
        username, password, _ = _credentials(parts.netloc)
        _, sentinels = _hosts(parts.netloc, 26379)
        path = [p for p in parts.path.split("/") if p]
        if not path:
            raise ValueError(
                f"{masked_url(url)}: a Sentinel URL names the service: redis+sentinel://host:port/service_name"
            )
        db = int(path[1]) if len(path) > 1 else 0
        tls = _tls_options(scheme, parts.query)
        # Any-typed: redis-py 8.2 types Sentinel's parameters (an unpacked dict of str would meet its int ones).
        connection: dict[str, Any] = {"username": username, "password": password, **tls}
        sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
            sentinels, sentinel_kwargs={**connection, "socket_timeout": connect_timeout_s}, **connection
        )
        return cast(Redis, sentinel.master_for(path[0], db=db, retry=Retry(NoBackoff(), 0), **options))
    if scheme in CLUSTER_SCHEMES:
        parts = urlsplit(url)
        username, password, _ = _credentials(parts.netloc)
        _, nodes = _hosts(parts.netloc, 6379)
        cluster = RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in nodes],
            username=username,
            password=password,
            retry=Retry(NoBackoff(), 0),
            **_tls_options(scheme, parts.query),
            **options,
        )
        # The plane uses only commands RedisCluster routes by key (one slot per replica); typed as one client.
        return cast(Redis, cluster)
    return Redis.from_url(url, retry=Retry(NoBackoff(), 0), health_check_interval=30, **options)
