"""The deployment files agree with each other and with kvrouter itself.

No Docker engine or cluster runs here, so each file is read and checked against what it must match: the
Dockerfile's required instructions; compose and Kubernetes environment variables against `Settings`; every
replicas.yaml through `load_fleet`; every kvrouter command line through kvrouter's own argument parsers; vLLM's
flags against the fleet (block size, model name, event ports); load balancer, Prometheus and Grafana targets
against the services and ports that exist.
"""

from __future__ import annotations

import argparse
import asyncio
import fnmatch
import json
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from pydantic import ValidationError

from kvrouter.cli import SUBCOMMANDS, build_parser
from kvrouter.config import FleetConfig, Settings, load_fleet, parse_fleet
from tests.deploy_support import (
    COMPOSE_TEST_PASSWORD,
    DEPLOY,
    KUBERNETES,
    REPO,
    MissingVariable,
    VllmFlags,
    compose_environment,
    compose_mounts,
    exec_form,
    find,
    host_of,
    load_compose,
    load_manifests,
    of_kind,
    parse_dockerfile,
    port_of,
    services_in,
)
from tests.shared_data import ci_tool

FLEET_FILES = {"replicas": "gpu", "replicas-sim": "sim"}
"""deploy/<name>.yaml -> the compose profile whose replicas it lists (KVROUTER_FLEET selects it)."""
ROUTER_SERVICES = ("router-1", "router-2")
NON_ROOT_UID = 10001


def parse_command(command: list[str]) -> tuple[str, argparse.Namespace]:
    """kvrouter's own parsing of a container's arguments: (subcommand, namespace); fails like the CLI would."""
    args = list(command)
    name = "serve"
    if args and args[0] in SUBCOMMANDS:
        name = args.pop(0)
    parser = build_parser(name)
    parser.exit_on_error = False
    try:
        return name, parser.parse_args(args)
    except (argparse.ArgumentError, SystemExit) as error:
        raise AssertionError(f"kvrouter {name} rejects {command}: {error}") from None


def variables_read_by_kvrouter() -> set[str]:
    """KVROUTER_* variables some module reads itself (outside Settings), e.g. the tokenizer cache directory."""
    names: set[str] = set()
    for module in (REPO / "kvrouter").rglob("*.py"):
        names.update(re.findall(r"[\"'](KVROUTER_[A-Z0-9_]+)[\"']", module.read_text(encoding="utf-8")))
    return names


def settings_from_env(env: dict[str, str]) -> Settings:
    """Every KVROUTER_* variable must name a Settings field (or one kvrouter reads), and the values must validate."""
    fields = {f"KVROUTER_{name.upper()}": name for name in Settings.model_fields}
    known = set(fields) | variables_read_by_kvrouter()
    unknown = sorted(name for name in env if name.startswith("KVROUTER_") and name not in known)
    assert not unknown, f"not kvrouter settings: {unknown}"
    values = {fields[name]: value for name, value in env.items() if name in fields and value != ""}
    try:
        return Settings(**values)
    except ValidationError as error:
        raise AssertionError(f"settings do not validate: {error}") from None


# -- every file parses ----------------------------------------------------------------------------------------


YAML_FILES = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_parses(path: Path) -> None:
    documents = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]
    assert documents and all(isinstance(d, dict) for d in documents)


