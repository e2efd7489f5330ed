"""A predicted prefix hit the engine evicts before admitting the request goes back on the replica's pending prefill
(kvrouter/routing/lost_hits.py): on the real `LoadBook`, and in the replay where it was found."""

from __future__ import annotations

import csv
from pathlib import Path

from kvrouter.policies.base import Decision
from kvrouter.policies.round_robin import RoundRobinPolicy
from kvrouter.routing.lifecycle import Routed
from kvrouter.routing.load import LoadBook
from kvrouter.routing.lost_hits import LostHitWatch
from kvrouter.routing.overlays import build_overlays
from kvrouter.typedefs import BlockKey, ReplicaName
from tests.shared_data import MOONCAKE_CONVERSATION, shared

A, B = ReplicaName("a"), ReplicaName("b")
BLOCK = 16
KEYS = [BlockKey(500 + n) for n in range(10)]


def routed(load: LoadBook, replica: ReplicaName, predicted_blocks: int, prompt_tokens: int = 10 * BLOCK) -> Routed:
    predicted = predicted_blocks * BLOCK
    return Routed(
        decision=Decision(replica, ()),
        replica=replica,
        block_size=BLOCK,
        keys=KEYS,
        prompt_tokens=prompt_tokens,
        predicted_cached=predicted,
        arrival=0.0,
        ticket=load.begin(replica, prompt_tokens - predicted),
        load=load,
        policy=RoundRobinPolicy(),
    )


def committed(watch: LostHitWatch, load: LoadBook, replica: ReplicaName, predicted_blocks: int) -> Routed:
    handle = routed(load, replica, predicted_blocks)
    watch.on_commit(handle)
    return handle


def test_an_evicted_block_gives_the_rest_of_the_hit_back_to_the_pending_prefill() -> None:
    load, watch = LoadBook(), LostHitWatch()
    handle = committed(watch, load, A, predicted_blocks=8)
    assert load.snapshot(A).pending_prefill_tokens == 2 * BLOCK
    watch.on_removed(A, [KEYS[5], BlockKey(9999)], 1.0)  # the hit now ends before block 5: blocks 5-7 are lost
    assert load.snapshot(A).pending_prefill_tokens == 5 * BLOCK
    assert (watch.lost_requests, watch.lost_tokens) == (1, 3 * BLOCK)
    watch.on_removed(A, [KEYS[7]], 2.0)  # already counted lost: nothing more
    assert load.snapshot(A).pending_prefill_tokens == 5 * BLOCK
    watch.on_removed(A, [KEYS[0]], 3.0)  # the whole prompt is computed now
    assert load.snapshot(A).pending_prefill_tokens == 10 * BLOCK
    assert watch.watched == 0
    handle.first_token(4.0)  # the load book takes off exactly what it holds
    assert load.snapshot(A).pending_prefill_tokens == 0 and load.snapshot(A).decode_requests == 1


def test_removals_elsewhere_or_after_the_first_token_change_nothing() -> None:
    load, watch = LoadBook(), LostHitWatch()
    handle = committed(watch, load, A, predicted_blocks=8)
    watch.on_removed(B, KEYS, 1.0)  # another replica's blocks
    watch.on_removed(A, KEYS[8:], 1.0)  # blocks past the predicted hit
    assert load.snapshot(A).pending_prefill_tokens == 2 * BLOCK and watch.lost_tokens == 0
    watch.on_first_token(handle, 2.0)
    handle.first_token(2.0)
    watch.on_removed(A, KEYS, 3.0)  # admitted already: whatever the engine evicts now, it was served
    assert load.snapshot(A).pending_prefill_tokens == 0 and watch.lost_tokens == 0 and watch.watched == 0


def test_a_request_without_a_predicted_hit_is_not_watched_and_a_cleared_replica_loses_every_hit() -> None:
    load, watch = LoadBook(), LostHitWatch()
    committed(watch, load, A, predicted_blocks=0)
    assert watch.watched == 0
    committed(watch, load, A, predicted_blocks=4)
    committed(watch, load, B, predicted_blocks=6)
    watch.on_cleared(A, 1.0)
    assert load.snapshot(A).pending_prefill_tokens == 10 * BLOCK + 10 * BLOCK
    assert load.snapshot(B).pending_prefill_tokens == 4 * BLOCK and watch.watched == 1


def test_a_finished_request_is_forgotten() -> None:
    load, watch = LoadBook(), LostHitWatch()
    handle = committed(watch, load, A, predicted_blocks=8)
    handle.finish(1.0)
    watch.on_finish(handle, 1.0)
    watch.on_removed(A, KEYS, 2.0)
    assert load.snapshot(A).pending_prefill_tokens == 0 and load.snapshot(A).in_flight == 0


def test_overlays_wire_the_watch_to_both_paths() -> None:
    overlays = build_overlays(object(), LoadBook(), lost_hits=True)  # type: ignore[arg-type]
    assert overlays.lost_hits is not None
    assert overlays.lost_hits in overlays.request_listeners and overlays.lost_hits in overlays.event_listeners
    assert build_overlays(object(), LoadBook()).lost_hits is None  # type: ignore[arg-type]


def test_replay_three_routers_stop_herding_onto_a_replica_whose_predicted_hit_was_evicted(tmp_path: Path) -> None:
    """The live rows' case, in the replay set up like them: trace request 473 (77,799 tokens) is predicted 74,240
    cached on the replica still decoding request 381, waits behind a 112,941-token prompt there while 381's blocks
    are evicted, and is served 512 from cache. Without the watch its replica looks nearly idle and the three small
    requests due 8.6 s later are sent there too, to wait ~23 s; with it they go elsewhere."""
    from kvrouter.cli import main

    rows = {}
    for setting in ("false", "true"):
        out = tmp_path / setting
        argv = [
            "replay", str(shared(MOONCAKE_CONVERSATION)), "--policies", "kv_aware", "--replicas", "4",
            "--profile", "b200x4-moe-1t", "--speedup", "0.7", "--speeds", "0.5,0.5,0.5,0.5", "--limit", "520",
            "--no-floor", "--routers", "3", "--share-delay-ms", "5", "--set", f"kv_lost_hits={setting}",
            "--out", str(out),
        ]  # fmt: skip
        assert main(argv) == 0
        (table,) = out.glob("requests_kv_aware*.csv")
        rows[setting] = {r["trace_index"]: r for r in csv.DictReader(table.open())}
    before, after = rows["false"], rows["true"]
    assert int(before["473"]["predicted_cached_tokens"]) >= 70_000 and int(before["473"]["cached_tokens"]) < 8_000
    small = ("491", "494", "497")
    assert all(before[i]["replica"] == before["473"]["replica"] for i in small)
    assert all(float(before[i]["ttft_ms"]) > 15_000 for i in small)
    assert not any(after[i]["replica"] == after["473"]["replica"] for i in small)
    assert all(float(after[i]["ttft_ms"]) < 5_000 for i in small)
