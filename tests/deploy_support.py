"""Readers for the deployment files: the Dockerfile, the compose file (with `${VAR:-default}` interpolation),
the Kubernetes manifests and vLLM's command line, so the deploy tests compare them with kvrouter's own models."""

from __future__ import annotations

import json
import random
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
COMPOSE_FILE = DEPLOY / "docker-compose.yaml"

_VARIABLE = re.compile(
    r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?::?-(?P<default>[^}]*))|(?::?\?(?P<required>[^}]*)))?\}"
)
COMPOSE_TEST_PASSWORD = "compose-test-password"
"""REDIS_PASSWORD for reading the compose file (it refuses to start without one, like `${VAR:?message}`)."""


class MissingVariable(ValueError):
    """A ``${NAME:?message}`` whose variable is unset or empty: `docker compose` refuses the file."""


def _substitute(match: re.Match[str], env: dict[str, str]) -> str:
    value = env.get(match["name"])
    if value:
        return value
    if match["required"] is not None:
        raise MissingVariable(f"{match['name']}: {match['required']}")
    return match["default"] or ""


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's `${NAME}` / `${NAME:-default}` / `${NAME:?error}` substitution, recursively."""
    if isinstance(value, str):
        return _VARIABLE.sub(lambda m: _substitute(m, env), value)
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    return value


def load_compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    raw = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    return dict(interpolate(raw, {"REDIS_PASSWORD": COMPOSE_TEST_PASSWORD, **(env or {})}))


def compose_environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) for item in env)
    return {str(key): "" if value is None else str(value) for key, value in env.items()}


def compose_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path -> host path (relative to deploy/) of every bind mount."""
    mounts: dict[str, Path] = {}
    for volume in service.get("volumes") or []:
        parts = str(volume).split(":")
        if len(parts) >= 2 and parts[0].startswith((".", "/")):
            mounts[parts[1]] = (DEPLOY / parts[0]).resolve()
    return mounts


def services_in(compose: dict[str, Any], profile: str | None) -> dict[str, dict[str, Any]]:
    """Services that `docker compose [--profile P] up` starts."""
    return {
        name: service
        for name, service in compose["services"].items()
        if not service.get("profiles") or (profile is not None and profile in service["profiles"])
    }


@dataclass
class Instruction:
    keyword: str
    arguments: str
    stage: int


@dataclass
class Dockerfile:
    instructions: list[Instruction] = field(default_factory=list)
    stages: list[str] = field(default_factory=list)

    def in_stage(self, stage: int, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.stage == stage and i.keyword == keyword]

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def parse_dockerfile(path: Path) -> Dockerfile:
    """Instructions with continuation lines joined and comments dropped; each tagged with its stage number."""
    result = Dockerfile()
    logical = ""
    lines: list[str] = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        stripped = raw.strip()
        if not logical and (not stripped or stripped.startswith("#")):
            continue
        if logical and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            logical += stripped[:-1] + " "
            continue
        lines.append(logical + stripped)
        logical = ""
    stage = -1
    for line in lines:
        keyword, _, arguments = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
            result.stages.append(arguments.strip())
        result.instructions.append(Instruction(keyword, arguments.strip(), stage))
    return result


def exec_form(arguments: str) -> list[str]:
    """The JSON array of an exec-form instruction (after any --flags)."""
    start = arguments.index("[")
    value = json.loads(arguments[start:])
    assert isinstance(value, list)
    return [str(item) for item in value]


def load_manifests() -> list[dict[str, Any]]:
    documents: list[dict[str, Any]] = []
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text(encoding="utf-8"))
    for resource in kustomization["resources"]:
        for document in yaml.safe_load_all((KUBERNETES / resource).read_text(encoding="utf-8")):
            if document:
                documents.append(document)
    return documents


def find(manifests: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for document in manifests:
        if document["kind"] == kind and document["metadata"]["name"] == name:
            return document
    raise AssertionError(f"no {kind} {name} in deploy/kubernetes")


def of_kind(manifests: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [document for document in manifests if document["kind"] == kind]


@dataclass
class VllmFlags:
    """What kvrouter depends on in a vLLM replica's command line."""

    values: dict[str, str]
    switches: set[str]

    @classmethod
    def parse(cls, argv: list[str]) -> VllmFlags:
        values: dict[str, str] = {}
        switches: set[str] = set()
        index = 0
        while index < len(argv):
            item = argv[index]
            if item.startswith("--") and "=" in item:
                name, value = item.split("=", 1)
                values[name] = value
            elif item.startswith("--") and index + 1 < len(argv) and not argv[index + 1].startswith("--"):
                values[item] = argv[index + 1]
                index += 1
            elif item.startswith("--"):
                switches.add(item)
            index += 1
        return cls(values, switches)

    @property
    def kv_events(self) -> dict[str, Any]:
        config = json.loads(self.values["--kv-events-config"])
        assert isinstance(config, dict)
        return config


def port_of(address: str) -> int:
    port = urlsplit(address).port
    assert port is not None, address
    return port


def host_of(address: str) -> str:
    host = urlsplit(address).hostname
    assert host is not None, address
    return host


def free_block(count: int) -> int:
    """A port p such that p .. p+count-1 are all free on 127.0.0.1 right now."""
    for _ in range(200):
        start = random.randrange(20000, 60000 - count)
        sockets = []
        try:
            for port in range(start, start + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return start
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no free port block")