@pytest.mark.parametrize("path", sorted(DEPLOY.rglob("*.json")), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_json_parses(path: Path) -> None:
    assert isinstance(json.loads(path.read_text(encoding="utf-8")), dict)


@pytest.mark.parametrize("name", sorted(FLEET_FILES))
def test_deploy_fleets_validate(name: str) -> None:
    fleet = load_fleet(DEPLOY / f"{name}.yaml")
    assert fleet.tokenizer is not None and fleet.model == "namazu"
    assert all(r.kv_events is not None and r.kv_events.replay_endpoint for r in fleet.replicas)


# -- Dockerfile -----------------------------------------------------------------------------------------------


def test_dockerfile_is_multi_stage_slim_and_non_root() -> None:
    dockerfile = parse_dockerfile(REPO / "Dockerfile")
    args = dict(i.arguments.split("=", 1) for i in dockerfile.all("ARG") if "=" in i.arguments)
    stages = [re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], s) for s in dockerfile.stages]
    assert len(stages) >= 2
    final = len(stages) - 1
    base = stages[final].split()[0]
    assert re.fullmatch(r"python:3\.11(\.\d+)?-slim(-\w+)?", base), base
    assert stages[0].split()[0] == base, "build and runtime stages share one base"
    assert any("--from=" in i.arguments for i in dockerfile.in_stage(final, "COPY"))
    users = dockerfile.in_stage(final, "USER")
    assert users, "the final stage must switch user"
    user = users[-1].arguments.split(":")[0]
    assert user not in ("root", "0")
    assert user == str(NON_ROOT_UID)
    # Nothing after USER runs as root in the final stage, and no build tools are installed there.
    final_runs = " ".join(i.arguments for i in dockerfile.in_stage(final, "RUN"))
    for tool in ("build-essential", "gcc", "g++", "make ", "apt-get install", "pip install"):
        assert tool not in final_runs, f"{tool!r} in the final stage"
    assert "build-essential" in " ".join(i.arguments for i in dockerfile.in_stage(0, "RUN"))


def test_dockerfile_entrypoint_healthcheck_and_port() -> None:
    dockerfile = parse_dockerfile(REPO / "Dockerfile")
    final = len(dockerfile.stages) - 1
    assert exec_form(dockerfile.in_stage(final, "ENTRYPOINT")[-1].arguments) == ["kvrouter"]
    command = exec_form(dockerfile.in_stage(final, "CMD")[-1].arguments)
    _, namespace = parse_command(command)
    assert namespace.replicas == "/etc/kvrouter/replicas.yaml"
    healthcheck = dockerfile.in_stage(final, "HEALTHCHECK")
    assert healthcheck and "CMD" in healthcheck[-1].arguments
    env = " ".join(i.arguments for i in dockerfile.in_stage(final, "ENV"))
    port = int(re.search(r"KVROUTER_PORT=(\d+)", env)[1])  # type: ignore[index]
    assert dockerfile.in_stage(final, "EXPOSE")[-1].arguments == str(port) == str(Settings().port)
    settings_from_env(dict(re.findall(r"(KVROUTER_\w+)=(\S+)", env)))


