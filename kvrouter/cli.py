"""`kvrouter` and its subcommands.

`kvrouter --replicas replicas.yaml` serves (the default subcommand). The others — sim, relay, bench, replay,
demo — each live in their own module, which exposes `add_arguments(parser)` and `run(args) -> int`; this file
only dispatches, so a subcommand's imports (locust, matplotlib, zmq) cost nothing to the others.
Exit codes: 0 ok, 1 runtime failure, 2 bad configuration or arguments.

`kvrouter --help` is the router's own help (its flags) with the other commands listed on top; `kvrouter
--version` prints the installed distribution's version (pyproject.toml is its only source). transformers'
advisory "PyTorch was not found" is switched off here, for this process and its children: kvrouter only
ever loads tokenizers, which need no PyTorch, and the line misled every user. Its real warnings still print.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Protocol, cast

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvrouter.serve", "run the router (the default)"),
    "sim": ("kvrouter.sim.cli", "serve simulated vLLM replicas"),
    "relay": ("kvrouter.relay", "relay vLLM KV events from ZMQ into Redis"),
    "bench": ("kvrouter.bench", "load-test routing policies against simulated replicas with Locust"),
    "replay": ("kvrouter.replay.cli", "replay a trace against simulated engines on a virtual clock"),
    "demo": ("kvrouter.demo", "a two-minute round-robin vs KV-aware comparison on simulated replicas"),
}


class _Subcommand(Protocol):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def _load(module_name: str) -> _Subcommand:
    return cast(_Subcommand, importlib.import_module(module_name))


def package_version() -> str:
    """The installed distribution's version: pyproject.toml's, through the package metadata (no other copy)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvrouter")
    except PackageNotFoundError:
        return "unknown (kvrouter is not installed: pip install .)"


def _serve_description() -> str:
    commands = "\n".join(f"  {name:8s} {help_text}" for name, (_, help_text) in SUBCOMMANDS.items())
    return (
        f"Run the router (the default command); its options are below.\n\ncommands:\n{commands}\n\n"
        "`kvrouter COMMAND --help` shows a command's options. Settings also come from KVROUTER_* environment\n"
        "variables; flags win (docs/configuration.md lists every setting)."
    )


def build_parser(command: str) -> argparse.ArgumentParser:
    module_name, help_text = SUBCOMMANDS[command]
    if command == "serve":
        parser = argparse.ArgumentParser(
            prog="kvrouter",
            usage="kvrouter [serve] --replicas replicas.yaml [options]\n       kvrouter COMMAND [options]",
            description=_serve_description(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        parser.add_argument("--version", action="version", version=f"kvrouter {package_version()}")
    else:
        parser = argparse.ArgumentParser(prog=f"kvrouter {command}", description=help_text)
    _load(module_name).add_arguments(parser)
    return parser


def quiet_transformers_advice() -> None:
    """Switch off transformers' advisory warnings ("PyTorch was not found ..."), inherited by child processes.
    Only `logger.warning_advice` reads this variable; warnings and errors are unaffected. A value the user set
    wins."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def main(argv: Sequence[str] | None = None) -> int:
    quiet_transformers_advice()
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--version"]:
        print(f"kvrouter {package_version()}")
        return 0
    command = "serve"
    if args and args[0] in SUBCOMMANDS:
        command = args.pop(0)
    parser = build_parser(command)
    namespace = parser.parse_args(args)
    return _load(SUBCOMMANDS[command][0]).run(namespace)


if __name__ == "__main__":
    sys.exit(main())
