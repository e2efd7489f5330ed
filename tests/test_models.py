"""Two models behind one router, on real sockets: simulated vLLM replicas serving `alpha` (one tokenizer, 16-token
blocks) and `beta` (another tokenizer, 32-token blocks), each publishing KV events over ZMQ, and the router built
from a `models:` replicas.yaml. Requests never cross fleets, each fleet's index holds only its own replicas'
blocks, and the whole-router endpoints (/v1/models, /health, /ready, /metrics, /admin) cover both fleets."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvrouter.config import ModelsConfig, parse_models
from kvrouter.index import PrefixIndex
from kvrouter.server.app import INDEX
from kvrouter.server.fleets import MODELS, create_models_app
from kvrouter.tinymodel import build_tokenizer, ensure_tokenizer
from tests.conftest import eventually, router_settings
from tests.sim_fleet_support import SimFleetFactory, chat, sim_fleet

__all__ = ["sim_fleet"]  # the fixture, imported for pytest

ADMIN = {"Authorization": "Bearer admin-secret"}
ALPHA = frozenset({"a0", "a1"})
BETA = frozenset({"b0", "b1"})


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two different tokenizers: the tiny one, and one trained with a smaller vocabulary (other token ids)."""
    return ensure_tokenizer(), build_tokenizer(tmp_path_factory.mktemp("tok") / "small", vocab_size=1024)


async def two_models(
    sim_fleet: SimFleetFactory, tokenizers: tuple[Path, Path], aiohttp_client: Any, **settings: Any
) -> TestClient[Any, Any]:
    alpha_tok, beta_tok = tokenizers
    alpha = [await sim_fleet.start(name, "alpha", alpha_tok, 16) for name in sorted(ALPHA)]
    beta = [await sim_fleet.start(name, "beta", beta_tok, 32, ("beta-sql",)) for name in sorted(BETA)]
    config = models_config(alpha_tok, beta_tok, [r.config() for r in alpha], [r.config() for r in beta])
    app = create_models_app(router_settings(policy="kv_aware", admin_token="admin-secret", **settings), config)
    client: TestClient[Any, Any] = await aiohttp_client(app)
    await asyncio.sleep(0.3)  # the router's SUB sockets connect before the first event is published
    return client


def models_config(alpha_tok: Path, beta_tok: Path, alpha: list[Any], beta: list[Any]) -> ModelsConfig:
    return parse_models(
        {
            "models": [
                {
                    "model": "alpha",
                    "aliases": ["alpha-latest"],
                    "tokenizer": str(alpha_tok),
                    "block_size": 16,
                    "replicas": alpha,
                },
                {
                    "model": "beta",
                    "tokenizer": str(beta_tok),
                    "block_size": 32,
                    "hash_seed": 7,
                    "lora_adapters": ["beta-sql"],
                    "policy": "least_loaded",
                    "replicas": beta,
                },
            ]
        },
        Path("models.yaml"),
    )


def index_of(client: TestClient[Any, Any], model: str) -> PrefixIndex:
    fleet = client.app[MODELS].by_name[model]
    return fleet.app[INDEX]


def prompt(topic: str) -> str:
    return f"Explain {topic} to a new engineer, with examples from a large codebase. " * 12


async def served_by(client: TestClient[Any, Any], body: dict[str, Any]) -> str:
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == 200, await response.text()
    await response.read()
    return response.headers["x-kvrouter-replica"]


async def test_requests_never_cross_fleets_and_indexes_stay_apart(
    sim_fleet: SimFleetFactory, tokenizers: tuple[Path, Path], aiohttp_client: Any
) -> None:
    client = await two_models(sim_fleet, tokenizers, aiohttp_client)
    served: dict[str, set[str]] = {"alpha": set(), "alpha-latest": set(), "beta": set(), "beta-sql": set()}
    for turn in range(4):
        for model in served:
            served[model].add(await served_by(client, chat(model, prompt(f"topic {turn}"))))
            served[model].add(await served_by(client, chat(model, prompt(f"topic {turn}"), stream=True)))
    assert served["alpha"] | served["alpha-latest"] <= ALPHA
    assert served["beta"] | served["beta-sql"] <= BETA
    assert served["beta"] == BETA  # least_loaded (beta's own policy) spreads sequential requests over both
    alpha_index, beta_index = index_of(client, "alpha"), index_of(client, "beta")
    assert alpha_index is not beta_index
    await eventually(lambda: sum(alpha_index.block_counts().values()) > 0, what="alpha's KV events")
    await eventually(lambda: sum(beta_index.block_counts().values()) > 0, what="beta's KV events")
    # Event-confirmed blocks and provisional marks alike: each index knows only its own fleet's replicas.
    assert alpha_index.replicas() <= ALPHA and beta_index.replicas() <= BETA
    assert set(alpha_index.block_counts()) <= ALPHA and set(beta_index.block_counts()) <= BETA

    # A prompt only alpha has seen: alpha's index credits the replica that served it, beta's has nothing of it.
    fresh = prompt("the prefix cache")
    replica = await served_by(client, chat("alpha", fresh))
    await eventually(lambda: alpha_index.blocks_of(replica) > 0, what="the fresh prompt's events")

    async def route(model: str) -> dict[str, Any]:
        response = await client.post("/debug/route", json=chat(model, fresh), headers=ADMIN)
        assert response.status == 200, await response.text()
        decision: dict[str, Any] = await response.json()
        assert decision["model"] == model
        return decision

    in_alpha = await route("alpha")
    assert {c["replica"] for c in in_alpha["candidates"]} == ALPHA
    assert in_alpha["chosen"] == replica
    assert next(c["cached_tokens"] for c in in_alpha["candidates"] if c["replica"] == replica) >= 16
    in_beta = await route("beta")
    assert {c["replica"] for c in in_beta["candidates"]} == BETA
    assert all(c["cached_tokens"] == 0 for c in in_beta["candidates"])
    # The two fleets tokenize differently: the same text is a different token count in each.
    assert in_alpha["prompt_tokens"] != in_beta["prompt_tokens"]