def dockerignore_excludes(path: str) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes."""
    excluded = False
    for line in (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        parts = path.split("/")
        if any(fnmatch.fnmatch("/".join(parts[: i + 1]), pattern) for i in range(len(parts))) or fnmatch.fnmatch(
            path, pattern.replace("**/", "*")
        ):
            excluded = not negate
    return excluded


def test_dockerignore_keeps_what_the_build_copies() -> None:
    dockerfile = parse_dockerfile(REPO / "Dockerfile")
    copied = [
        source
        for instruction in dockerfile.all("COPY")
        if "--from=" not in instruction.arguments
        for source in instruction.arguments.split()[:-1]
        if not source.startswith("--")
    ]
    assert copied
    for source in copied:
        assert (REPO / source).exists(), source
        assert not dockerignore_excludes(source.rstrip("/")), f".dockerignore drops {source}"
    for module in (REPO / "kvrouter").rglob("*.py"):
        assert not dockerignore_excludes(str(module.relative_to(REPO))), module
    for kept_out in ("tests/test_admin.py", ".git/config", "deploy/replicas.yaml", ".ci-venv/bin/python"):
        assert dockerignore_excludes(kept_out), kept_out


# -- compose --------------------------------------------------------------------------------------------------


def vllm_argv(service: dict[str, Any]) -> list[str]:
    entrypoint = service.get("entrypoint") or []
    assert entrypoint[-1] == "vllm.entrypoints.openai.api_server" or entrypoint[:2] == ["vllm", "serve"]
    return [str(item) for item in service["command"]]


def check_vllm_flags(flags: VllmFlags, fleet: FleetConfig, replica_port: int, kv_port: int, replay_port: int) -> None:
    assert flags.values["--tensor-parallel-size"] == "4"
    assert {"--enable-prefix-caching", "--enable-prompt-tokens-details"} <= flags.switches
    assert int(flags.values["--block-size"]) == fleet.block_size
    assert flags.values["--served-model-name"] == fleet.model
    assert int(flags.values["--port"]) == replica_port
    events = flags.kv_events
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    # vLLM binds only when its endpoint has '*' (or '::'); replicas.yaml then connects (bind: false).
    assert host_of(events["endpoint"]) == "*" and port_of(events["endpoint"]) == kv_port
    assert host_of(events["replay_endpoint"]) == "*" and port_of(events["replay_endpoint"]) == replay_port
    for replica in fleet.replicas:
        assert replica.kv_events is not None and replica.kv_events.bind is False
        assert replica.kv_events.topic == events["topic"]


@pytest.mark.parametrize("fleet_name", sorted(FLEET_FILES))
def test_compose_routers_and_relay_agree_with_kvrouter(fleet_name: str) -> None:
    compose = load_compose({"KVROUTER_FLEET": fleet_name})
    services = services_in(compose, FLEET_FILES[fleet_name])
    redis_port = 6379
    for name in (*ROUTER_SERVICES, "relay"):
        service = services[name]
        subcommand, namespace = parse_command([str(item) for item in service["command"]])
        assert subcommand == ("relay" if name == "relay" else "serve")
        mounts = compose_mounts(service)
        fleet_path = mounts[namespace.replicas]
        assert fleet_path == DEPLOY / f"{fleet_name}.yaml"
        fleet = load_fleet(fleet_path)
        if fleet.tokenizer and fleet.tokenizer.startswith("/models/"):
            assert fleet.tokenizer in mounts or name == "relay", f"{name} does not mount {fleet.tokenizer}"
        env = compose_environment(service)
        settings = settings_from_env(env)
        redis_url = settings.redis_url
        assert redis_url is not None and host_of(redis_url) == "redis" and port_of(redis_url) == redis_port
        # The password reaches Redis through the environment, never a command line.
        assert urlsplit(redis_url).password == COMPOSE_TEST_PASSWORD
        assert not any(COMPOSE_TEST_PASSWORD in str(item) for item in service["command"])
        assert "redis" in (service.get("depends_on") or {})
        if name == "relay":
            health = " ".join(service["healthcheck"]["test"])
            assert f"127.0.0.1:{namespace.metrics_port}/metrics" in health
        else:
            assert settings.host == "0.0.0.0"
            health = " ".join(service["healthcheck"]["test"])
            assert f"127.0.0.1:{settings.port}/ready" in health


@pytest.mark.parametrize("fleet_name", sorted(FLEET_FILES))
def test_compose_replicas_match_the_fleet_file(fleet_name: str) -> None:
    profile = FLEET_FILES[fleet_name]
    compose = load_compose({"KVROUTER_FLEET": fleet_name})
    services = services_in(compose, profile)
    fleet = load_fleet(DEPLOY / f"{fleet_name}.yaml")
    for replica in fleet.replicas:
        host = host_of(replica.base_url)
        assert host == replica.name and host in services, f"{host} is not a service of profile {profile}"
        assert replica.kv_events is not None
        assert host_of(replica.kv_events.endpoint) == host
        service = services[host]
        kv_port, replay_port = port_of(replica.kv_events.endpoint), port_of(replica.kv_events.replay_endpoint or "")
        if profile == "gpu":
            flags = VllmFlags.parse(vllm_argv(service))
            check_vllm_flags(flags, fleet, port_of(replica.base_url), kv_port, replay_port)
            devices = service["deploy"]["resources"]["reservations"]["devices"][0]
            assert len(devices["device_ids"]) == 4 and devices["capabilities"] == ["gpu"]
        else:
            _, namespace = parse_command([str(item) for item in service["command"]])
            check_sim_arguments(namespace, port_of(replica.base_url), kv_port, replay_port, fleet)
    # No two replicas share GPUs.
    if profile == "gpu":
        ids = [
            device
            for name in (r.name for r in fleet.replicas)
            for device in services[name]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        ]
        assert len(ids) == len(set(ids))


def check_sim_arguments(
    namespace: argparse.Namespace, http_port: int, kv_port: int, replay_port: int, fleet: FleetConfig
) -> None:
    """One simulated replica per container, listening where the fleet file says, with the fleet's block size."""
    from kvrouter.sim.cli import layouts

    assert namespace.replicas == 1 and namespace.host == "0.0.0.0"
    [layout] = layouts(1, namespace.base_port, namespace.kv_base_port)
    assert (layout.http_port, layout.pub_port, layout.replay_port) == (http_port, kv_port, replay_port)
    assert namespace.block_size == fleet.block_size and namespace.model_name == fleet.model
    assert str(namespace.tokenizer) == fleet.tokenizer


