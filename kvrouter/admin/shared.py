"""Drain flags and reloads shared by every router instance of a fleet, through Redis.

Without Redis the admin API acts on the one router process it reached. With ``KVROUTER_REDIS_URL`` set, every
instance (and every ``--workers`` process) also writes what it was told into one Redis hash and polls that hash,
so a drain, an undrain or a reload sent to any instance reaches all of them within one poll interval:

* ``drain:<replica>`` fields: present while the replica is drained.
* ``reload_generation`` / ``reload_sha256``: bumped by an instance that applied a reload, with the digest of the
  replicas.yaml it applied. Another instance re-reads its own copy of the file and applies it once its content
  has that digest — on Kubernetes each pod's ConfigMap copy updates at its own moment, so it keeps checking for a
  while (`RELOAD_CATCH_UP_S`) rather than reloading a file that has not changed yet.

The hash is one key (``kvrouter:{admin}``), so it lives in one slot on Redis Cluster. Redis trouble never blocks
an admin call: the local change applies at once, the answer says ``"shared": false``, and the write is retried on
the next poll. The URL takes the same password, ACL user and TLS forms as the event plane
(`kvrouter.redisplane.clients`). Field values are read as bytes and decoded leniently, so whatever another
client wrote into the hash (non-UTF-8 bytes, a counter that is not a number) is ignored, never raised.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from kvrouter.redisplane.clients import redis_from_url

log = logging.getLogger(__name__)

ADMIN_KEY = "kvrouter:{admin}"
DRAIN_PREFIX = "drain:"
RELOAD_CATCH_UP_S = 300.0
"""How long an instance keeps waiting for its own replicas.yaml to show the content another instance applied."""


def file_digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


@dataclass(frozen=True, slots=True)
class SharedView:
    draining: frozenset[str] = frozenset()
    reload_generation: int = 0
    reload_sha256: str | None = None


@dataclass(slots=True)
class RedisAdminState:
    """The shared hash; every method returns None / False on Redis trouble instead of raising."""

    url: str
    key: str = ADMIN_KEY
    timeout_s: float = 2.0
    _redis: Redis | None = field(default=None, init=False)

    def _client(self) -> Redis:
        if self._redis is None:
            # Same URL forms as the event plane: a single Redis, redis+sentinel:// or redis+cluster://.
            self._redis = redis_from_url(self.url, socket_timeout_s=self.timeout_s, connect_timeout_s=self.timeout_s)
        return self._redis

    async def set_draining(self, replica: str, draining: bool) -> bool:
        try:
            if draining:
                await self._client().hset(self.key, f"{DRAIN_PREFIX}{replica}", "1")
            else:
                await self._client().hdel(self.key, f"{DRAIN_PREFIX}{replica}")
        except (RedisError, OSError) as error:
            log.warning("could not share the drain flag of %s through Redis: %s", replica, error)
            return False
        return True

    async def publish_reload(self, sha256: str) -> int | None:
        """Bump the reload generation with the digest just applied; the new generation, or None."""
        try:
            async with self._client().pipeline(transaction=True) as pipe:
                pipe.hincrby(self.key, "reload_generation", 1)
                pipe.hset(self.key, "reload_sha256", sha256)
                generation, _ = await pipe.execute()
        except ResponseError as error:
            # The counter holds something that is not a number: start it again rather than never share a reload.
            log.warning("shared reload counter was unreadable (%s); starting it at 1", error)
            try:
                await self._client().hset(self.key, mapping={"reload_generation": "1", "reload_sha256": sha256})
            except (RedisError, OSError):
                return None
            return 1
        except (RedisError, OSError) as error:
            log.warning("could not share the reload through Redis: %s", error)
            return None
        return int(generation)

    async def read(self) -> SharedView | None:
        try:
            raw = await self._client().hgetall(self.key)
        except (RedisError, OSError) as error:
            log.debug("shared admin state unreadable: %s", error)
            return None
        fields = {_text(name): _text(value) for name, value in raw.items()}
        draining = frozenset(name[len(DRAIN_PREFIX) :] for name in fields if name.startswith(DRAIN_PREFIX))
        try:
            generation = int(fields.get("reload_generation", "0"))
        except ValueError:
            generation = 0
        return SharedView(draining, generation, fields.get("reload_sha256"))

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None
