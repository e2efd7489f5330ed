"""Conformance on real captures: replay vLLM's own frames into the index, then for every recorded request the
cached tokens kvrouter predicts equal what the engine reported.

s1 (block size 32) recorded vLLM's prefix-cache counters around each request (`vllm:prompt_tokens_cached_total`).
s2 (block size 128, a 12-block cache with evictions and a prefix-cache reset) recorded no counters; there the
engine's own store events are the witness: vLLM publishes `BlockStored` only for blocks it computed, so the
prompt blocks a request itself stored are exactly the ones that were not cached.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest

from kvrouter.blocks import cacheable_tokens, chain_keys
from kvrouter.events.ingest import IndexIngest
from kvrouter.events.wire import BlockStored, EventBatch, WireDecoder, decode_seq, split_frames
from kvrouter.index import PrefixIndex
from kvrouter.openai_request import parse_request
from kvrouter.tokenization import HfPromptTokenizer
from kvrouter.typedefs import BlockKey, ReplicaName
from tests.shared_data import VLLM_CAPTURES, requires_shared
from tests.vllm_captures import CAPTURES, messages, model_dir, requests, run_info


def lists(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """A chat prompt's ids come as the render cache's array('I'): compare them as lists."""
    return [list(prompt) for prompt in prompts]


_shared_data = requires_shared(VLLM_CAPTURES)
REPLICA = ReplicaName("engine")


@pytest.fixture(scope="module")
def tokenizer() -> HfPromptTokenizer:
    return HfPromptTokenizer(model_dir(), threads=1)


def _batches(run: str) -> dict[int, EventBatch]:
    decoder = WireDecoder()
    result = {}
    for message in messages(CAPTURES / "runs" / run / "frames"):
        parts = split_frames(message.frames)
        assert parts is not None
        seq = decode_seq(parts[1])
        assert seq is not None
        batch, problems = decoder.decode_payload(REPLICA, seq, parts[2])
        assert batch is not None and not problems
        result[message.number] = batch
    return result


def _prompt_ids(tokenizer: HfPromptTokenizer, record: dict[str, Any]) -> list[int]:
    endpoint = "chat" if "chat" in record["endpoint"] else "completion"
    request = parse_request(endpoint, json.dumps(record["request"]).encode())
    prompts = lists(tokenizer.token_ids(request))
    assert len(prompts) == 1
    return prompts[0]


def _served(run: str) -> list[dict[str, Any]]:
    served = ("/v1/completions", "/v1/chat/completions")
    return [r for r in requests(run) if r["status"] == 200 and r["endpoint"] in served]


def _stored_chunks(batch: EventBatch) -> set[tuple[int, ...]]:
    chunks = set()
    for event in batch.events:
        if isinstance(event, BlockStored):
            size = event.block_size
            for at in range(0, len(event.token_ids), size):
                chunks.add(tuple(event.token_ids[at : at + size]))
    return chunks


@pytest.mark.parametrize("run", ["s1_basic_bs32", "s2_evict_reset_bs128_ipc"])
def test_predicted_cached_tokens_equal_the_engines(run: str, tokenizer: HfPromptTokenizer) -> None:
    block_size = run_info(run)["block_size"]
    index = PrefixIndex()
    ingest = IndexIngest(index, block_sizes={REPLICA: block_size})
    batches = _batches(run)
    pending = sorted(batches)
    checked = 0

    def apply_until(number: int) -> None:
        while pending and pending[0] < number:
            ingest.apply(batches[pending.pop(0)])

    for record in _served(run):
        ids = _prompt_ids(tokenizer, record)
        if "prompt_token_ids" in record:
            assert ids == record["prompt_token_ids"]
        usage = record.get("usage") or record["response_summary"]["usage"]
        assert len(ids) == usage["prompt_tokens"]
        own = record["kv_event_msgs"]
        apply_until(min(own) if own else (pending[0] if pending else 10**9))
        if own and pending and pending[0] == min(own):
            # What the request's first batch holds before its own stores happened earlier: evictions to make
            # room come after the prefix-cache lookup, and a reset is only published with the next step.
            first = batches[pending.pop(0)]
            cut = next((i for i, e in enumerate(first.events) if isinstance(e, BlockStored)), len(first.events))
            ingest.apply(EventBatch(first.replica, first.dp_rank, first.seq, first.ts, first.events[:cut]))
            pending.insert(0, -1)
            batches[-1] = EventBatch(first.replica, first.dp_rank, first.seq, first.ts, first.events[cut:])
        keys = chain_keys(ids, block_size, cache_salt=record["request"].get("cache_salt"))
        match = index.longest_prefixes(keys, now=0.0).get(REPLICA)
        predicted = cacheable_tokens(len(ids), match.blocks if match else 0, block_size)

        if record.get("metrics_delta"):
            expected = int(record["metrics_delta"]["vllm:prompt_tokens_cached_total"])
        elif record.get("request", {}).get("vllm_xargs"):
            expected = None  # engine extras (kv_cache_report_mode) make vLLM recompute without a lookup
        else:
            stored: set[tuple[int, ...]] = set()
            for number in own:
                stored |= _stored_chunks(batches[-1] if number == min(own) and -1 in batches else batches[number])
            computed = [p for p in range(len(keys)) if tuple(ids[p * block_size : (p + 1) * block_size]) in stored]
            expected = cacheable_tokens(len(ids), computed[0] if computed else len(keys), block_size)
        if expected is not None:
            assert predicted == expected, record["name"]
            checked += 1
        if -1 in pending:
            pending.remove(-1)
            ingest.apply(batches.pop(-1))
    assert checked >= 8
    assert {status for (_, _, status) in ingest.counts} == {"ok"}, ingest.counts


def test_every_captured_run_ingests_without_a_skipped_event() -> None:
    """All runs, both DP ranks of s7: every event is understood, and equal prompts give equal keys everywhere."""
    from tests.vllm_captures import frame_dirs

    index = PrefixIndex()
    first_keys: dict[str, list[BlockKey]] = {}
    runs = {folder.parent.name for folder in frame_dirs()}
    block_sizes = {
        ReplicaName(run): run_info("multi_server_s3..s6" if run.startswith("multi_server") else run)["block_size"]
        for run in runs
    }
    ingest = IndexIngest(index, block_sizes=block_sizes)
    decoder = WireDecoder()
    for folder in frame_dirs():
        run = ReplicaName(folder.parent.name)
        for message in messages(folder):
            parts = split_frames(message.frames)
            assert parts is not None
            batch, problems = decoder.decode_payload(run, decode_seq(parts[1]) or 0, parts[2])
            assert batch is not None and not problems
            ingest.apply(batch)
            if message.number == 0 and batch.dp_rank == 0 and isinstance(batch.events[0], BlockStored):
                event = batch.events[0]
                first_keys[run] = chain_keys(event.token_ids, event.block_size)
    assert {status for (_, _, status) in ingest.counts} == {"ok"}, ingest.counts
    # s3 and s4 were sent the same first prompt; so were s5 and s6 (see index.json).
    assert first_keys["multi_server_s3"] == first_keys["multi_server_s4"]
    assert first_keys["multi_server_s5"] == first_keys["multi_server_s6"]
    # The dp2 run's rank 1 was sent s3's first prompt too: one prefix, found on three replicas (DP rank 1 of one).
    probe = index.longest_prefixes(first_keys["multi_server_s3"], 0.0)
    assert {"multi_server_s3", "multi_server_s4", "s7_dp2"} <= set(probe)
    assert probe[ReplicaName("s7_dp2")].blocks == len(first_keys["multi_server_s3"])
