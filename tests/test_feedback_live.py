"""kv_feedback on the live event paths: a block marked suspect after a short cache hit is cleared as soon as the
replica's engine stores it again — through the embedded ZMQ ingest and through the Redis follower — rather than
after `suspect_ttl_s`."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import zmq.asyncio
from prometheus_client import CollectorRegistry

from kvrouter.blocks import cacheable_tokens
from kvrouter.config import parse_fleet
from kvrouter.events.ingest import IndexIngest
from kvrouter.events.wire import WireDecoder, encode_seq
from kvrouter.index import PrefixIndex
from kvrouter.openai_request import parse_request
from kvrouter.redisplane.entries import Stored, pack_u64
from kvrouter.redisplane.follower import RedisFollower
from kvrouter.routing.feedback import FeedbackLookup
from kvrouter.server.app import create_app
from kvrouter.tokenization import HfPromptTokenizer
from kvrouter.typedefs import BlockKey, EngineBlockHash, ReplicaName
from tests.conftest import ReplicaFactory, router_settings
from tests.test_prefix_integration import BLOCK as BLOCK_TOKENS
from tests.test_prefix_integration import PROMPT, eventually, publisher, route, stored, tokenizer_dir

__all__ = ["publisher", "tokenizer_dir"]  # fixtures shared with the prefix-plane integration test

A = ReplicaName("a")
KEYS = [BlockKey(100 + n) for n in range(8)]


def suspect_at(index: PrefixIndex, feedback: FeedbackLookup, served: int) -> None:
    """The index says `A` holds all of KEYS; its engine served only `served` blocks from cache."""
    index.store_keys(A, [EngineBlockHash(k) for k in KEYS], KEYS)
    feedback.observe(A, KEYS, len(KEYS) * 4, served * 4, 4, now=0.0)
    assert feedback.suspects(A) == 1
    matched = feedback.longest_prefixes(KEYS, 1.0)
    assert (matched[A].blocks if A in matched else 0) <= served  # cut at the suspect, scaled by trust


async def test_a_redis_follower_store_clears_the_suspect() -> None:
    index = PrefixIndex()
    feedback = FeedbackLookup(index)
    suspect_at(index, feedback, served=3)
    follower = RedisFollower(lambda: None, [A], index, hash_seed=0, clock=lambda: 0.0, listeners=[feedback])  # type: ignore[arg-type,return-value]
    # Stream entries as the relay writes them: the engine stored blocks 3.. again.
    follower._apply(follower.replicas[A], [Stored(0, 0, pack_u64(KEYS[3:]), pack_u64(KEYS[3:]))])
    assert feedback.suspects(A) == 0
    assert feedback.longest_prefixes(KEYS, 1.0)[A].blocks == int(len(KEYS) * feedback.trust(A))


def test_an_ingested_store_clears_the_suspect_and_other_events_do_not() -> None:
    index = PrefixIndex()
    feedback = FeedbackLookup(index)
    suspect_at(index, feedback, served=0)
    ingest = IndexIngest(index, block_sizes={A: 4}, listeners=[feedback])
    other = {"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2, 3, 4], "block_size": 4}
    batch, problems = WireDecoder().decode_payload("a", 1, msgspec.msgpack.encode([1.0, [other], 0]))
    assert batch is not None and not problems
    ingest.apply(batch)
    assert feedback.suspects(A) == 1  # another block: the suspect stays
    assert ingest.counts[("a", "BlockStored", "ok")] == 1


async def test_live_zmq_store_clears_a_suspect_block_before_its_timeout(
    aiohttp_client: Any,
    fake_replicas: ReplicaFactory,
    tokenizer_dir: Path,
    publisher: tuple[zmq.asyncio.Socket, str],
) -> None:
    """The engine served none of the prompt from cache (a lost removal): the first block turns suspect; the
    engine computes the prompt again and publishes its store, which the embedded ingest hands to the overlay."""
    pub, endpoint = publisher
    (replica,) = await fake_replicas(1)
    fleet = parse_fleet(
        {
            "tokenizer": str(tokenizer_dir),
            "block_size": BLOCK_TOKENS,
            "replicas": [{"name": replica.name, "url": replica.url, "kv_events": {"endpoint": endpoint}}],
        },
        Path("replicas.yaml"),
    )
    settings = router_settings(policy="kv_aware", kv_feedback=True)
    client = await aiohttp_client(create_app(settings, fleet, registry=CollectorRegistry()))
    ids = HfPromptTokenizer(tokenizer_dir, threads=1).token_ids(
        parse_request("completion", msgspec.json.encode({"prompt": PROMPT}))
    )[0]
    held = 10
    seq = 0
    for seq in range(300):  # PUB/SUB drops messages until the subscription lands
        await pub.send_multipart([b"kv-events", encode_seq(seq), stored(list(range(held)), ids[: held * BLOCK_TOKENS])])
        await asyncio.sleep(0.02)
        if (await route(client))[replica.name]:
            break
    await eventually(client, {replica.name: cacheable_tokens(len(ids), held, BLOCK_TOKENS)})
    response = await client.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 2})
    assert response.status == 200
    assert (await response.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert await route(client) == {replica.name: 0}  # the first block is suspect there now

    # The engine stores the prompt's blocks again (new engine hashes): the suspect clears at once. Trust fell by
    # one request's weight (0.98), so 9 of the 10 blocks are credited.
    again = [100 + n for n in range(held)]
    await pub.send_multipart([b"kv-events", encode_seq(seq + 1), stored(again, ids[: held * BLOCK_TOKENS])])
    await eventually(client, {replica.name: cacheable_tokens(len(ids), held - 1, BLOCK_TOKENS)})
