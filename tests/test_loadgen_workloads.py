"""Workloads are deterministic from their seed and have the prefix structure they promise."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from kvrouter.loadgen.plan import WorkloadParams
from kvrouter.loadgen.trace import BlockTokens, trace_sessions
from kvrouter.loadgen.workloads import WORKLOADS, build_schedule, count_requests
from kvrouter.replay.trace import load_trace
from kvrouter.traces import TraceError, read_rows
from tests.shared_data import MOONCAKE_CONVERSATION, shared

CHAT_WORKLOADS = [name for name in WORKLOADS if name != "mooncake"]


def _bodies(name: str, params: WorkloadParams) -> list[str]:
    return [
        json.dumps(request.make_body(), sort_keys=True)
        for session in build_schedule(name, params)
        for request in session.requests
    ]


@pytest.mark.parametrize("name", CHAT_WORKLOADS)
def test_same_seed_same_requests_other_seed_other_requests(name: str) -> None:
    params = WorkloadParams(seed=7, duration_s=20, rate=1.0, tenants=20, system_tokens=200, turns=3)
    first = _bodies(name, params)
    assert first == _bodies(name, params)
    assert first != _bodies(name, WorkloadParams(seed=8, duration_s=20, rate=1.0, tenants=20, system_tokens=200))
    starts = [session.start_s for session in build_schedule(name, params)]
    assert starts == sorted(starts)
    assert all(0 <= start < 20 for start in starts)


def test_multi_tenant_shares_system_prompt_and_tools_within_a_tenant() -> None:
    params = WorkloadParams(duration_s=600, rate=2.0, tenants=120, system_tokens=3000)
    sessions = build_schedule("multi-tenant", params)
    by_tenant: dict[str, list[dict[str, object]]] = {}
    for session in sessions:
        by_tenant.setdefault(session.key, []).append(session.requests[0].make_body())
    assert len(by_tenant) >= 100
    repeated = next(bodies for bodies in by_tenant.values() if len(bodies) >= 2)
    first, second = repeated[0], repeated[1]
    assert first["messages"][0] == second["messages"][0]  # type: ignore[index]
    assert first["tools"] == second["tools"]
    assert first["messages"][1] != second["messages"][1]  # type: ignore[index]
    assert len(str(first["messages"][0]["content"]).split()) >= 1500  # type: ignore[index]
    others = [bodies[0] for key, bodies in by_tenant.items() if bodies is not repeated]
    assert all(body["messages"][0] != first["messages"][0] for body in others)  # type: ignore[index]


def test_multi_turn_history_grows_and_each_turn_extends_the_previous() -> None:
    sessions = build_schedule("multi-turn", WorkloadParams(duration_s=10, rate=1.0, turns=4, system_tokens=100))
    session = sessions[0]
    assert len(session.requests) == 4
    histories = [request.make_body()["messages"] for request in session.requests]
    for before, after in itertools.pairwise(histories):
        assert after[: len(before)] == before
        assert len(after) == len(before) + 2
        assert after[len(before)]["role"] == "assistant"
    assert session.requests[0].think_s == 0
    assert all(request.think_s > 0 for request in session.requests[1:])


def test_agentic_appends_tool_calls_and_long_tool_results() -> None:
    params = WorkloadParams(duration_s=10, rate=1.0, turns=3, tool_result_tokens=1500, system_tokens=100)
    session = build_schedule("agentic", params)[0]
    last = session.requests[-1].make_body()["messages"]
    tool_results = [m for m in last if m["role"] == "tool"]
    calls = [m for m in last if m.get("tool_calls")]
    assert len(tool_results) == 2 and len(calls) == 2
    assert all(len(m["content"].split()) > 300 for m in tool_results)
    assert tool_results[0]["tool_call_id"] == calls[0]["tool_calls"][0]["id"]


def test_hot_spot_moves_half_the_traffic_to_one_tenant_after_the_switch() -> None:
    params = WorkloadParams(duration_s=300, rate=4.0, tenants=120, hot_share=0.5, hot_at=0.5, system_tokens=50)
    sessions = build_schedule("hot-spot", params)
    before = [s for s in sessions if s.start_s < 150]
    after = [s for s in sessions if s.start_s >= 150]
    share_before = sum(s.key == "tenant-0" for s in before) / len(before)
    share_after = sum(s.key == "tenant-0" for s in after) / len(after)
    assert share_before < 0.1
    assert 0.42 < share_after < 0.6


def test_rate_sets_the_number_of_sessions() -> None:
    sessions = build_schedule("multi-tenant", WorkloadParams(duration_s=500, rate=2.0, system_tokens=10))
    assert 900 < len(sessions) < 1100
    assert count_requests(sessions) == len(sessions)


def test_unknown_workload_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        build_schedule("nope", WorkloadParams())


def test_block_tokens_are_fixed_per_hash_id_and_avoid_special_tokens() -> None:
    blocks = BlockTokens(seed=0, block_tokens=512, vocab_low=8, vocab_high=8192, capacity=4)
    first = blocks.block(5)
    for hash_id in range(10):  # evicts 5 from the small cache; it must come back identical
        blocks.block(hash_id)
    assert BlockTokens(0, 512, 8, 8192).block(5) == first == blocks.block(5)
    assert len(first) == 512 and min(first) >= 8 and max(first) < 8192
    assert blocks.block(6) != first
    assert BlockTokens(1, 512, 8, 8192).block(5) != first
    prompt = blocks.prompt([5, 6, 7], 1100)
    assert len(prompt) == 1100
    assert prompt[:512] == list(first) and prompt[1024:] == list(blocks.block(7)[:76])


def _write_trace(path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]},
        {"timestamp": 500, "input_length": 1500, "output_length": 0, "hash_ids": [0, 1, 2]},
        {"timestamp": 2000, "input_length": 600, "output_length": 5, "hash_ids": [0, 3]},
        {"timestamp": 9000, "input_length": 100, "output_length": 5, "hash_ids": [4]},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_trace_replay_shares_prefixes_and_compresses_time(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    _write_trace(trace)
    params = WorkloadParams(trace=trace, duration_s=2.0, trace_speedup=2.0, trace_block_tokens=512)
    sessions = trace_sessions(params)
    assert [s.start_s for s in sessions] == [0.0, 0.25, 1.0]  # the row at 9 s is past 2 s x 2
    bodies = [s.requests[0].make_body() for s in sessions]
    assert [len(b["prompt"]) for b in bodies] == [1000, 1500, 600]
    assert bodies[1]["prompt"][:1000] == bodies[0]["prompt"]
    assert bodies[2]["prompt"][:512] == bodies[0]["prompt"][:512]
    assert bodies[2]["prompt"][512:600] != bodies[0]["prompt"][512:600]
    assert [b["max_tokens"] for b in bodies] == [10, 1, 5]
    assert all(b["ignore_eos"] is True for b in bodies)
    assert all(s.requests[0].endpoint == "completion" for s in sessions)


def test_trace_slice_starts_at_the_offset(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    _write_trace(trace)
    sessions = trace_sessions(WorkloadParams(trace=trace, duration_s=10, trace_start_s=1.0))
    assert [s.start_s for s in sessions] == [1.0, 8.0]


def test_bad_trace_row_names_the_line(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n{"oops": 1}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        list(read_rows(trace))


def test_the_load_generator_and_the_replay_read_a_trace_alike(tmp_path: Path) -> None:
    """One reader behind both: the same rows (arrival, lengths) and the same file:line error on a bad row."""
    trace = tmp_path / "trace.jsonl"
    _write_trace(trace)
    sessions = trace_sessions(WorkloadParams(trace=trace, duration_s=100))
    replayed = load_trace(trace)
    assert [s.start_s for s in sessions] == [r.arrival for r in replayed.requests]
    assert [s.requests[0].max_tokens for s in sessions] == [r.output_length for r in replayed.requests]
    assert [len(s.requests[0].make_body()["prompt"]) for s in sessions] == [r.input_length for r in replayed.requests]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(trace.read_text() + '{"timestamp": 1, "input_length": -3, "output_length": 1, "hash_ids": []}\n')
    errors = []
    for read in (lambda: trace_sessions(WorkloadParams(trace=bad, duration_s=100)), lambda: load_trace(bad)):
        with pytest.raises(TraceError) as caught:
            read()
        errors.append(str(caught.value))
    assert errors[0] == errors[1] == f"{bad}:5: field 'input_length' must be a non-negative integer"


def test_real_conversation_trace_slice_reuses_prefixes() -> None:
    params = WorkloadParams(trace=shared(MOONCAKE_CONVERSATION), duration_s=60, trace_speedup=1.0)
    sessions = build_schedule("mooncake", params)
    assert 30 < len(sessions) < 400
    prompts = [s.requests[0].make_body()["prompt"] for s in sessions[:40]]
    firsts = {tuple(p[:512]) for p in prompts if len(p) >= 512}
    assert len(firsts) < len(prompts) / 2  # hash id 0 opens most conversation rows
