"""The operator docs stay true: generated references are current, and every flag, variable, metric, endpoint and
link the hand-written pages name exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvrouter import docgen
from kvrouter.config import Settings, parse_fleet
from kvrouter.server.app import create_app
from tests.deploy_support import REPO, VllmFlags, load_compose

DOCS = REPO / "docs"
OPERATOR_PAGES = ("operations.md", "runbook.md", "scaling.md", "configuration.md", "metrics.md")


def test_generated_references_are_current(tmp_path: Path) -> None:
    for name, render in (("configuration.md", docgen.render_configuration), ("metrics.md", docgen.render_metrics)):
        committed = (DOCS / name).read_text(encoding="utf-8")
        assert committed == render(), f"docs/{name} is out of date: run `python -m kvrouter.docgen`"
    assert docgen.main(["--check"]) == 0
    # --check notices a stale file and the writer fixes it.
    (tmp_path / "configuration.md").write_text("stale", encoding="utf-8")
    assert docgen.main(["--check", "--docs", str(tmp_path)]) == 1
    assert docgen.main(["--docs", str(tmp_path)]) == 0
    assert docgen.main(["--check", "--docs", str(tmp_path)]) == 0


def test_configuration_reference_lists_every_setting_and_field() -> None:
    from kvrouter.config import FleetConfig, KvEventsConfig, ReplicaConfig

    text = (DOCS / "configuration.md").read_text(encoding="utf-8")
    for name in Settings.model_fields:
        assert f"`KVROUTER_{name.upper()}`" in text, name
    for model in (FleetConfig, ReplicaConfig, KvEventsConfig):
        for name in model.model_fields:
            assert f"| `{name}` |" in text, (model.__name__, name)


def page(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors."""
    found = set()
    for heading in re.findall(r"^#+ (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        found.add(slug)
    return found


@pytest.mark.parametrize("name", OPERATOR_PAGES)
def test_links_resolve(name: str) -> None:
    for target in re.findall(r"\]\(([^)\s]+)\)", page(name)):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        resolved = (DOCS / path).resolve() if path else DOCS / name
        assert resolved.exists(), f"{name}: {target}"
        if anchor:
            assert anchor in anchors(resolved.read_text(encoding="utf-8")), f"{name}: {target}"


def metrics_exported() -> set[str]:
    return set(re.findall(r"^\| `([a-z_:]+)` \|", page("metrics.md"), re.M))


@pytest.mark.parametrize("name", ("operations.md", "runbook.md", "scaling.md"))
def test_named_metrics_and_variables_exist(name: str) -> None:
    text = page(name)
    exported = metrics_exported()
    for metric in set(re.findall(r"\b(kvrouter_[a-z_]+)", text)):
        base = re.sub(r"_(bucket|sum|count)$", "", metric)
        assert metric in exported or base in exported, f"{name} names {metric}, which kvrouter does not export"
    settings = {f"KVROUTER_{field.upper()}" for field in Settings.model_fields}
    for variable in set(re.findall(r"\b(KVROUTER_[A-Z_]+)", text)):
        assert variable in settings | {"KVROUTER_FLEET"}, f"{name} names {variable}, which is no setting"


def test_documented_vllm_command_is_the_deployed_one() -> None:
    block = re.search(r"```\n(python3 -m vllm\.entrypoints\.openai\.api_server.*?)```", page("operations.md"), re.S)
    assert block is not None
    argv = shlex.split(block[1].replace("\\\n", " "))[3:]
    documented = VllmFlags.parse(argv)
    deployed = VllmFlags.parse([str(item) for item in load_compose()["services"]["vllm-0"]["command"]])
    assert documented.switches == deployed.switches
    assert documented.kv_events == deployed.kv_events
    assert {k: v for k, v in documented.values.items() if k not in ("--kv-events-config", "--host", "--port")} == {
        k: v for k, v in deployed.values.items() if k not in ("--kv-events-config", "--host", "--port")
    }


def test_documented_endpoints_exist() -> None:
    fleet = parse_fleet({"replicas": [{"name": "vllm-1", "url": "http://127.0.0.1:9"}]}, Path("replicas.yaml"))
    app = create_app(Settings(), fleet, registry=CollectorRegistry())
    routes = {(route.method, route.resource.canonical) for route in app.router.routes() if route.resource}
    text = page("operations.md")
    for method, path in re.findall(r"`(GET|POST) (/[a-z0-9_/{}.-]+)`", text):
        assert (method, path) in routes, f"operations.md documents {method} {path}"
    for path in re.findall(r"http://router:8000(/[a-z/0-9-]+)", text):
        concrete = {re.sub(r"\{name\}", "vllm-1", canonical) for _, canonical in routes}
        assert path in concrete, path
