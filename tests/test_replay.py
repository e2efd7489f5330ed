"""Trace replay: trace formats, prompt keys, the driver's invariants on a slice, determinism, the CLI."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from kvrouter.blocks import chain_keys
from kvrouter.cli import main
from kvrouter.config import Settings
from kvrouter.replay.cli import replay_policy_object
from kvrouter.replay.driver import ReplayOptions, ReplayResult, VirtualClock, floor_ttfts, replay_policy
from kvrouter.replay.prompts import PromptCatalog, SizedPrompt
from kvrouter.replay.report import summarize, write_outputs
from kvrouter.replay.trace import Trace, TraceError, load_trace
from kvrouter.sim.mocker import DynamoMockerEngine, MockerConfig
from tests.shared_data import GMI_TRACE, MOONCAKE_CONVERSATION, shared


def write_trace(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_mooncake_rows(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]},
            {"timestamp": 2500, "input_length": 600, "output_length": 0, "hash_ids": [0, 2]},
        ],
    )
    trace = load_trace(path, speedup=2.5)
    assert trace.block_tokens == 512
    first, second = trace.requests
    assert (first.arrival, second.arrival) == (0.0, 1.0)
    assert second.output_length == 1  # a request produces at least its first token
    assert first.chain[0] == second.chain[0] and first.chain[1] != second.chain[1]


def test_gmi_rows_are_chained_and_in_nanoseconds(tmp_path: Path) -> None:
    base = 1753694362340138614
    path = write_trace(
        tmp_path / "g.jsonl",
        [
            {"timestamp": str(base), "input_length": 64, "output_length": 3, "hash_ids": [7, 8]},
            {"timestamp": str(base + 2_000_000_000), "input_length": 64, "output_length": 3, "hash_ids": [8, 7]},
            {"timestamp": str(base + 3_000_000_000), "input_length": 96, "output_length": 3, "hash_ids": [7, 8, 9]},
        ],
    )
    trace = load_trace(path)
    assert trace.block_tokens == 32
    a, b, c = trace.requests
    assert [a.arrival, b.arrival, c.arrival] == [0.0, 2.0, 3.0]
    # The same raw id at another position is another prefix; a shared leading run is the same prefix.
    assert a.chain[1] != b.chain[0] and a.chain[0] != b.chain[1]
    assert c.chain[:2] == a.chain


def test_bad_trace_lines_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\nnot json\n')
    with pytest.raises(TraceError, match=r"bad.jsonl:2"):
        load_trace(path)


def test_prompt_keys_are_chain_keys_over_the_tokens(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
            {"timestamp": 1, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]},
            {"timestamp": 2, "input_length": 1500, "output_length": 5, "hash_ids": [0, 1, 3]},
        ],
    )
    trace = load_trace(path)
    catalog = PromptCatalog(trace_block_tokens=512, block_size=64, hash_seed=7)
    prepared = [catalog.prepare(request) for request in trace.requests]
    for request, prompt in zip(trace.requests, prepared, strict=True):
        tokens = list(SizedPrompt(catalog, request))
        assert len(tokens) == request.input_length
        assert prompt.keys == chain_keys(tokens, 64, seed=7)
        assert len(prompt.engine_hashes) == request.input_length // 64
    # Shared prefixes share keys and engine hashes; the partial third block of request 0 is a prefix of request 2's.
    assert prepared[1].keys == prepared[0].keys[:10]
    assert prepared[2].keys[:16] == prepared[0].keys[:16]
    assert prepared[2].keys[16] != prepared[0].keys[16]
    assert prepared[2].engine_hashes[:16] == prepared[0].engine_hashes[:16]
    assert all(catalog.keys_by_hash[h] == k for p in prepared for h, k in zip(p.engine_hashes, p.keys, strict=True))


def test_gmi_prompts_pad_past_their_blocks(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path / "g.jsonl",
        [
            {"timestamp": "1753694362340138614", "input_length": 200, "output_length": 2, "hash_ids": [5, 6]},
            {"timestamp": "1753694362340138615", "input_length": 200, "output_length": 2, "hash_ids": [5, 6]},
        ],
    )
    trace = load_trace(path)
    catalog = PromptCatalog(trace_block_tokens=trace.block_tokens, block_size=64)
    first, second = (catalog.prepare(request) for request in trace.requests)
    assert first.keys[0] == second.keys[0]  # 64 tokens = both trace blocks, shared
    assert first.keys[1] != second.keys[1]  # padding is unique to each request
    assert first.engine_hashes[1] != second.engine_hashes[1]


def replay_slice(
    trace: Trace,
    policy: str,
    *,
    replicas: int = 4,
    delay: float = 0.0,
    whole_answers: bool = False,
    placements: dict[int, int] | None = None,
) -> ReplayResult:
    catalog = PromptCatalog(trace_block_tokens=trace.block_tokens, block_size=64)
    prompts = [catalog.prepare(request) for request in trace.requests]
    clock = VirtualClock()
    return replay_policy(
        requests=trace.requests,
        prompts=prompts,
        catalog=catalog,
        policy=replay_policy_object(policy, Settings(), clock),
        engine_factory=DynamoMockerEngine,
        options=ReplayOptions(
            replicas=replicas, event_delay_s=delay, whole_answers=whole_answers, placements=placements
        ),
        clock=clock,
    )


def test_engine_wait_counts_the_wait_for_kv_blocks(tmp_path: Path) -> None:
    # One engine with room for one prompt at a time: the second waits at the head of its queue until the first
    # has finished and freed its blocks; the engine_wait_ms column shows that wait, the first's is zero.
    path = write_trace(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 1500, "output_length": 50, "hash_ids": [0, 1, 2]},
            {"timestamp": 0, "input_length": 1500, "output_length": 5, "hash_ids": [3, 4, 5]},
        ],
    )
    trace = load_trace(path)
    catalog = PromptCatalog(trace_block_tokens=trace.block_tokens, block_size=64)
    prompts = [catalog.prepare(request) for request in trace.requests]
    clock = VirtualClock()
    result = replay_policy(
        requests=trace.requests,
        prompts=prompts,
        catalog=catalog,
        policy=replay_policy_object("round_robin", Settings(), clock),
        engine_factory=lambda: DynamoMockerEngine(MockerConfig(num_blocks=32)),
        options=ReplayOptions(replicas=1),
        clock=clock,
    )
    first, second = result.records
    assert first.engine_wait == 0.0 and first.finish is not None
    assert second.admitted == pytest.approx(first.finish)  # the pass after the first one's blocks were freed
    wait = second.engine_wait
    assert wait is not None and wait == pytest.approx(first.finish - second.arrival)
    assert second.ttft is not None and second.ttft > wait
    tail = summarize(result)["tail"]  # the slowest 1% of two requests: the second, and where its TTFT went
    assert tail["requests"] == 1 and tail["queued_mean"] == 0.0
    assert tail["engine_wait_mean"] == pytest.approx(wait)
    assert tail["ttft_mean"] == pytest.approx(tail["engine_wait_mean"] + tail["in_engine_mean"])
    out = tmp_path / "out"
    write_outputs(out, [result], [summarize(result)], None, {})
    with (out / "requests_round_robin.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert float(rows[0]["engine_wait_ms"]) == 0.0
    assert float(rows[1]["engine_wait_ms"]) == pytest.approx(wait * 1000, abs=0.001)


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "kv_aware"])
def test_slice_invariants(policy: str) -> None:
    trace = load_trace(shared(MOONCAKE_CONVERSATION), speedup=2.5, limit=400)
    result = replay_slice(trace, policy)
    summary = summarize(result)
    assert [r.index for r in result.records] == [r.index for r in trace.requests]
    assert summary["completed"] == summary["scheduled"] == 400
    for record in result.records:
        assert record.first_token is not None and record.finish is not None
        assert record.arrival <= record.first_token <= record.finish
        assert 0 <= record.cached_tokens < record.prompt_tokens
    shares = [v["share"] for v in summary["replicas"].values()]
    assert sum(shares) == pytest.approx(1.0)
    assert 0.0 <= summary["hit_rate"] <= 1.0
    assert summary["ttft_p50"] <= summary["ttft_p90"] <= summary["ttft_p99"]
    assert summary["e2e_p50"] <= summary["e2e_p99"]
    if policy == "round_robin":
        assert [r.replica for r in result.records[:8]] == [f"engine-{i % 4}" for i in range(8)]


def test_same_seed_same_output() -> None:
    trace = load_trace(shared(MOONCAKE_CONVERSATION), speedup=3.0, limit=300)
    first = summarize(replay_slice(trace, "kv_aware", delay=0.05))
    second = summarize(replay_slice(trace, "kv_aware", delay=0.05))
    assert first == second


def test_placements_route_a_recorded_history_and_keep_the_policys_own_choice() -> None:
    trace = load_trace(shared(MOONCAKE_CONVERSATION), speedup=2.5, limit=300)
    free = replay_slice(trace, "kv_aware")
    # Placing every request where the policy itself sent it changes nothing, and the policy agrees with all of it.
    own = {int(r.index): int(r.replica.rsplit("-", 1)[1]) for r in free.records}
    placed = replay_slice(trace, "kv_aware", placements=own)
    assert [(r.replica, r.first_token, r.cached_tokens) for r in placed.records] == [
        (r.replica, r.first_token, r.cached_tokens) for r in free.records
    ]
    assert all(r.policy_choice == r.replica for r in placed.records)
    assert all(r.policy_choice is None for r in free.records)
    # A history the policy would not have made: every request on engine-2. The requests go there; the policy's own
    # choices are kept, and it keeps asking for another replica as engine-2 fills.
    piled = replay_slice(trace, "kv_aware", placements=dict.fromkeys(own, 2))
    assert {r.replica for r in piled.records} == {"engine-2"}
    choices = [r.policy_choice for r in piled.records]
    assert None not in choices and len(set(choices)) > 1
    with pytest.raises(ValueError, match="placements name replicas"):
        replay_slice(trace, "kv_aware", placements={0: 4})


def test_kv_aware_follows_prefixes_on_a_slice() -> None:
    trace = load_trace(shared(MOONCAKE_CONVERSATION), speedup=2.5, limit=1500)
    rr = summarize(replay_slice(trace, "round_robin"))
    kv = summarize(replay_slice(trace, "kv_aware"))
    assert kv["hit_rate"] > rr["hit_rate"] + 0.03
    assert kv["ttft_p99"] < rr["ttft_p99"]
    # The router's prediction of what is cached where it sent a request is close to what the engines report.
    assert abs(kv["predicted_hit_rate"] - kv["hit_rate"]) < 0.02


def test_first_tokens_hidden_until_the_answer_ends_mislead_kv_aware() -> None:
    """`--whole-answers`: the router hears first tokens only at the end (non-streaming without assembly), so its
    load book counts every prompt as pending prefill through its decode; the engines' first tokens are unchanged
    in the records and the tail gets worse (on the whole trace: p99 +39% / +56% at x2.5 / x3.0, docs/benchmarks.md)."""
    trace = load_trace(shared(MOONCAKE_CONVERSATION), speedup=3.0, limit=1500)
    exact = replay_slice(trace, "kv_aware")
    hidden = replay_slice(trace, "kv_aware", whole_answers=True)
    assert [r.replica for r in exact.records] != [r.replica for r in hidden.records]
    assert all(
        r.first_token is not None and r.first_token < (r.finish or 0) for r in hidden.records if r.output_tokens > 1
    )
    assert summarize(hidden)["ttft_p99"] > summarize(exact)["ttft_p99"]


def test_floor_is_a_lower_bound() -> None:
    trace = load_trace(shared(MOONCAKE_CONVERSATION), speedup=2.5, limit=300)
    catalog = PromptCatalog(trace_block_tokens=trace.block_tokens, block_size=64)
    prompts = [catalog.prepare(request) for request in trace.requests]
    floors = floor_ttfts(trace.requests, prompts, DynamoMockerEngine)
    result = replay_slice(trace, "kv_aware")
    for floor, record in zip(floors, result.records, strict=True):
        assert record.ttft is not None
        assert floor <= record.ttft + 1e-9


def test_gmi_trace_replays() -> None:
    trace = load_trace(shared(GMI_TRACE), speedup=200.0, limit=300)
    summary = summarize(replay_slice(trace, "kv_aware", replicas=2))
    assert summary["completed"] == 300
    assert 0.0 < summary["hit_rate"] < 1.0


def test_cli_writes_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    code = main(
        [
            "replay",
            str(shared(MOONCAKE_CONVERSATION)),
            "--policies",
            "round_robin,kv_aware",
            "--replicas",
            "3",
            "--speedup",
            "2.5",
            "--limit",
            "200",
            "--out",
            str(out),
            "--set",
            "kv_hotspot_slack=4",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "| round_robin |" in printed and "| kv_aware |" in printed and "Floor" in printed
    report = json.loads((out / "report.json").read_text())
    assert set(report["rows"]) == {"round_robin", "kv_aware"}
    row = report["rows"]["kv_aware"]
    for field in (
        "ttft_p50",
        "ttft_p90",
        "ttft_p99",
        "e2e_p50",
        "e2e_p99",
        "requests_per_s",
        "output_tokens_per_s",
        "hit_rate",
        "replicas",
        "floor_ttft_p99",
    ):
        assert row[field] is not None, field
    assert len(row["replicas"]) == 3
    with (out / "requests_kv_aware.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 200 and float(rows[0]["ttft_ms"]) > 0
    assert (out / "ttft_cdf.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_refuses_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    row = {"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}
    trace = write_trace(tmp_path / "t.jsonl", [row])
    assert main(["replay", str(trace), "--policies", "fastest"]) == 2
    assert main(["replay", str(trace), "--profile", "nope"]) == 2
    assert main(["replay", str(trace), "--set", "kv_nothing=1"]) == 2
    assert main(["replay", str(tmp_path / "missing.jsonl")]) == 2
    assert "kvrouter replay:" in capsys.readouterr().err
