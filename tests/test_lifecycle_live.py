"""The learning overlays hear the live event paths and forget a replica whose cache is gone (issue 19).

Before, only the replay fed `SurvivalLookup` (kv_survival did nothing live), and live feedback never forgot an
engine that restarted, was cleared or went away. Now the embedded ingest and the Redis follower tell every
overlay what they applied, and a replica that refuses connections reaches the overlays too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from kvrouter.blocks import chain_keys
from kvrouter.config import parse_fleet
from kvrouter.events.ingest import IndexIngest
from kvrouter.events.wire import AllBlocksCleared, BlockRemoved
from kvrouter.index import PrefixIndex
from kvrouter.redisplane.entries import Cleared, Removed, Stored, pack_u64
from kvrouter.redisplane.follower import RedisFollower
from kvrouter.routing.feedback import FeedbackLookup
from kvrouter.routing.load import LoadBook
from kvrouter.routing.overlays import build_overlays
from kvrouter.server.app import ROUTER, create_app
from kvrouter.typedefs import EngineBlockHash, ReplicaName
from tests.conftest import ReplicaFactory, router_settings
from tests.test_index import BS, batch, stored
from tests.test_prefix_integration import PROMPT, tokenizer_dir

__all__ = ["tokenizer_dir"]

A = ReplicaName("a")
TOKENS = list(range(8 * BS))
KEYS = chain_keys(TOKENS, BS)


def test_the_embedded_ingest_feeds_survival_and_feedback_and_a_restart_clears_both() -> None:
    index = PrefixIndex()
    overlays = build_overlays(index, LoadBook(), feedback=True, survival=True)
    assert overlays.survival is not None and overlays.feedback is not None
    now = [0.0]
    ingest = IndexIngest(index, block_sizes={A: BS}, listeners=overlays.event_listeners, clock=lambda: now[0])
    ingest.apply(batch(A, stored(1, TOKENS)))
    now[0] = 10.0
    ingest.apply(batch(A, BlockRemoved([EngineBlockHash(7), EngineBlockHash(8)])))
    assert overlays.survival.eviction_age(A) == 10.0  # kv_survival learns live: removal time - last touch
    overlays.feedback.observe(A, KEYS, 8 * BS, 2 * BS, BS, now[0])
    assert overlays.feedback.suspects(A) == 1 and overlays.feedback.trust(A) < 1.0

    ingest.apply(batch(A, AllBlocksCleared(restart=True)))
    assert overlays.feedback.trust(A) == 1.0 and overlays.feedback.suspects(A) == 0
    assert overlays.survival.eviction_age(A) is None


def test_the_redis_follower_feeds_survival_and_a_clear_reaches_feedback() -> None:
    index = PrefixIndex()
    overlays = build_overlays(index, LoadBook(), feedback=True, survival=True)
    assert overlays.survival is not None and overlays.feedback is not None
    now = [0.0]
    follower = RedisFollower(
        lambda: None,  # type: ignore[arg-type,return-value]
        [A],
        index,
        hash_seed=0,
        clock=lambda: now[0],
        listeners=overlays.event_listeners,
    )
    followed = follower.replicas[A]
    follower._apply(followed, [Stored(0, 0, pack_u64(KEYS), pack_u64(KEYS))])
    now[0] = 4.0
    follower._apply(followed, [Removed(0, 0, pack_u64(KEYS[6:]))])
    assert overlays.survival.eviction_age(A) == 4.0
    overlays.feedback.observe(A, KEYS[:6], 6 * BS, 0, BS, now[0])
    assert overlays.feedback.trust(A) < 1.0
    follower._apply(followed, [Cleared(None)])
    assert overlays.feedback.trust(A) == 1.0 and overlays.survival.eviction_age(A) is None


async def test_a_replica_that_refuses_connections_is_forgotten_by_feedback(
    aiohttp_client: Any, fake_replicas: ReplicaFactory, tokenizer_dir: Path
) -> None:
    """Its engine is gone: the trust it lost and its suspect blocks describe a cache that no longer exists."""
    first, second = await fake_replicas(2, cached_tokens=0)
    fleet = parse_fleet(
        {
            "tokenizer": str(tokenizer_dir),
            "block_size": 16,
            "replicas": [{"name": r.name, "url": r.url} for r in (first, second)],
        },
        Path("replicas.yaml"),
    )
    app = create_app(router_settings(policy="kv_aware", kv_feedback=True), fleet, registry=CollectorRegistry())
    client = await aiohttp_client(app)
    feedback = app[ROUTER].index
    assert isinstance(feedback, FeedbackLookup)
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 2}
    for _ in range(2):  # the second goes where the first left provisional blocks and is served from nothing
        assert (await client.post("/v1/completions", json=body)).status == 200
    (gone,) = [replica for replica in (first, second) if replica.completions_seen()]
    assert len(gone.completions_seen()) == 2
    chosen = ReplicaName(gone.name)
    assert feedback.trust(chosen) < 1.0 and feedback.suspects(chosen) == 1
    await gone.stop()
    assert (await client.post("/v1/completions", json=body)).status == 200  # refused there, answered elsewhere
    assert feedback.trust(chosen) == 1.0 and feedback.suspects(chosen) == 0
