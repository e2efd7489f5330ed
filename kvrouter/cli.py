"""`kvrouter` and its subcommands.

`kvrouter --replicas replicas.yaml` serves (the default subcommand). The others — sim, relay, bench, replay,
demo — each live in their own module, which exposes `add_arguments(parser)` and `run(args) -> int`; this file
only dispatches, so a subcommand's imports (locust, matplotlib, zmq) cost nothing to the others.
Exit codes: 0 ok, 1 runtime failure, 2 bad configuration or arguments.
"""

from __future__ import annotations

import argparse
import importlib
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


def build_parser(command: str) -> argparse.ArgumentParser:
    module_name, help_text = SUBCOMMANDS[command]
    prog = "kvrouter" if command == "serve" else f"kvrouter {command}"
    parser = argparse.ArgumentParser(prog=prog, description=help_text)
    _load(module_name).add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help") and len(args) == 1:
        print("usage: kvrouter [serve] --replicas replicas.yaml [options]\n       kvrouter COMMAND [options]\n")
        print("commands:")
        for name, (_, help_text) in SUBCOMMANDS.items():
            print(f"  {name:8s} {help_text}")
        print("\n`kvrouter COMMAND --help` shows a command's options.")
        return 0
    command = "serve"
    if args and args[0] in SUBCOMMANDS:
        command = args.pop(0)
    parser = build_parser(command)
    namespace = parser.parse_args(args)
    return _load(SUBCOMMANDS[command][0]).run(namespace)


if __name__ == "__main__":
    sys.exit(main())
