"""Read the real vLLM KV-event captures in ../shared/fixtures/vllm-kv-events (skip when absent)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

CAPTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "vllm-kv-events"
needs_captures = pytest.mark.skipif(
    not CAPTURES.is_dir(), reason=f"vLLM KV-event captures not found at {CAPTURES}"
)


@dataclass(frozen=True)
class Message:
    number: int
    frames: list[bytes]


def frame_dirs() -> list[Path]:
    return sorted(p for p in (CAPTURES / "runs").glob("*/frames*") if p.is_dir())


def messages(frames_dir: Path) -> list[Message]:
    result = []
    for line in (frames_dir / "index.jsonl").read_text().splitlines():
        entry = json.loads(line)
        result.append(Message(entry["msg"], [(frames_dir / name).read_bytes() for name in entry["files"]]))
    return result


def replay_replies(kind: str) -> list[list[bytes]]:
    folder = CAPTURES / "runs" / "s1_basic_bs32" / "replay"
    index = json.loads((folder / f"replay_{kind}_index.json").read_text())
    return [[(folder / name).read_bytes() for name in reply["files"]] for reply in index["replies"]]


def requests(run: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for path in sorted((CAPTURES / "runs" / run).glob("requests*.json")):
        found.extend(json.loads(path.read_text())["requests"])
    return found


def run_info(run: str) -> dict[str, Any]:
    info: dict[str, Any] = json.loads((CAPTURES / "index.json").read_text())["runs"][run]
    return info


def model_dir() -> Path:
    return CAPTURES / "model"
