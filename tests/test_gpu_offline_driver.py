"""loadtest/gpu/h200_offline.sh `rows`: each plan line becomes one `kvrouter bench` whose quoted words stay whole.

python3 is replaced on PATH by a recorder, so the driver's own shell logic (plan parsing, {trace}, the deadline
and MIN_S skip) runs for real while no bench or fleet starts."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

DRIVER = Path(__file__).resolve().parent.parent / "loadtest" / "gpu" / "h200_offline.sh"

RECORDER = """#!/usr/bin/env bash
# Records the argv of each call as one JSON line; the driver's metrics snippet (python3 - ...) reads stdin.
[ "$1" = "-" ] && { cat >/dev/null; exit 0; }
printf '%s\\0' "$@" >> "$RECORD.tmp"; echo >> "$RECORD.tmp"
"""


def test_rows_keep_quoted_router_commands_whole_and_skip_what_the_deadline_cannot_fit(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    recorder = bin_dir / "python3"
    recorder.write_text(RECORDER)
    recorder.chmod(0o755)
    plan = tmp_path / "plan.txt"
    plan.write_text(
        "# a comment line\n\n"
        "peer-a  10  --rate 12 --policies \"\" --router-cmd 'peer=run --port {port} --worker-urls {worker_urls}'\n"
        "trace-b  10  --workload mooncake --trace {trace} --seed 1\n"
        "late-c  100000  --rate 4\n"
    )
    record = tmp_path / "calls"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD": str(record), "TRACE": "/t/c.jsonl"}
    deadline = str(int(time.time()) + 600)
    finished = subprocess.run(
        ["bash", str(DRIVER), "rows", str(tmp_path / "fleet"), str(tmp_path / "out"), deadline, str(plan)],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert finished.returncode == 0, finished.stderr
    calls = [line.split("\0")[:-1] for line in Path(f"{record}.tmp").read_text().splitlines() if line]
    fleet = str(tmp_path / "fleet" / "replicas.yaml")
    head = ["-m", "kvrouter.cli", "bench", "--fleet", fleet]
    assert calls == [
        [*head, "--rate", "12", "--policies", "", "--router-cmd", "peer=run --port {port} --worker-urls {worker_urls}",
         "--out", str(tmp_path / "out" / "peer-a")],
        [*head, "--workload", "mooncake", "--trace", "/t/c.jsonl", "--seed", "1",
         "--out", str(tmp_path / "out" / "trace-b")],
    ]  # fmt: skip
    assert "== skip late-c" in finished.stdout
