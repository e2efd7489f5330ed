"""The data beside the checkout (../shared) and the tools .ci/run installs: what a test does when one is missing.

On a developer's machine a missing trace, capture, anchor or tool skips the test with its path or package name.
Under CI (`CI=true`: .ci/run runs with a copy of shared/ beside the clone and installs redis-server and
Prometheus) the same absence is a broken setup, so the test fails with that message instead of passing quietly.
Every test takes these paths from here: `shared(PATH)` inside a test or its fixture, `requires_shared(PATH)` as a
module's autouse fixture when all its tests need the data, `ci_tool(name, package)` for an installed binary.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
MOONCAKE_CONVERSATION = SHARED / "traces" / "mooncake" / "conversation_trace.jsonl"
GMI_TRACE = SHARED / "traces" / "lmbench_gmi" / "gmi_trace.jsonl"
VLLM_CAPTURES = SHARED / "fixtures" / "vllm-kv-events"
DYNAMO_ANCHORS = SHARED / "anchors" / "dynamo-1.6.1-replay"


def in_ci() -> bool:
    """CI=true (or any other truthy value) in the environment, as .ci/run's caller sets it."""
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def unavailable(reason: str) -> NoReturn:
    """Skip with `reason`; under CI fail with it, because CI provides everything the tests need."""
    if in_ci():
        pytest.fail(f"{reason}; required under CI", pytrace=False)
    pytest.skip(reason)


def shared(path: Path) -> Path:
    """`path` (under SHARED) when it exists; otherwise skip here, fail under CI, naming the path."""
    if not path.exists():
        unavailable(f"shared test data not found at {path} (../shared beside the checkout)")
    return path


def requires_shared(*paths: Path) -> Callable[[], None]:
    """An autouse fixture for a module all of whose tests need `paths`: `_shared_data = requires_shared(PATH)`."""

    @pytest.fixture(scope="module", autouse=True)  # module scope: checked before the module's other fixtures
    def _shared_data() -> None:
        for path in paths:
            shared(path)

    return _shared_data


def ci_tool(name: str, package: str) -> str:
    """The path of a binary .ci/run installs (Debian `package`); skip without it here, fail under CI."""
    binary = shutil.which(name)
    if binary is None:
        unavailable(f"{name} is not installed (Debian package `{package}`)")
    return binary
