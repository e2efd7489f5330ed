#!/usr/bin/env bash
# Validate the deployment files with the tools their users run, offline: the Kubernetes manifests against the
# Kubernetes API's own schemas, the compose file through a compose implementation's `config` and against the
# compose specification's schema.
#
# Kubernetes: every file kustomization.yaml lists goes through `kubernetes-validate --strict` (unknown fields are
# errors, as `kubectl apply --validate=strict` makes them), and a manifest the kustomization does not list fails
# the check (it would never be applied). Compose: `podman-compose config` resolves every profile (`gpu`, `sim`)
# with a throwaway REDIS_PASSWORD (interpolation, merge keys, extends, ports and mounts must parse), then
# check-jsonschema holds the file to the compose specification's schema (unknown keys, wrong types).
# The tools come from .ci/setup-deploy-tools.sh (a venv cached by path). Knob: KVROUTER_DEPLOY_DIR (default deploy).
set -euo pipefail
cd "$(dirname "$0")/.."

deploy="${KVROUTER_DEPLOY_DIR:-deploy}"
log() { echo "validate-deploy: $*" >&2; }

tools_python=$(bash .ci/setup-deploy-tools.sh | tail -n 1)
tools="$(dirname "$tools_python")"

mapfile -t manifests < <("$tools_python" - "$deploy/kubernetes" <<'PY'
import sys
from pathlib import Path

import yaml

folder = Path(sys.argv[1])
listed = yaml.safe_load((folder / "kustomization.yaml").read_text(encoding="utf-8"))["resources"]
present = {path.name for path in folder.glob("*.yaml")} - {"kustomization.yaml"}
unlisted = sorted(present - set(listed))
if unlisted:
    sys.exit(f"{folder}/kustomization.yaml does not list {', '.join(unlisted)}")
for name in listed:
    print(folder / name)
PY
)
log "kubernetes-validate --strict on ${#manifests[@]} manifests"
"$tools/kubernetes-validate" --strict --quiet "${manifests[@]}"

compose="$deploy/docker-compose.yaml"
for profile in gpu sim; do
    fleet=replicas
    [ "$profile" = sim ] && fleet=replicas-sim
    log "podman-compose config --profile $profile"
    if ! out=$(REDIS_PASSWORD=validate-only KVROUTER_FLEET="$fleet" \
        "$tools/podman-compose" -f "$compose" --profile "$profile" config 2>&1); then
        echo "$out" | tail -n 5 >&2
        log "podman-compose rejects $compose (profile $profile)"
        exit 1
    fi
done
log "check-jsonschema against the compose specification"
"$tools/check-jsonschema" --builtin-schema vendor.compose-spec "$compose"
log "deployment files valid"
