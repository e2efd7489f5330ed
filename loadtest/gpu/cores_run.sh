#!/usr/bin/env bash
# CPU-only measurements on a lent GPU host's cores (16 on the device machines), for what this project's 2-core
# machine cannot measure because every process would wait for a core: the live several-routers bench (k1 against
# k3, docs/benchmarks.md "Several routers") and `--workers 2` scaling with the router on 2 cores of its own
# (loadtest/router_cpu.py --router-cpus). Simulated replicas; no GPU is used.
#
#   cores_run.sh pack OUT_DIR          (here, with a package index) Python 3.12 wheels of kvrouter's and Locust's
#                                      dependencies the GPU host lacks, this machine's redis-server with its
#                                      libraries and loader, and the Mooncake conversation trace, as one tar split
#                                      into OUT_DIR/chunk.* of 30 MB (a chunk and the working tree fit one call)
#   cores_run.sh stash CHUNK...        (device) copy this call's carried chunks to /tmp/cparts
#   cores_run.sh start PLAN            (device) unpack and install (once), build the C extensions, then run PLAN's
#                                      lines in order in a session of its own (it outlives the call), logging to
#                                      /tmp/cres/plan.log; a line is `NAME COMMAND...`, run from the repository
#                                      root with $TRACE (the trace) and $RES (/tmp/cres/NAME, made for it) set
#   cores_run.sh wait SECONDS          (device) until the plan is done or SECONDS have passed: print the log's new
#                                      lines, then pack /tmp/cres (reports, not plots) into $OUT
set -uo pipefail
cmd=${1:?usage: cores_run.sh pack OUT_DIR | stash CHUNK... | start PLAN | wait SECONDS}; shift
HERE=$(cd "$(dirname "$0")" && pwd); ROOT=$(cd "$HERE/../.." && pwd)
export PATH=/tmp/cpack/redis:$PATH PYTHONPATH=/tmp/csite:$ROOT PYTHONUNBUFFERED=1
export TRACE=/tmp/cpack/conversation_trace.jsonl
case "$cmd" in
pack)
    out=${1:?}; work=$(mktemp -d); mkdir -p "$out" "$work/whl" "$work/redis"
    plat="--only-binary=:all: --python-version 3.12 --implementation cp"
    for tag in manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34; do
        plat="$plat --platform ${tag}_x86_64"
    done
    # The host has numpy (with torch); everything else kvrouter, `kvrouter bench` and Locust import comes along.
    pip download -q $plat -d "$work/whl" locust matplotlib redis pydantic pydantic-settings python-dotenv msgspec \
        pyzmq aiohttp uvloop xxhash prometheus-client pyyaml jinja2 || exit 1
    rm -f "$work"/whl/numpy-*.whl
    redis=$(readlink -f "$(command -v redis-server)") || { echo "redis-server is not installed here" >&2; exit 1; }
    cp "$redis" "$work/redis/redis-server.bin"  # named so: the binary picks its mode from argv[0]
    for lib in $(ldd "$redis" | awk '/=>/ {print $3}') /lib64/ld-linux-x86-64.so.2; do cp -L "$lib" "$work/redis/"; done
    printf '%s\n' '#!/bin/sh' 'D=$(cd "$(dirname "$0")" && pwd)' \
        'exec "$D/ld-linux-x86-64.so.2" --library-path "$D" "$D/redis-server.bin" "$@"' >"$work/redis/redis-server"
    chmod +x "$work/redis/redis-server"
    cp "$ROOT/../shared/traces/mooncake/conversation_trace.jsonl" "$work/"
    tar -czf - -C "$work" whl redis conversation_trace.jsonl | split -b 30000000 -a 1 - "$out/chunk."
    rm -rf "$work"; ls -la "$out" ;;
stash)
    mkdir -p /tmp/cparts && cp "$@" /tmp/cparts/ && ls -la /tmp/cparts ;;
start)
    plan=$(readlink -f "${1:?}")
    if [ ! -f /tmp/cpack/.ok ]; then
        mkdir -p /tmp/cpack && cat /tmp/cparts/chunk.* | tar -xzf - -C /tmp/cpack && touch /tmp/cpack/.ok || exit 1
    fi
    if [ ! -f /tmp/csite/.ok ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/csite \
            /tmp/cpack/whl/*.whl 2>&1 | grep -v WARNING
        touch /tmp/csite/.ok
    fi
    python3 -c "import sys, locust, matplotlib, redis, pydantic_settings, uvloop, transformers; print(sys.version)" || exit 1
    redis-server --version || exit 1
    # The C extensions (optional in setup.py, so check they import), built in a copy without pyproject.toml, whose
    # metadata an older setuptools refuses.
    build=$(mktemp -d) && cp -r "$ROOT/setup.py" "$ROOT/kvrouter" "$build/" && rm -f "$build"/kvrouter/*.so
    (cd "$build" && python3 setup.py -q build_ext --inplace >/tmp/build_ext.log 2>&1) && cp "$build"/kvrouter/*.so "$ROOT/kvrouter/"
    python3 -c "import kvrouter._blocktable, kvrouter._blockkeys, kvrouter._costfit" || { tail -20 /tmp/build_ext.log; exit 1; }
    echo "host: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), load $(cut -d' ' -f1-3 /proc/loadavg)"
    # Which logical CPUs share a physical core (the routers' two cores should not).
    echo "core siblings: $(cat /sys/devices/system/cpu/cpu{0,1,2,3}/topology/thread_siblings_list 2>/dev/null | tr '\n' ' ')"
    mkdir -p /tmp/cres
    cd "$ROOT" && setsid bash -c '
        while read -r name rest; do
            case "$name" in ""|"#"*) continue ;; esac
            export RES=/tmp/cres/$name; mkdir -p "$RES"
            echo "== $name $(date -u +%T) load $(cut -d" " -f1-3 /proc/loadavg): $rest"
            eval "$rest" >"$RES/output.txt" 2>&1; echo "== $name ended with $? at $(date -u +%T)"
            grep -v -e WARNING -e "^\[transformers\]" "$RES/output.txt" | tail -25
        done <"$1"; echo "== plan done"' plan "$plan" >>/tmp/cres/plan.log 2>&1 </dev/null &
    echo "plan started: $plan" ;;
wait)
    OUT=${OUT:-/tmp/cout}; mkdir -p "$OUT"  # the device sets $OUT; elsewhere (a dry run) a folder in /tmp
    limit=$(( $(date +%s) + ${1:?} )); seen=$(cat /tmp/cres/.seen 2>/dev/null || echo 0)
    while [ "$(date +%s)" -lt "$limit" ] && ! grep -q "== plan done" /tmp/cres/plan.log; do sleep 5; done
    tail -n +"$(( seen + 1 ))" /tmp/cres/plan.log; wc -l </tmp/cres/plan.log >/tmp/cres/.seen
    tar -czf "$OUT/cres-$(date +%s).tgz" --exclude='*.png' --exclude='.seen' -C /tmp cres; ls -la "$OUT" ;;
*) echo "unknown command $cmd" >&2; exit 2 ;;
esac
