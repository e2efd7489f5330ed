#!/usr/bin/env bash
# `kvrouter bench` on real vLLM replicas of one GPU host that has no package index (docs/benchmarks.md, "Real GPUs").
#
#   h200_offline.sh install PARTS_DIR WHEEL_DIR... -- SITE
#       vLLM 0.26.0 from the bundle parts (../shared/gpu/build_bundle.sh) and every wheel in the WHEEL_DIRs
#       (vLLM's missing dependencies, kvrouter's redis / pydantic-settings / python-dotenv, Locust's) into SITE.
#   h200_offline.sh up MODEL_DIR WORK [GPUS=0] [PER_GPU=4] [KV_BYTES=6G] [UTILIZATION=0.2]
#       starts deploy/gpu/vllm_fleet.py in a session of its own (it outlives this shell), dummy weights of
#       MODEL_DIR's shape, and waits until WORK/replicas.yaml exists (every replica healthy) or the fleet died.
#       The multi-tenant workload sends tool schemas: vLLM refuses them (400) without a tool-call parser.
#   h200_offline.sh rows WORK OUT DEADLINE_EPOCH_S PLAN_FILE
#       runs `kvrouter bench --fleet WORK/replicas.yaml` once per line of PLAN_FILE (`NAME ARGS...`; the out dir
#       is OUT/NAME), each under a timeout that ends it by the deadline (bench keeps the rows it finished); a line
#       is skipped when less than its MIN_S (first field after the name) is left; `{trace}` in ARGS becomes $TRACE.
#   h200_offline.sh down WORK       stops the fleet by its pid (vllm_fleet.py stops every replica's process group).
#
# PYTHONPATH must hold SITE and the kvrouter source; python3 is the host's (torch 2.11+cu130).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd); ROOT=$(cd "$HERE/../.." && pwd)
cmd=${1:?usage: h200_offline.sh install|up|rows|down ...}; shift
case "$cmd" in
install)
    parts=${1:?}; shift; wheels=(); while [ "${1:-}" != "--" ]; do wheels+=("${1:?missing -- SITE}"); shift; done
    site=${2:?}; mkdir -p "$site"
    [ -f "$site/.vllm-ok" ] || { cat "$parts"/vllm.part.* | tar -xzf - -C "$site" && touch "$site/.vllm-ok"; }
    # One pip call for every wheel: with --target, a second call would replace what the first put in SITE/bin.
    files=(); for dir in "${wheels[@]}"; do files+=("$dir"/*.whl); done
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "${files[@]}" 2>&1 | grep -v WARNING || true
    PYTHONPATH=$site python3 -c "import vllm, locust, redis, pydantic_settings; print('vllm', vllm.__version__)" ;;
up)
    model=${1:?}; work=${2:?}; gpus=${3:-0}; per_gpu=${4:-4}; kv_bytes=${5:-6G}; util=${6:-0.2}
    mkdir -p "$work"; rm -f "$work/replicas.yaml"
    # FlashInfer is not in the bundle: vLLM's sampler falls back to its PyTorch one.
    # vllm_fleet.py's KV-event topic is vLLM's own default, '': vllm-router 0.1.17's --kv-event-source has no topic
    # and applies no batch published under another one (docs/loadtests/vllm-router-kv-cpu); kvrouter reads it from
    # replicas.yaml.
    VLLM_USE_FLASHINFER_SAMPLER=0 setsid python3 "$ROOT/deploy/gpu/vllm_fleet.py" --model "$model" \
        --served-model-name llama8b-shape --gpus "$gpus" --per-gpu "$per_gpu" --gpu-memory-utilization "$util" \
        --kv-cache-memory-bytes "$kv_bytes" --out "$work/replicas.yaml" --log-dir "$work/logs" \
        -- --load-format dummy --enable-auto-tool-choice --tool-call-parser hermes >"$work/fleet.log" 2>&1 < /dev/null &
    echo $! >"$work/fleet.pid"; started=$(date +%s)
    while [ ! -f "$work/replicas.yaml" ]; do
        if ! kill -0 "$(cat "$work/fleet.pid")" 2>/dev/null; then cat "$work/fleet.log"; exit 1; fi
        sleep 2
    done
    cat "$work/fleet.log"; echo "fleet up after $(( $(date +%s) - started )) s"
    grep -h -e "KV cache size" -e "Maximum concurrency" "$work"/logs/*.log | sort | uniq -c || true ;;
rows)
    work=${1:?}; out=${2:?}; deadline=${3:?}; plan=${4:?}
    while read -r name min_s args; do
        case "$name" in ''|'#'*) continue ;; esac
        args=${args//\{trace\}/${TRACE:-}}  # {trace}: the Mooncake trace file, from $TRACE
        left=$(( deadline - $(date +%s) ))
        if [ "$left" -lt "$min_s" ]; then echo "== skip $name: ${left} s left, needs ${min_s}"; continue; fi
        echo "== $name (${left} s left): kvrouter bench --fleet $work/replicas.yaml $args --out $out/$name"
        eval "set -- $args"  # ARGS is shell words: a quoted --router-cmd 'NAME=COMMAND' stays one argument
        timeout -s TERM -k 30 "$left" python3 -m kvrouter.cli bench --fleet "$work/replicas.yaml" "$@" \
            --out "$out/$name" || echo "== $name ended with $?"
        mkdir -p "$out/$name"  # the replicas' own counters and histograms after the rows, for calibration
        python3 - "$work/replicas.yaml" "$out/$name" <<'PY' || true
import sys, urllib.request, yaml
for replica in yaml.safe_load(open(sys.argv[1]))["replicas"]:
    with urllib.request.urlopen(replica["url"] + "/metrics", timeout=5) as response:
        open(f"{sys.argv[2]}/metrics-{replica['name']}.txt", "wb").write(response.read())
PY
    done <"$plan" ;;
down)
    work=${1:?}; pid=$(cat "$work/fleet.pid"); kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done; tail -5 "$work/fleet.log" ;;
*) echo "unknown command $cmd" >&2; exit 2 ;;
esac