async def test_unknown_missing_models_listing_metrics_and_admin(
    sim_fleet: SimFleetFactory, tokenizers: tuple[Path, Path], aiohttp_client: Any
) -> None:
    client = await two_models(sim_fleet, tokenizers, aiohttp_client)
    unknown = await client.post("/v1/chat/completions", json=chat("gamma", "hello"))
    assert unknown.status == 404
    assert await unknown.json() == {
        "error": {
            "message": "The model `gamma` does not exist.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    missing = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    assert missing.status == 400
    error = (await missing.json())["error"]
    assert error["param"] == "model" and "alpha, beta" in error["message"]
    not_json = await client.post("/v1/chat/completions", data=b"{", headers={"Content-Type": "application/json"})
    assert not_json.status == 400 and "error" in await not_json.json()
    assert (await client.post("/debug/route", json=chat("gamma", "hi"), headers=ADMIN)).status == 404

    # The pass-through paths dispatch by the body's model too (the sim answers /tokenize).
    tokenized = await client.post("/tokenize", json={"model": "beta", "prompt": "hello"})
    assert tokenized.status == 200 and tokenized.headers["x-kvrouter-replica"] in BETA
    assert (await client.post("/tokenize", json={"model": "gamma", "prompt": "hello"})).status == 404
    assert (await client.post("/tokenize", json={"prompt": "hello"})).status == 400
    not_allowed = await client.post("/reset_prefix_cache", json={"model": "beta"})
    assert not_allowed.status == 404 and (await not_allowed.json())["error"]["code"] == "not_found"

    listed = await client.get("/v1/models")
    assert listed.status == 200
    entries = {entry["id"]: entry for entry in (await listed.json())["data"]}
    assert {"alpha", "alpha-latest", "beta", "beta-sql"} <= set(entries)
    assert entries["beta-sql"]["parent"] == "beta"

    for model in ("alpha", "beta"):
        await served_by(client, chat(model, prompt("metrics")))
    text = await (await client.get("/metrics")).text()
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert [name for name, count in Counter(types).items() if count > 1] == []
    families = {family.name: family for family in text_string_to_metric_families(text)}
    requests = families["kvrouter_requests"].samples
    assert {s.labels["model"] for s in requests} == {"alpha", "beta"}
    assert all(s.labels["replica"] in (ALPHA if s.labels["model"] == "alpha" else BETA) for s in requests)
    assert {s.labels.get("model") for s in families["kvrouter_fleet_saturation"].samples} == {"alpha", "beta"}
    assert all("model" not in s.labels for s in families["kvrouter_client_connections"].samples)

    health = await client.get("/health")
    assert health.status == 200
    body = await health.json()
    assert body["status"] == "ok" and set(body["models"]) == {"alpha", "beta"}
    assert {name: view["model"] for name, view in body["replicas"].items()} == {
        "a0": "alpha",
        "a1": "alpha",
        "b0": "beta",
        "b1": "beta",
    }
    ready = await client.get("/ready")
    assert ready.status == 200 and "beta/replicas" in (await ready.json())["checks"]

    reload = await client.post("/admin/reload", headers=ADMIN)
    assert reload.status == 409 and (await reload.json())["error"]["code"] == "reload_refused"
    assert (await client.post("/admin/reload")).status == 401
    drained = await client.post("/admin/replicas/b0/drain", headers=ADMIN)
    assert drained.status == 200 and (await drained.json())["model"] == "beta"
    assert {await served_by(client, chat("beta", prompt(f"drained {n}"))) for n in range(4)} == {"b1"}
    listed_replicas = (await (await client.get("/admin/replicas", headers=ADMIN)).json())["replicas"]
    assert {(r["name"], r["model"]) for r in listed_replicas} >= {("b0", "beta"), ("a0", "alpha")}
    assert (await client.post("/admin/replicas/zz/drain", headers=ADMIN)).status == 404
    queue = await (await client.get("/debug/queue", headers=ADMIN)).json()
    assert set(queue["models"]) == {"alpha", "beta"}
