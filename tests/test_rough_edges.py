"""Rough edges a new user hit (issue 19), each reproduced through the command a user would type.

Real processes throughout: `kvrouter demo` / `bench` / `sim` started as subprocesses on 127.0.0.1, an import
blocked by a sitecustomize shim on PYTHONPATH (nothing uninstalled), child processes found through /proc and
stopped only by the pids this test started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from kvrouter import cli
from kvrouter.loadgen.fleet import kvrouter_argv, locust_argv, python_argv

ROOT = Path(__file__).resolve().parents[1]

BLOCKER = """
import importlib.abc, os, sys

BLOCKED = set(os.environ["KVROUTER_TEST_BLOCK"].split(","))


class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None


sys.meta_path.insert(0, Blocker())
"""


def blocked_env(tmp_path: Path, *modules: str) -> dict[str, str]:
    shim = tmp_path / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(BLOCKER, encoding="utf-8")
    path = os.pathsep.join(p for p in (str(shim), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "KVROUTER_TEST_BLOCK": ",".join(modules)}


# -- the loadtest extra ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "blocked", "named"),
    [("demo", ("locust",), "locust does not import"), ("bench", ("locust", "matplotlib"), "locust and matplotlib")],
)
def test_without_the_loadtest_extra_exit_2_with_the_install_command(
    tmp_path: Path, command: str, blocked: tuple[str, ...], named: str
) -> None:
    # It used to print a table of dashes, "err 305", exit 0 and announce plots it had not written.
    out = tmp_path / "out"
    argv = kvrouter_argv(command, "--out", str(out), "--duration", "1", "--policies", "round_robin")
    env = blocked_env(tmp_path, *blocked)
    assert subprocess.run(python_argv("-c", "import locust"), env=env, capture_output=True).returncode != 0
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"kvrouter {command}: "), done.stderr
    assert named in done.stderr and "pip install 'kvrouter[loadtest]'" in done.stderr
    assert "---" not in done.stdout and "plots" not in done.stdout
    assert not out.exists()  # nothing started, nothing written


# -- children import the installed package ------------------------------------------------------------------------


def test_children_do_not_import_the_tree_they_are_started_from(tmp_path: Path) -> None:
    # Started from a source checkout, `python -m kvrouter.cli` put the working directory first on sys.path, so the
    # demo's children ran the checkout (pure-Python tables when it has no built .so), not the installed package.
    shadow = tmp_path / "kvrouter"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise SystemExit('imported the tree in the working directory')\n")
    (shadow / "cli.py").write_text("")
    naive = subprocess.run(
        [sys.executable, "-m", "kvrouter.cli", "--version"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert "imported the tree in the working directory" in naive.stderr  # the finding, reproduced
    child = subprocess.run(kvrouter_argv("--version"), cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert child.returncode == 0 and child.stdout.strip() == f"kvrouter {cli.package_version()}", child.stderr
    locust = locust_argv(host="http://127.0.0.1:1", users=1, run_time_s=1, csv_prefix=tmp_path / "c",
                         records=tmp_path / "r", flags=())  # fmt: skip
    assert locust[:4] == [sys.executable, "-P", "-m", "locust"]


# -- SIGTERM ------------------------------------------------------------------------------------------------------


def _ppid_and_state(pid: int) -> tuple[int, str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[1]), fields[0]


def descendants(root: int) -> dict[int, str]:
    """pid -> command line of every live descendant of `root` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            found = _ppid_and_state(int(entry.name))
            if found is not None and found[1] != "Z":
                children.setdefault(found[0], []).append(int(entry.name))
    result: dict[int, str] = {}
    todo = [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            try:
                result[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            todo.append(pid)
    return result


def alive(pid: int) -> bool:
    found = _ppid_and_state(pid)
    return found is not None and found[1] != "Z"


@dataclass
class Demo:
    process: subprocess.Popen[bytes]
    log: Path
    children: dict[int, str] = field(default_factory=dict)
    """The demo's descendants as last seen; whatever of them survives a failed test is killed by pid."""


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[Demo]:
    log = tmp_path / "demo.log"
    with log.open("wb") as handle:
        process = subprocess.Popen(
            kvrouter_argv("demo", "--out", str(tmp_path / "out"), "--duration", "30", "--policies", "round_robin"),
            stdout=handle, stderr=subprocess.STDOUT, cwd=tmp_path,
        )  # fmt: skip
    started = Demo(process, log)
    try:
        yield started
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        for pid in started.children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_demo_alone_stops_every_child(demo: Demo, signum: signal.Signals) -> None:
    # SIGTERM used to kill the demo alone and leave its simulated replicas, router and Locust running. Ctrl-C was
    # clean only because the terminal signals the whole process group; a SIGINT to the demo's pid alone is too now.
    deadline = time.monotonic() + 150
    while not any("-m locust" in command for command in demo.children.values()):
        assert demo.process.poll() is None, demo.log.read_text()
        assert time.monotonic() < deadline, f"the demo's children did not all start: {demo.children}"
        time.sleep(0.2)
        demo.children.update(descendants(demo.process.pid))
    commands = list(demo.children.values())
    assert any(" sim " in c for c in commands) and any("--policy" in c for c in commands)
    demo.process.send_signal(signum)
    assert demo.process.wait(timeout=60) == 128 + signum
    gone_by = time.monotonic() + 15
    while any(alive(pid) for pid in demo.children) and time.monotonic() < gone_by:
        time.sleep(0.1)
    assert not [command for pid, command in demo.children.items() if alive(pid)]
    assert f"interrupted by {signum.name}" in demo.log.read_text()


# -- help, version, noise -----------------------------------------------------------------------------------------


def test_top_level_help_lists_the_commands_and_the_router_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for needle in ("--replicas", "--policy", "--redis-url", "--admin-token", "--version", "demo", "bench", "sim"):
        assert needle in text


def test_bench_help_explains_its_templates_and_shows_no_machine_path(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = capsys.readouterr().out
    assert "see above" not in text and "see below" in text
    assert "{kv_event_source_flags}" in text and "{worker_urls}" in text
    assert str(ROOT.parent) not in text  # the default trace path of this machine


def test_version_has_one_source(capsys: pytest.CaptureFixture[str]) -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"kvrouter {declared}\n"
    copies = [path for path in (ROOT / "kvrouter").rglob("*.py") if f'"{declared}"' in path.read_text("utf-8")]
    assert copies == []
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8").splitlines()
    headings = [line for line in changelog if line.startswith("## ")]
    assert headings[0] == "## Unreleased" and any(line.startswith(f"## {declared} - ") for line in headings)
    # The Kubernetes overlay deploys the image of this version: a release bumps pyproject, and this check with it.
    kustomization = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "kustomization.yaml").read_text("utf-8"))
    assert [image["newTag"] for image in kustomization["images"] if image["name"] == "kvrouter"] == [declared]


def test_the_pytorch_advisory_is_silenced_but_warnings_are_not() -> None:
    script = (
        "from kvrouter import cli; cli.quiet_transformers_advice(); import transformers;"
        "from transformers.utils import logging; logging.get_logger('transformers').warning('a real warning')"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    quiet = subprocess.run(python_argv("-c", script), capture_output=True, text=True, env=env, timeout=120)
    assert quiet.returncode == 0, quiet.stderr
    assert "PyTorch was not found" not in quiet.stderr and "a real warning" in quiet.stderr
    try:
        import torch  # noqa: F401
    except ImportError:
        loud = subprocess.run(python_argv("-c", "import transformers"), capture_output=True, text=True, env=env)
        assert "PyTorch was not found" in loud.stderr  # the noise this removes


# -- kvrouter sim --host ------------------------------------------------------------------------------------------


def listening(port: int) -> set[str]:
    """Local IPv4 addresses (hex, as /proc/net/tcp writes them) listening on `port`."""
    addresses = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        address, hex_port = fields[1].split(":")
        if int(hex_port, 16) == port and fields[3] == "0A":
            addresses.add(address)
    return addresses


def start_sim_on_loopback(tmp_path: Path) -> tuple[subprocess.Popen[bytes], int, Path]:
    """`kvrouter sim --host 127.0.0.1` on four fresh ports, once its replicas.yaml is written; tries other ports
    when another process on this shared machine took one meanwhile."""
    from kvrouter.sim.cli import free_port_run

    for attempt in range(3):
        base = free_port_run(4)
        replicas_file = tmp_path / f"replicas-{attempt}.yaml"
        log = tmp_path / f"sim-{attempt}.log"
        argv = kvrouter_argv("sim", "--replicas", "1", "--host", "127.0.0.1", "--base-port", str(base),
                             "--kv-base-port", str(base + 2), "--write-replicas", str(replicas_file),
                             "--log-level", "warning")  # fmt: skip
        with log.open("wb") as handle:
            process = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not replicas_file.is_file() and process.poll() is None:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        if process.poll() is None:
            return process, base, replicas_file
        assert "in use" in log.read_text(), log.read_text()
    raise AssertionError("no free ports for the simulator in three tries")


@pytest.mark.timeout(180)
def test_sim_binds_its_event_sockets_on_host(tmp_path: Path) -> None:
    process, base, replicas_file = start_sim_on_loopback(tmp_path)
    try:
        events = yaml.safe_load(replicas_file.read_text())["replicas"][0]["kv_events"]
        assert events["endpoint"] == f"tcp://127.0.0.1:{base + 2}"
        loopback = "0100007F"
        assert listening(base) == {loopback}
        assert listening(base + 2) == {loopback} and listening(base + 3) == {loopback}  # not 00000000 (any)
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_sim_event_hosts() -> None:
    from kvrouter.sim.cli import event_bind_host, reach_host

    assert event_bind_host("0.0.0.0") == "*" and reach_host("0.0.0.0") == "127.0.0.1"
    assert event_bind_host("10.0.0.5") == "10.0.0.5" == reach_host("10.0.0.5")
    assert event_bind_host("::1") == "[::1]" == reach_host("::1")
