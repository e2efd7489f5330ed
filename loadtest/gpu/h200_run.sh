#!/usr/bin/env bash
# One device call of a GPU session whose bundle travels in chunks (docs/loadtests/h200-peers/README.md).
#
#   h200_run.sh stash CHUNK...        copy this call's carried chunks to /tmp/parts (they stay while the machine is warm)
#   h200_run.sh go BUDGET_S PLAN      reassemble the chunks (once), install vLLM 0.26 + wheels into /tmp/site (once),
#                                     build kvrouter's C extensions, start 4 replicas on GPU 0 (once: the fleet runs in
#                                     a session of its own and outlives the call), then run PLAN's rows that have no
#                                     report yet until BUDGET_S seconds after this call began; results are packed into
#                                     $OUT/results-<epoch>.tgz (reports and per-request records, not the plots).
#                                     FLEET_KV and FLEET_UTIL (default 6G and 0.2) set each replica's KV cache bytes
#                                     and GPU share: 6G fits four 8B replicas on an H200, 4G on an 80 GB H100.
#
# The chunks are one tar of bundle/parts, bundle/whl, locust, peers and model (../shared/gpu's offline bundle, Locust's
# and the peer routers' cp312 wheels, the 8B-shape config with its tokenizer), split at 58 MB so that one chunk and the
# working tree fit one call's transfer.
set -uo pipefail
cmd=${1:?usage: h200_run.sh stash CHUNK... | go BUDGET_S PLAN}; shift
HERE=$(cd "$(dirname "$0")" && pwd)
case "$cmd" in
stash)
    mkdir -p /tmp/parts && cp "$@" /tmp/parts/ && ls -la /tmp/parts ;;
go)
    t0=$(date +%s); budget=${1:?}; plan=${2:?}
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRACE=/tmp/pack/model/conversation_trace.jsonl
    if [ ! -d /tmp/pack/model ]; then
        mkdir -p /tmp/pack && cat /tmp/parts/chunk.* | tar -xf - -C /tmp/pack || exit 1
    fi
    if [ ! -f /tmp/site/.all-ok ]; then
        "$HERE/h200_offline.sh" install /tmp/pack/bundle/parts /tmp/pack/bundle/whl /tmp/pack/locust /tmp/pack/peers \
            -- /tmp/site && touch /tmp/site/.all-ok || exit 1
    fi
    python3 setup.py -q build_ext --inplace >/tmp/build_ext.log 2>&1 || { tail -20 /tmp/build_ext.log; exit 1; }
    if ! { [ -f /tmp/fleet/replicas.yaml ] && kill -0 "$(cat /tmp/fleet/fleet.pid)" 2>/dev/null; }; then
        "$HERE/h200_offline.sh" up /tmp/pack/model /tmp/fleet 0 4 "${FLEET_KV:-6G}" "${FLEET_UTIL:-0.2}" || exit 1
    fi
    echo "== fleet ready $(( $(date +%s) - t0 )) s into the call"
    todo=/tmp/plan-todo.txt; : >"$todo"
    while read -r name rest; do
        case "$name" in ''|'#'*) continue ;; esac
        if [ -f "/tmp/results/$name/report.json" ]; then echo "== done before: $name"; else echo "$name $rest" >>"$todo"; fi
    done <"$plan"
    "$HERE/h200_offline.sh" rows /tmp/fleet /tmp/results $(( t0 + budget )) "$todo"
    for dir in /tmp/results/*/; do
        [ -f "$dir/report.md" ] && { echo "== $(basename "$dir")"; sed -n '/^| row/,/^$/p' "$dir/report.md"; }
    done
    tar -czf "$OUT/results-$(date +%s).tgz" --exclude='*.png' -C /tmp results
    ls -la "$OUT" ;;
*) echo "unknown command $cmd" >&2; exit 2 ;;
esac
