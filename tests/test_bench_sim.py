"""A short `kvrouter bench` end to end: two simulated replicas, a fresh kvrouter per policy, Locust, the report."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

POLICIES = (
    "round_robin,kv_aware" if importlib.util.find_spec("kvrouter.policies.kv_aware") else "round_robin,least_loaded"
)


@pytest.mark.slow
def test_bench_runs_each_policy_on_fresh_simulated_replicas(tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "kvrouter.cli", "bench", "--workload", "multi-turn", "--replicas", "2",
        "--duration", "6", "--policies", POLICIES, "--rate", "1.5", "--turns", "3", "--think", "0.3",
        "--system-tokens", "600", "--output-tokens", "8", "--users", "32", "--drain", "40", "--out", str(out),
    ]  # fmt: skip
    finished = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    assert "starting 2 simulated replicas" in finished.stdout
    assert "done " in finished.stdout  # progress lines
    report = json.loads((out / "report.json").read_text())
    names = POLICIES.split(",")
    assert list(report["results"]) == names
    assert report["baseline"] == "round_robin"
    for name in names:
        row = report["results"][name]
        assert row["scheduled"] > 0
        assert row["completed"] == row["scheduled"], (name, row)
        assert row["errors"] == 0 and row["incomplete"] == 0
        assert 0 < row["ttft_p50"] <= row["ttft_p99"] <= row["e2e_p99"]
        # Later turns extend earlier ones: some prompt tokens hit the cache, counted by the replicas themselves.
        assert 0 < row["hit_rate"] < 1
        shares = [replica["share"] for replica in row["replicas"].values()]
        assert len(shares) == 2 and sum(shares) == pytest.approx(1.0)
        assert (out / name / "records.jsonl").is_file() and (out / name / "locust_stats.csv").is_file()
    assert report["results"]["round_robin"]["replicas"]["sim-0"]["share"] == pytest.approx(0.5, abs=0.2)
    markdown = (out / "report.md").read_text()
    assert "| round_robin |" in markdown and "Ratios against round_robin" in markdown
    for plot in ("ttft_cdf.png", "ttft_over_time.png", "replica_load.png"):
        assert (out / plot).stat().st_size > 1000
