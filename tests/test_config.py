"""`kvrouter serve` configuration: env and flags, replicas.yaml, and one clear line with exit code 2 on errors."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvrouter import cli, serve
from kvrouter.config import ConfigError, load_fleet

SMALLEST = 'replicas: [{name: a, url: "http://127.0.0.1:8001"}, {name: b, url: "http://127.0.0.1:8002"}]\n'


def write(tmp_path: Path, text: str, name: str = "replicas.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser("serve").parse_args(list(argv))


def test_smallest_file_gets_defaults(tmp_path: Path) -> None:
    fleet = load_fleet(write(tmp_path, SMALLEST))
    assert [r.name for r in fleet.replicas] == ["a", "b"]
    assert fleet.replicas[1].base_url == "http://127.0.0.1:8002"
    assert fleet.block_size == 16 and fleet.replicas[0].weight == 1.0 and fleet.replicas[0].kv_events is None


def test_flags_override_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, SMALLEST)
    monkeypatch.setenv("KVROUTER_PORT", "9100")
    monkeypatch.setenv("KVROUTER_POLICY", "least_loaded")
    monkeypatch.setenv("KVROUTER_REPLICAS", str(path))
    settings, fleet = serve.load_configuration(parse("--port", "9200", "--workers", "3"))
    assert settings.port == 9200 and settings.policy == "least_loaded" and settings.workers == 3
    assert settings.replicas == path and len(fleet.replicas) == 2
    settings = serve.settings_from_args(parse("--redis-url", "redis://127.0.0.1:1/0", "--log-level", "debug"))
    assert settings.redis_url == "redis://127.0.0.1:1/0" and settings.log_level == "debug"


def run_serve(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize(
    ("yaml_text", "expected"),
    [
        ("replicas: [}", "not valid YAML"),
        ("- a\n- b\n", "expected a mapping with a 'replicas' list"),
        ("replicas: []\n", "field 'replicas'"),
        ('replicas: [{name: a, url: "not a url"}]\n', "field 'replicas.0.url'"),
        (
            'replicas: [{name: a, url: "http://h:1/v1"}]\n',
            "field 'replicas.0.url': Value error, 'http://h:1/v1' has '/v1'",
        ),
        ('replicas: [{name: a, url: "http://h:1/v1/"}]\n', "drop it (e.g. http://h:1)"),
        ('replicas: [{name: a, url: "http://h:1/v1/chat/completions"}]\n', "appends /v1/chat/completions"),
        (
            'replicas: [{name: a, url: "http://h:1/?api=1"}]\n',
            "field 'replicas.0.url': Value error, 'http://h:1/?api=1' has a query",
        ),
        ('replicas: [{name: a, url: "http://h:1#top"}]\n', "has a query or fragment"),
        ('replicas: [{name: a, url: "http://h:1", weight: -1}]\n', "field 'replicas.0.weight'"),
        ('replicas: [{name: a, url: "http://h:1", colour: red}]\n', "field 'replicas.0.colour'"),
        ('replicas: [{name: a, url: "http://h:1"}, {name: a, url: "http://h:2"}]\n', "appears twice"),
        ('replicas: [{name: a, url: "http://h:1"}]\nblock_size: 0\n', "field 'block_size'"),
    ],
)
def test_bad_replicas_file_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], yaml_text: str, expected: str
) -> None:
    path = write(tmp_path, yaml_text)
    code, err = run_serve(capsys, "--replicas", str(path))
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("kvrouter: ")
    assert str(path) in err and expected in err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (("--port", "70000"), "setting 'port' (--port / KVROUTER_PORT)"),
        (("--port", "eighty"), "setting 'port'"),
        (("--policy", "random"), "setting 'policy' (--policy / KVROUTER_POLICY)"),
        (("--workers", "0"), "setting 'workers'"),
        (("--log-level", "loud"), "setting 'log_level'"),
        (("--read-timeout", "-1"), "setting 'read_timeout_s' (--read-timeout"),
    ],
)
def test_bad_flag_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], expected: str
) -> None:
    path = write(tmp_path, SMALLEST)
    code, err = run_serve(capsys, "--replicas", str(path), *argv)
    assert code == 2
    assert err.count("\n") == 1 and expected in err, err
    assert argv[1] in err  # the offending value is quoted back


def test_bad_environment_value_names_the_variable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVROUTER_MAX_RETRIES", "lots")
    code, err = run_serve(capsys, "--replicas", str(write(tmp_path, SMALLEST)))
    assert code == 2 and "KVROUTER_MAX_RETRIES" in err and err.count("\n") == 1


def test_a_negative_tokenizer_inline_bound_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVROUTER_TOKENIZER_INLINE_CHARS", "-1")
    code, err = run_serve(capsys, "--replicas", str(write(tmp_path, SMALLEST)))
    assert code == 2 and err.count("\n") == 1, err
    assert "KVROUTER_TOKENIZER_INLINE_CHARS" in err and "greater than or equal to 0" in err, err


def test_missing_replicas_and_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_serve(capsys)
    assert code == 2 and "--replicas" in err and err.count("\n") == 1
    code, err = run_serve(capsys, "--replicas", str(tmp_path / "absent.yaml"))
    assert code == 2 and "absent.yaml: cannot read the file" in err


def test_unavailable_policy_is_a_configuration_error(tmp_path: Path) -> None:
    from kvrouter.config import Settings
    from kvrouter.policies import build_policy

    with pytest.raises(ConfigError, match="policy"):
        build_policy("fastest", Settings())


def test_a_path_prefix_without_v1_is_kept(tmp_path: Path) -> None:
    # A gateway prefix is a legitimate base URL; only /v1 (which the router appends itself) is refused.
    path = write(tmp_path, 'replicas: [{name: a, url: "http://127.0.0.1:8001/pool-a/"}]\n')
    assert load_fleet(path).replicas[0].base_url == "http://127.0.0.1:8001/pool-a"
