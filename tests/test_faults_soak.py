"""The soak and event-flood benchmarks, CI-sized: each script runs end to end as its own process tree.

* loadtest/soak.py for 25 s (the benchmark run is 10 minutes): steady streaming load through a router in front of
  simulated replicas; zero failed requests and flat router RSS, or the script exits 1.
* loadtest/event_flood.py for 6 s at 100k KV events/s: requests keep being routed (bounded latency, where an
  event loop held by the ingest once gave a p99 of minutes) and the index stays within its budget.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def run(script: str, *args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, str(ROOT / "loadtest" / script), *args]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False)


def test_soak_ci_sized(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    done = run("soak.py", "--duration", "25", "--rate", "20", "--sample-every", "5", "--json", str(out), timeout_s=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads(out.read_text())["summary"]
    assert summary["failed"] == 0 and summary["ok"] == summary["sent"] >= 400
    assert summary["kvrouter_kv_events_total"] > 0, "the prefix index was fed during the run"


def test_event_flood_ci_sized(tmp_path: Path) -> None:
    out = tmp_path / "flood.json"
    done = run(
        "event_flood.py", "--seconds", "6", "--idle-seconds", "3", "--index-max-blocks", "50000",
        "--json", str(out), timeout_s=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["router_alive"]
    assert result["flood"]["events_applied"] > 50_000, "the flood reached the index"
    # The gauge counts engine-hash mappings, which the index sweeps once a quarter of the budget has gone stale.
    assert result["index_blocks_end"] <= 50_000 * 1.25 + 128
    assert result["flood"]["requests"] >= 10, "requests were served during the flood"
    assert result["flood"]["request_p99_ms"] < 3_000
    assert result["flood"]["decision_mean_ms"] < 20
