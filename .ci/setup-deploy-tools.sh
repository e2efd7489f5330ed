#!/usr/bin/env bash
# Install the deployment checkers into their own venv, cached by path between runs on the same machine; print the
# venv's python.
#
# The venv holds kubernetes-validate (the Kubernetes API's JSON schemas, bundled: no cluster, no download),
# podman-compose (a compose implementation, for its own `config`), check-jsonschema (with the compose
# specification's schema vendored) and the openai client the image's smoke test talks through. Versions are
# pinned so a new release cannot change what CI accepts; a venv that already has them is reused (a second).
# Knobs (environment): KVROUTER_DEPLOY_TOOLS_VENV (default ${XDG_CACHE_HOME:-$HOME/.cache}/kvrouter/deploy-tools-venv),
# KVROUTER_DEPLOY_TOOLS_PYTHON (interpreter that creates the venv, default python3).
# Output: progress on stderr; VENV/bin/python alone on stdout.
set -euo pipefail

venv="${KVROUTER_DEPLOY_TOOLS_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvrouter/deploy-tools-venv}"
python="${KVROUTER_DEPLOY_TOOLS_PYTHON:-python3}"
requirements=(kubernetes-validate==1.37.0 podman-compose==1.6.0 check-jsonschema==0.39.0 "openai>=1.30,<4")

log() { echo "setup-deploy-tools: $*" >&2; }

works() {
    [ -x "$venv/bin/python" ] || return 1
    "$venv/bin/python" - "${requirements[@]}" >/dev/null 2>&1 <<'PY'
import sys
from importlib.metadata import version

import openai  # noqa: F401
from packaging.requirements import Requirement

for line in sys.argv[1:]:
    requirement = Requirement(line)
    assert requirement.specifier.contains(version(requirement.name)), line
PY
}

if works; then
    log "reusing $venv"
    echo "$venv/bin/python"
    exit 0
fi

start=$(date +%s)
if [ -f "$venv/pyvenv.cfg" ]; then
    log "$venv lacks one of ${requirements[*]}: rebuilding it"
    rm -rf "$venv"
fi
mkdir -p "$(dirname "$venv")"
"$python" -m venv "$venv"
log "installing ${requirements[*]}"
pip_log="$venv/pip-install.log"
if ! "$venv/bin/python" -m pip install --quiet "${requirements[@]}" packaging >"$pip_log" 2>&1; then
    tail -n 20 "$pip_log" >&2
    log "pip could not install ${requirements[*]} (log: $pip_log)"
    exit 1
fi
if ! works; then
    log "installed into $venv, but the tools do not import at the pinned versions"
    exit 1
fi
log "installed in $(( $(date +%s) - start )) s"
echo "$venv/bin/python"
