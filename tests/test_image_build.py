"""The image build (.ci/build-image.sh) fails, and says why, when the Dockerfile is broken.

CI builds the image from the Dockerfile and runs it from the inside on every run; this test shows once that a
broken Dockerfile line stops that step instead of passing quietly. The break is the build stage's first RUN, so
podman fails right after the base (cached by path, as .ci/run's image step leaves it) and the test stays cheap.
It needs root, podman and mmdebstrap (.ci/run's image step installs both before pytest runs): skipped without
them here, failed under CI.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.shared_data import ci_tool, unavailable

REPO = Path(__file__).resolve().parents[1]


def test_a_broken_dockerfile_line_fails_the_image_build(tmp_path: Path) -> None:
    ci_tool("podman", "podman")
    ci_tool("mmdebstrap", "mmdebstrap")
    if os.geteuid() != 0:
        unavailable("the image build runs as root (podman --isolation chroot)")
    dockerfile = (REPO / "Dockerfile").read_text(encoding="utf-8")
    broken = dockerfile.replace("RUN apt-get update", "RUN apt-get update-the-world", 1)
    assert broken != dockerfile, "the Dockerfile's build stage no longer starts with RUN apt-get update"
    (tmp_path / "Dockerfile").write_text(broken, encoding="utf-8")

    result = subprocess.run(
        ["bash", str(REPO / ".ci" / "build-image.sh")],
        env={
            **os.environ,
            "KVROUTER_IMAGE_DOCKERFILE": str(tmp_path / "Dockerfile"),
            "KVROUTER_IMAGE_TAG": "localhost/kvrouter:broken-dockerfile-test",
        },
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )

    assert result.returncode != 0, result.stderr[-2000:]
    assert f"FAILED: podman build of {tmp_path / 'Dockerfile'} failed" in result.stderr, result.stderr[-2000:]
    # The failing step's own words come with it, so the log says which line broke.
    assert "update-the-world" in result.stderr
    assert "image localhost/kvrouter" not in result.stdout