def test_compose_gpu_and_sim_profiles_do_not_overlap() -> None:
    compose = load_compose()
    gpu, sim = set(services_in(compose, "gpu")), set(services_in(compose, "sim"))
    common = services_in(compose, None)
    assert gpu - set(common) == {"vllm-0", "vllm-1"}
    assert sim - set(common) == {"sim-0", "sim-1"}
    assert {"redis", "relay", "lb", "prometheus", "grafana", *ROUTER_SERVICES} <= set(common)


def test_compose_load_balancer_fronts_every_router() -> None:
    compose = load_compose()
    nginx = (DEPLOY / "nginx.conf").read_text(encoding="utf-8")
    upstream = re.search(r"upstream kvrouter \{(.*?)\}", nginx, re.S)
    assert upstream is not None
    servers = set(re.findall(r"server\s+([\w.-]+:\d+)", upstream[1]))
    expected = {
        f"{name}:{settings_from_env(compose_environment(compose['services'][name])).port}" for name in ROUTER_SERVICES
    }
    assert servers == expected
    listen = int(re.search(r"listen\s+(\d+);", nginx)[1])  # type: ignore[index]
    published = compose["services"]["lb"]["ports"][0].split(":")
    assert int(published[-1]) == listen
    assert "proxy_buffering off" in nginx and re.search(r"proxy_read_timeout\s+600s", nginx)
    assert compose_mounts(compose["services"]["lb"])["/etc/nginx/nginx.conf"] == DEPLOY / "nginx.conf"


def test_prometheus_scrapes_routers_and_every_replica() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text(encoding="utf-8"))
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    compose = load_compose()
    router_targets = {t for group in jobs["kvrouter"]["static_configs"] for t in group["targets"]}
    assert router_targets == {
        f"{name}:{settings_from_env(compose_environment(compose['services'][name])).port}" for name in ROUTER_SERVICES
    }
    _, relay = parse_command([str(item) for item in compose["services"]["relay"]["command"]])
    assert {t for group in jobs["kvrouter-relay"]["static_configs"] for t in group["targets"]} == {
        f"relay:{relay.metrics_port}"
    }
    engine_targets = {t for group in jobs["vllm"]["static_configs"] for t in group["targets"]}
    for fleet_name in FLEET_FILES:
        for replica in load_fleet(DEPLOY / f"{fleet_name}.yaml").replicas:
            assert f"{host_of(replica.base_url)}:{port_of(replica.base_url)}" in engine_targets
    # The engines' series carry the replica's name, as kvrouter's do, so panels can put them side by side.
    assert any(rule.get("target_label") == "replica" for rule in jobs["vllm"]["relabel_configs"])
    mounts = compose_mounts(compose["services"]["prometheus"])
    assert mounts["/etc/prometheus/prometheus.yml"] == DEPLOY / "prometheus.yml"


