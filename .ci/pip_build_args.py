"""Print the podman build options that give pip inside an image build the package index this machine uses.

Reads `python3 -m pip config list` (the configuration files and the PIP_* environment, in pip's own order:
environment over the `install` section over `global`) for the settings that decide where packages come from:
index-url, extra-index-url, find-links, constraint, trusted-host and cert. Each becomes
`--build-arg=PIP_NAME=value` (the Dockerfile's build stage declares those arguments), and every local path among
the values (a folder of wheels, a constraint or CA file; for a file:// index, the folder above its simple/, where
its files are) becomes `--volume=PATH:PATH:ro`, so the same values work unchanged inside the build. A configured
path that does not exist is reported on stderr and not mounted (pip there warns about it as it does here).
One option per line on stdout; none without configuration.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

SETTINGS = ("index-url", "extra-index-url", "find-links", "constraint", "trusted-host", "cert")
SECTIONS = (":env:", "install", "global")  # pip's precedence, strongest first
LISTS = ("extra-index-url", "find-links", "trusted-host")  # space-separated lists
INDEXES = ("index-url", "extra-index-url")


def pip_config(python: str) -> dict[str, str]:
    """`section.key` -> value, as `pip config list` prints them (`global.find-links='/opt/wheels'`)."""
    listing = subprocess.run([python, "-m", "pip", "config", "list"], check=True, capture_output=True, text=True)
    entries: dict[str, str] = {}
    for line in listing.stdout.splitlines():
        name, sep, value = line.partition("=")
        if sep and len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            entries[name] = value[1:-1]
    return entries


def effective(entries: dict[str, str]) -> dict[str, str]:
    """The value pip uses for each setting of SETTINGS that is configured at all."""
    chosen: dict[str, str] = {}
    for setting in SETTINGS:
        for section in SECTIONS:
            if f"{section}.{setting}" in entries:
                chosen[setting] = entries[f"{section}.{setting}"]
                break
    return chosen


def local_path(value: str) -> Path | None:
    """The local file or folder a value names (file:// URL or absolute path); None for a remote URL or a host."""
    parts = urlsplit(value)
    if parts.scheme == "file":
        return Path(unquote(parts.path))
    if not parts.scheme and value.startswith("/"):
        return Path(value)
    return None


def build_options(settings: dict[str, str]) -> tuple[list[str], list[str]]:
    """(podman build options, warnings) for these settings."""
    options: list[str] = []
    warnings: list[str] = []
    mounts: list[Path] = []
    for setting, value in settings.items():
        options.append(f"--build-arg=PIP_{setting.upper().replace('-', '_')}={value}")
        for item in value.split() if setting in LISTS else [value]:
            path = local_path(item)
            if path is None:
                continue
            if setting in INDEXES:
                # A PEP 503 tree on disk links its files relative to simple/ (../../files/x.whl): mount the
                # folder that holds both.
                path = path.parent
            if not path.exists():
                warnings.append(f"pip's {setting} names {path}, which does not exist here: not mounted")
            elif path not in mounts:
                mounts.append(path)
    options.extend(f"--volume={path}:{path}:ro" for path in mounts)
    return options, warnings


def main() -> int:
    python = sys.argv[1] if len(sys.argv) > 1 else "python3"
    options, warnings = build_options(effective(pip_config(python)))
    for warning in warnings:
        print(f"pip_build_args: {warning}", file=sys.stderr)
    for option in options:
        print(option)
    return 0


if __name__ == "__main__":
    sys.exit(main())
