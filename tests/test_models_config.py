"""A replicas.yaml with a `models:` list: its validation (one clear line per mistake), its reading next to the
one-fleet shape, `kvrouter serve` refusing a bad one with exit code 2, and how a reload treats LoRA placement."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrouter import cli
from kvrouter.admin.fleet import ReloadRefused, plan_reload
from kvrouter.config import ConfigError, FleetConfig, ModelsConfig, load_fleet, load_router_config, parse_fleet

TWO = """\
models:
  - model: alpha
    aliases: [alpha-latest]
    tokenizer: tok-a
    block_size: 16
    replicas: [{name: a0, url: "http://127.0.0.1:8001"}]
  - model: beta
    policy: least_loaded
    lora_adapters: [beta-sql]
    replicas:
      - {name: b0, url: "http://127.0.0.1:8002", lora_adapters: [beta-chat]}
      - {name: b1, url: "http://127.0.0.1:8003"}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "replicas.yaml"
    path.write_text(text)
    return path


def test_models_file_reads_every_fleet(tmp_path: Path) -> None:
    config = load_router_config(write(tmp_path, TWO))
    assert isinstance(config, ModelsConfig)
    alpha, beta = config.models
    assert alpha.tokenizer == str(tmp_path / "tok-a") and alpha.block_size == 16
    assert alpha.served_names == ("alpha", "alpha-latest")
    assert beta.policy == "least_loaded" and beta.block_size == 16
    assert beta.served_names == ("beta", "beta-chat", "beta-sql")
    assert beta.adapters_of(beta.replicas[0]) == {"beta-sql", "beta-chat"}
    assert beta.adapters_of(beta.replicas[1]) == {"beta-sql"}


def test_one_fleet_file_reads_as_before(tmp_path: Path) -> None:
    config = load_router_config(write(tmp_path, 'replicas: [{name: a, url: "http://127.0.0.1:8001"}]\n'))
    assert isinstance(config, FleetConfig) and config.replicas[0].name == "a"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (TWO.replace("name: b0", "name: a0"), "replica name 'a0' appears in two fleets"),
        (TWO.replace("aliases: [alpha-latest]", "aliases: [beta]"), "model name 'beta' is served by models[0] and"),
        (TWO.replace("[beta-chat]", "[alpha-latest]"), "model name 'alpha-latest' is served by models[0] and"),
        (TWO.replace("  - model: beta\n", "  - block_size: 16\n"), "models[1] has no 'model'"),
        (TWO.replace("policy: least_loaded", "policy: fastest"), "field 'models.1.policy'"),
        ("models: []\n", "field 'models'"),
        (TWO + 'replicas: [{name: z, url: "http://h:1"}]\n', "has both 'replicas' (one fleet) and 'models'"),
    ],
)
def test_models_file_mistakes_are_one_line(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_router_config(write(tmp_path, text))
    message = str(raised.value)
    assert expected in message and "\n" not in message and str(tmp_path) in message


def test_a_one_fleet_reader_names_the_models_shape(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="has a 'models' list"):
        load_fleet(write(tmp_path, TWO))


def test_serve_exits_2_on_a_bad_models_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, TWO.replace("name: b0", "name: a0"))
    assert cli.main(["serve", "--replicas", str(path)]) == 2
    err = capsys.readouterr().err
    assert "appears in two fleets" in err and err.count("\n") == 1


def fleet(b0_adapters: list[str], b1_adapters: list[str]) -> FleetConfig:
    return parse_fleet(
        {
            "replicas": [
                {"name": "b0", "url": "http://127.0.0.1:8002", "lora_adapters": b0_adapters},
                {"name": "b1", "url": "http://127.0.0.1:8003", "lora_adapters": b1_adapters},
            ]
        },
        Path("replicas.yaml"),
    )


def test_reload_moves_an_adapter_but_refuses_a_new_name() -> None:
    plan = plan_reload(fleet(["sql"], []), fleet([], ["sql"]))
    assert {r.name for r in plan.replaced} == {"b0", "b1"}
    with pytest.raises(ReloadRefused, match="LoRA adapter names changed"):
        plan_reload(fleet(["sql"], []), fleet(["sql"], ["chat"]))
