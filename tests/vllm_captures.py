"""Read the real vLLM KV-event captures in ../shared/fixtures/vllm-kv-events (skip when absent, fail under CI).

Every reader checks the captures through tests/shared_data.py, so a test that uses one needs no marker."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.shared_data import VLLM_CAPTURES, shared

CAPTURES = VLLM_CAPTURES


@dataclass(frozen=True)
class Message:
    number: int
    frames: list[bytes]


def frame_dirs() -> list[Path]:
    """Every captured frames folder. Without the captures: the missing runs folder alone, so that a test
    parametrized over this list at collection still runs once and skips (fails under CI) naming it."""
    runs = CAPTURES / "runs"
    return sorted(p for p in runs.glob("*/frames*") if p.is_dir()) or [runs]


def messages(frames_dir: Path) -> list[Message]:
    result = []
    for line in (shared(frames_dir) / "index.jsonl").read_text().splitlines():
        entry = json.loads(line)
        result.append(Message(entry["msg"], [(frames_dir / name).read_bytes() for name in entry["files"]]))
    return result


def replay_replies(kind: str) -> list[list[bytes]]:
    folder = shared(CAPTURES / "runs" / "s1_basic_bs32" / "replay")
    index = json.loads((folder / f"replay_{kind}_index.json").read_text())
    return [[(folder / name).read_bytes() for name in reply["files"]] for reply in index["replies"]]


def requests(run: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for path in sorted(shared(CAPTURES / "runs" / run).glob("requests*.json")):
        found.extend(json.loads(path.read_text())["requests"])
    return found


def run_info(run: str) -> dict[str, Any]:
    info: dict[str, Any] = json.loads(shared(CAPTURES / "index.json").read_text())["runs"][run]
    return info


def model_dir() -> Path:
    return shared(CAPTURES / "model")