def test_grafana_provisioning_points_at_prometheus_and_the_dashboard() -> None:
    compose = load_compose()
    grafana = compose["services"]["grafana"]
    mounts = compose_mounts(grafana)
    provisioning = mounts["/etc/grafana/provisioning"]
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text(encoding="utf-8"))
    source = datasources["datasources"][0]
    prometheus_port = int(compose["services"]["prometheus"]["ports"][0].split(":")[-1])
    assert source["url"] == f"http://prometheus:{prometheus_port}"
    providers = yaml.safe_load((provisioning / "dashboards" / "kvrouter.yaml").read_text(encoding="utf-8"))
    dashboards_path = providers["providers"][0]["options"]["path"]
    host_dir = mounts[dashboards_path]
    dashboard = json.loads((host_dir / "kvrouter.json").read_text(encoding="utf-8"))
    assert dashboard["uid"] == "kvrouter"
    default = next(v for v in dashboard["templating"]["list"] if v["type"] == "datasource")
    assert default["current"]["value"] == source["uid"]
    home = compose_environment(grafana)["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{dashboards_path}/kvrouter.json"


def test_promtool_accepts_the_prometheus_config() -> None:
    import subprocess

    promtool = ci_tool("promtool", "prometheus")
    result = subprocess.run(
        [promtool, "check", "config", "--syntax-only", str(DEPLOY / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# -- Kubernetes -------------------------------------------------------------------------------------------------


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    for item in workload["spec"]["template"]["spec"]["containers"]:
        if item["name"] == name:
            return dict(item)
    raise AssertionError(f"no container {name}")


def container_env(item: dict[str, Any]) -> dict[str, str]:
    return {entry["name"]: str(entry.get("value", "")) for entry in item.get("env", [])}


def k8s_fleet(manifests: list[dict[str, Any]]) -> FleetConfig:
    config_map = find(manifests, "ConfigMap", "kvrouter-fleet")
    return parse_fleet(yaml.safe_load(config_map["data"]["replicas.yaml"]), Path("kvrouter-fleet/replicas.yaml"))


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text(encoding="utf-8"))
    on_disk = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == on_disk
    kinds = {(d["kind"], d["metadata"]["name"]) for d in load_manifests()}
    for expected in (
        ("Deployment", "kvrouter"),
        ("Service", "kvrouter"),
        ("HorizontalPodAutoscaler", "kvrouter"),
        ("PodDisruptionBudget", "kvrouter"),
        ("Deployment", "kvrouter-relay"),
        ("Deployment", "redis"),
        ("Service", "redis"),
        ("StatefulSet", "vllm"),
        ("Service", "vllm"),
        ("ConfigMap", "kvrouter-fleet"),
    ):
        assert expected in kinds, expected


def test_k8s_selectors_and_ports_line_up() -> None:
    manifests = load_manifests()
    workloads = of_kind(manifests, "Deployment") + of_kind(manifests, "StatefulSet")
    for workload in workloads:
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for service in of_kind(manifests, "Service"):
        selector = service["spec"]["selector"]
        matched = [w for w in workloads if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert matched, f"Service {service['metadata']['name']} selects nothing"
        port_names = {
            port["name"] for w in matched for c in w["spec"]["template"]["spec"]["containers"] for port in c["ports"]
        }
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names, (service["metadata"]["name"], port)
    router = find(manifests, "Deployment", "kvrouter")
    router_labels = router["spec"]["template"]["metadata"]["labels"]
    assert find(manifests, "PodDisruptionBudget", "kvrouter")["spec"]["selector"]["matchLabels"].items() <= (
        router_labels.items()
    )
    hpa = find(manifests, "HorizontalPodAutoscaler", "kvrouter")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "kvrouter"}
    assert hpa["spec"]["minReplicas"] >= 2
    assert find(manifests, "PodDisruptionBudget", "kvrouter")["spec"]["minAvailable"] < hpa["spec"]["minReplicas"]
    for workload in workloads:
        spec = workload["spec"]["template"]["spec"]
        volumes = {v["name"] for v in spec.get("volumes", [])}
        for item in spec["containers"]:
            for mount in item.get("volumeMounts", []):
                assert mount["name"] in volumes, (workload["metadata"]["name"], mount)
            config_maps = {v["configMap"]["name"] for v in spec.get("volumes", []) if "configMap" in v}
            assert config_maps <= {"kvrouter-fleet"}


def test_k8s_router_matches_kvrouter() -> None:
    manifests = load_manifests()
    router = find(manifests, "Deployment", "kvrouter")
    item = container(router, "kvrouter")
    settings = settings_from_env(container_env(item))
    assert {e["name"] for e in item["env"]} >= {"KVROUTER_REDIS_URL", "KVROUTER_ADMIN_TOKEN"}
    _, namespace = parse_command(item["args"])
    mounts = {m["mountPath"]: m for m in item["volumeMounts"]}
    assert str(Path(namespace.replicas).parent) in mounts
    fleet = k8s_fleet(manifests)
    assert fleet.tokenizer is not None and fleet.tokenizer in mounts
    http = next(p for p in item["ports"] if p["name"] == "http")
    assert http["containerPort"] == settings.port
    assert item["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert item["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http"}
    pod = router["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == NON_ROOT_UID
    assert pod["terminationGracePeriodSeconds"] > settings.shutdown_grace_s
    annotations = router["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(settings.port) and annotations["prometheus.io/path"] == "/metrics"
    assert settings.redis_url is not None
    redis = find(manifests, "Service", host_of(settings.redis_url))
    assert port_of(settings.redis_url) in {p["port"] for p in redis["spec"]["ports"]}


def test_k8s_relay_matches_kvrouter() -> None:
    manifests = load_manifests()
    item = container(find(manifests, "Deployment", "kvrouter-relay"), "relay")
    env = container_env(item)
    settings = settings_from_env(env)
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], a) for a in item["args"]]
    subcommand, namespace = parse_command(args)
    assert subcommand == "relay"
    assert "--redis-url" not in args, "the Redis URL (with its password) belongs in the environment"
    assert settings.redis_url is not None and host_of(settings.redis_url) == "redis"
    relay = find(manifests, "Deployment", "kvrouter-relay")
    annotations = relay["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(namespace.metrics_port)
    assert {"name": "metrics", "containerPort": namespace.metrics_port} in item["ports"]
    mounts = {m["mountPath"] for m in item["volumeMounts"]}
    assert str(Path(namespace.replicas).parent) in mounts


def test_k8s_vllm_replicas_match_the_fleet() -> None:
    manifests = load_manifests()
    statefulset = find(manifests, "StatefulSet", "vllm")
    service = find(manifests, "Service", statefulset["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    fleet = k8s_fleet(manifests)
    expected_hosts = [f"vllm-{i}.{service['metadata']['name']}" for i in range(statefulset["spec"]["replicas"])]
    assert [host_of(r.base_url) for r in fleet.replicas] == expected_hosts
    item = container(statefulset, "vllm")
    assert item["resources"]["limits"]["nvidia.com/gpu"] == 4
    flags = VllmFlags.parse([*item["command"][3:], *item["args"]])
    ports = {p["name"]: p["containerPort"] for p in item["ports"]}
    for replica in fleet.replicas:
        assert replica.kv_events is not None and replica.kv_events.replay_endpoint is not None
        assert port_of(replica.base_url) == ports["http"]
        check_vllm_flags(
            flags, fleet, ports["http"], port_of(replica.kv_events.endpoint), port_of(replica.kv_events.replay_endpoint)
        )
        assert port_of(replica.kv_events.endpoint) == ports["kv-events"]
        assert port_of(replica.kv_events.replay_endpoint) == ports["kv-replay"]


def test_compose_and_k8s_run_vllm_the_same_way() -> None:
    compose = load_compose()
    compose_flags = VllmFlags.parse(vllm_argv(compose["services"]["vllm-0"]))
    item = container(find(load_manifests(), "StatefulSet", "vllm"), "vllm")
    k8s_flags = VllmFlags.parse(item["args"])
    assert compose_flags == k8s_flags
    assert compose["services"]["vllm-0"]["image"] == item["image"]
    assert compose["services"]["vllm-0"]["entrypoint"] == item["command"]
    compose_fleet = load_fleet(DEPLOY / "replicas.yaml")
    assert k8s_fleet(load_manifests()).model_dump(exclude={"replicas"}) == compose_fleet.model_dump(
        exclude={"replicas"}
    )


def test_the_image_builds_the_tokenizer_the_sim_fleet_names(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvrouter.tinymodel import cache_root

    dockerfile = parse_dockerfile(REPO / "Dockerfile")
    build_runs = " ".join(i.arguments for i in dockerfile.in_stage(0, "RUN"))
    assert "ensure_tokenizer()" in build_runs
    cache_dir = re.search(r"KVROUTER_CACHE_DIR=(\S+) python", build_runs)
    assert cache_dir is not None
    monkeypatch.setenv("KVROUTER_CACHE_DIR", cache_dir[1])
    assert load_fleet(DEPLOY / "replicas-sim.yaml").tokenizer == str(cache_root() / "tiny-tokenizer")
    final = len(dockerfile.stages) - 1
    assert any(cache_dir[1] in i.arguments for i in dockerfile.in_stage(final, "COPY"))


# -- the health checks really work against a running router --------------------------------------------------


def run_check(argv: list[str], port: int) -> int:
    import subprocess
    import sys

    program = [sys.executable if argv[0] in ("python", "python3") else argv[0], *argv[1:]]
    program = [item.replace("127.0.0.1:8000", f"127.0.0.1:{port}") for item in program]
    env = {**os.environ, "KVROUTER_PORT": str(port)}
    return subprocess.run(program, env=env, capture_output=True, timeout=30, check=False).returncode


async def test_image_and_compose_health_checks_against_a_live_router(
    fake_replicas: Any, make_router: Any, unused_tcp_port: int
) -> None:
    replicas = await fake_replicas(1)
    client = await make_router(replicas)
    port = client.server.port
    dockerfile = parse_dockerfile(REPO / "Dockerfile")
    image_check = exec_form(dockerfile.in_stage(len(dockerfile.stages) - 1, "HEALTHCHECK")[-1].arguments)
    compose_check = load_compose()["services"]["router-1"]["healthcheck"]["test"][1:]
    assert await asyncio.to_thread(run_check, image_check, port) == 0
    assert await asyncio.to_thread(run_check, compose_check, port) == 0
    # No replica left: /health answers 503, the process is still alive for the image check.
    await replicas[0].stop()
    for _ in range(5):
        await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert (await client.get("/health")).status == 503
    assert await asyncio.to_thread(run_check, image_check, port) == 0
    # Nothing listening: both checks fail.
    assert await asyncio.to_thread(run_check, image_check, unused_tcp_port) != 0
    assert await asyncio.to_thread(run_check, compose_check, unused_tcp_port) != 0


# -- Redis requires a password -----------------------------------------------------------------------------------


def test_compose_redis_requires_a_password_and_compose_refuses_to_start_without_one() -> None:
    with pytest.raises(MissingVariable, match="REDIS_PASSWORD"):
        load_compose({"REDIS_PASSWORD": ""})
    redis = load_compose()["services"]["redis"]
    command = [str(item) for item in redis["command"]]
    assert command[command.index("--requirepass") + 1] == COMPOSE_TEST_PASSWORD
    # The health check authenticates (REDISCLI_AUTH) and needs PONG: NOAUTH would fail it.
    assert compose_environment(redis)["REDISCLI_AUTH"] == COMPOSE_TEST_PASSWORD
    assert "PONG" in " ".join(redis["healthcheck"]["test"])


def secret_ref(item: dict[str, Any], name: str) -> dict[str, Any] | None:
    for entry in item.get("env", []):
        if entry["name"] == name:
            return entry.get("valueFrom", {}).get("secretKeyRef")
    return None


def test_k8s_redis_requires_the_password_from_a_secret_the_router_and_relay_send() -> None:
    manifests = load_manifests()
    redis = container(find(manifests, "Deployment", "redis"), "redis")
    assert redis["args"][redis["args"].index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert secret_ref(redis, "REDIS_PASSWORD") == {"name": "kvrouter-redis", "key": "password"}
    assert "PONG" in " ".join(redis["readinessProbe"]["exec"]["command"])
    for deployment, name in (("kvrouter", "kvrouter"), ("kvrouter-relay", "relay")):
        item = container(find(manifests, "Deployment", deployment), name)
        assert secret_ref(item, "REDIS_PASSWORD") == {"name": "kvrouter-redis", "key": "password"}
        names = [entry["name"] for entry in item["env"]]
        # Kubernetes expands $(REDIS_PASSWORD) only from variables defined before it.
        assert names.index("REDIS_PASSWORD") < names.index("KVROUTER_REDIS_URL")
        url = container_env(item)["KVROUTER_REDIS_URL"]
        assert urlsplit(url).password == "$(REDIS_PASSWORD)" and host_of(url) == "redis"
