"""The mixed-attack soak, CI-sized: loadtest/attack_soak.py end to end as its own process tree.

Slow clients (trickled headers, trickled bodies, idle keep-alives), poison requests (OPTIONS *, absolute-form
targets, engine control paths, a 2M-character prompt, a gzip bomb, a nesting bomb, token ids >= 2**32, broken
JSON) and a hostile KV-event publisher hit a kv_aware router over loopback while honest clients stream chat
completions through it; the same honest load ran attack-free first. The benchmark run (2 x 60 s) and its figures
are in docs/reliability.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_attack_soak_ci_sized(tmp_path: Path) -> None:
    out = tmp_path / "attack.json"
    argv = [
        sys.executable, str(ROOT / "loadtest" / "attack_soak.py"), "--duration", "15", "--slow", "30",
        "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert out.is_file(), done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(out.read_text())
    attacked = summary["phases"]["under_attack"]
    assert attacked["honest"]["success"] >= 0.99, attacked["honest"]
    assert not attacked["attack"]["poison_5xx"], attacked["attack"]["poison"]
    # Every poison kind was sent and answered (a 4xx), none held the attacker's connection open.
    answered = {kind.rsplit(" ", 1)[0] for kind in attacked["attack"]["poison"] if not kind.endswith((" 0", " -1"))}
    assert len(answered) == 8, attacked["attack"]["poison"]
    assert attacked["attack"]["event_messages"] > 1000, "the hostile publisher ran"
    assert summary["checks"]["router_alive"] and summary["checks"]["serves_after"]
    assert summary["checks"]["rss_bounded"], summary["phases"]
    assert summary["checks"]["ttft_p99_ratio_within_limit"], summary["ttft_p99_ratio"]
    assert done.returncode == 0, done.stdout[-3000:]
