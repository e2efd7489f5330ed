"""Disaggregated prefill/decode in the replay: the planner's splits, what each leg costs which engine, the transfer
in the TTFT, ITL from the decode worker, and aggregated rows exactly as they were."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvrouter.cli import main
from kvrouter.config import Settings
from kvrouter.replay.cli import replay_policy_object
from kvrouter.replay.driver import ReplayOptions, ReplayResult, VirtualClock, replay_policy
from kvrouter.replay.prompts import PromptCatalog
from kvrouter.replay.report import summarize, table
from kvrouter.replay.trace import Trace, TraceRequest, load_trace
from kvrouter.routing.disagg import DisaggSettings
from kvrouter.sim.mocker import DynamoMockerEngine
from kvrouter.sim.profiles import KvTransfer
from kvrouter.typedefs import DisaggMode, ReplicaRole
from tests.engine_recording import RecordingEngine
from tests.shared_data import MOONCAKE_CONVERSATION, shared

ROLES_2P2D: tuple[ReplicaRole, ...] = ("prefill", "prefill", "decode", "decode")
B200_LINK = KvTransfer(bytes_per_token=70_272)


def replay(
    trace: Trace | Sequence[TraceRequest],
    *,
    roles: Sequence[ReplicaRole] | None = ROLES_2P2D,
    mode: DisaggMode = "always",
    transfer: KvTransfer | None = B200_LINK,
    threshold: int = 8192,
) -> tuple[ReplayResult, list[RecordingEngine]]:
    requests = trace.requests if isinstance(trace, Trace) else list(trace)
    catalog = PromptCatalog(trace_block_tokens=512, block_size=64)
    prompts = [catalog.prepare(request) for request in requests]
    clock = VirtualClock()
    engines = [RecordingEngine(DynamoMockerEngine()) for _ in range(4)]
    result = replay_policy(
        requests=requests,
        prompts=prompts,
        catalog=catalog,
        policy=replay_policy_object("kv_aware", Settings(), clock),
        engine_factory=[lambda engine=engine: engine for engine in engines],  # type: ignore[misc]
        options=ReplayOptions(
            replicas=4, roles=roles, disaggregation=DisaggSettings(mode, threshold), kv_transfer=transfer
        ),
        clock=clock,
    )
    return result, engines


@pytest.fixture(scope="module")
def trace() -> Trace:
    return load_trace(shared(MOONCAKE_CONVERSATION), speedup=2.5, limit=300)


def test_always_splits_every_request_and_charges_each_leg_to_its_engine(trace: Trace) -> None:
    result, engines = replay(trace, mode="always")
    summary = summarize(result)
    assert summary["completed"] == 300 and summary["pd"]["split"] == 300 and summary["pd"]["reasons"] == {"split": 300}
    prefill, decode = engines[:2], engines[2:]
    by_id = {request.index: request for request in trace.requests}
    for engine in prefill:
        # Prefill legs only: the prompt, one output token, nothing transferred.
        assert engine.added and all(r.max_tokens == 1 and not r.kv_transferred for r in engine.added)
        assert all(r.request_id.endswith(":prefill") for r in engine.added)
    for engine in decode:
        # Decode legs only: the client's output length, the prompt's KV transferred.
        assert engine.added and all(r.kv_transferred for r in engine.added)
        assert all(r.max_tokens == by_id[int(r.request_id)].output_length for r in engine.added)
    for record in result.records:
        assert record.prefill_replica in ("engine-0", "engine-1") and record.replica in ("engine-2", "engine-3")
        assert record.first_token is not None and record.finish is not None
        assert record.transfer_s == pytest.approx(0.001 + record.prompt_tokens * 70_272 / 40e9)
    assert summary["replicas"]["engine-0"]["share"] == 0.0 and summary["replicas"]["engine-0"]["prefill_share"] > 0


def test_conditional_keeps_short_and_cached_requests_whole(trace: Trace) -> None:
    result, engines = replay(trace, mode="conditional")
    reasons = summarize(result)["pd"]["reasons"]
    assert reasons.get("short", 0) > 0 and reasons.get("split", 0) > 0
    for record in result.records:
        if record.pd_reason in ("short", "prefill_busy"):
            assert record.prefill_replica is None and record.replica in ("engine-2", "engine-3")
            assert record.transfer_s == 0.0
        else:
            assert record.prefill_replica is not None
    whole = {r.request_id for engine in engines[2:] for r in engine.added if not r.kv_transferred}
    assert whole == {str(r.index) for r in result.records if r.pd_reason in ("short", "prefill_busy")}
    assert sum(len(engine.added) for engine in engines[:2]) == reasons["split"]


def test_the_ttft_includes_the_transfer_and_itl_comes_from_the_decode_worker() -> None:
    request = TraceRequest(index=0, arrival=0.0, input_length=4096, output_length=20, chain=tuple(range(8)))
    free, _ = replay([request], transfer=None)
    slow, _ = replay([request], transfer=KvTransfer(bytes_per_token=1000, link_bytes_per_s=1e9, latency_s=0.25))
    before, after = free.records[0], slow.records[0]
    assert before.ttft is not None and after.ttft is not None
    assert after.transfer_s == pytest.approx(0.25 + 4096 * 1000 / 1e9)
    assert after.ttft - before.ttft == pytest.approx(after.transfer_s)
    assert after.itl is not None and after.itl == pytest.approx(before.itl or 0.0)
    assert after.finish is not None and after.first_token is not None
    assert after.itl == pytest.approx((after.finish - after.first_token) / 19)


def test_aggregated_rows_are_the_fleet_without_roles(trace: Trace) -> None:
    plain, _ = replay(trace, roles=None)
    both, _ = replay(trace, roles=("both",) * 4)
    assert summarize(plain) == summarize(both)
    assert all(r.pd_reason is None and r.prefill_replica is None for r in plain.records)


def test_cli_pd_rows_leave_the_aggregated_row_as_it_was(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["replay", str(shared(MOONCAKE_CONVERSATION)), "--policies", "kv_aware", "--speedup", "2.5"]
    common += ["--limit", "150", "--no-floor", "--jobs", "1", "--json"]
    assert main(common) == 0
    before = json.loads(capsys.readouterr().out)["rows"][0]
    assert main([*common, "--pd", "aggregated,always,conditional", "--roles", "2P2D"]) == 0
    rows = {row["policy"]: row for row in json.loads(capsys.readouterr().out)["rows"]}
    assert set(rows) == {"kv_aware+agg", "kv_aware+pd-always", "kv_aware+pd-conditional"}
    aggregated = dict(rows["kv_aware+agg"], policy="kv_aware")
    assert aggregated == before
    assert rows["kv_aware+pd-always"]["pd"]["split"] == 150
    assert rows["kv_aware+pd-conditional"]["itl_p99"] is not None
    printed = table(list(rows.values()))
    assert "ITL p50 / p99" in printed and "kv_aware+pd-conditional: split" in printed


def test_cli_refuses_a_fleet_without_prefill_or_of_the_wrong_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}) + "\n")
    assert main(["replay", str(trace), "--pd", "always", "--roles", "1P1D"]) == 2
    assert main(["replay", str(trace), "--pd", "always", "--roles", "decode,decode,both,both"]) == 2
    assert main(["replay", str(trace), "--pd", "sometimes"]) == 2
    assert main(["replay", str(trace), "--pd", "always", "--flow", "on"]) == 2
    assert "kvrouter replay:" in capsys.readouterr().err
