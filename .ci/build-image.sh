#!/usr/bin/env bash
# Build the kvrouter image from the repository's Dockerfile and run it from the inside: the entry point, both C
# extensions, and simulated replicas + router answering requests through the openai client.
#
# No daemon and no registry: Debian's podman builds as root (`--storage-driver vfs`, `build --isolation chroot`,
# `--pull=never`) on a Debian bookworm base made here with mmdebstrap (python3, python3-venv, python-is-python3)
# and passed through the Dockerfile's PYTHON_IMAGE argument. pip inside the build uses this machine's package
# index: its settings are read from `pip config list` at build time and passed as PIP_* build arguments, and local
# indexes, wheel folders, constraint and CA files are bind-mounted read-only at their own paths for the build's
# RUN steps. Nothing of that is written into the repository.
# `podman run` needs setrlimit, which some sandboxes refuse, so the image is checked through its filesystem: a
# container is created and mounted, /proc and /dev are mounted into it, and every command runs there under
# `chroot --userspec` as the image's own user, with the image's environment, working directory and entry point.
# Servers bind 127.0.0.1 only; every process started is stopped by its PID; the mounts and the container go on
# exit, even a failed one (trap), and mounts a killed run left under the storage root are removed first.
#
# The base rootfs tarball, podman's storage (with its layer cache) and the logs live under
# KVROUTER_IMAGE_CACHE (default ${XDG_CACHE_HOME:-$HOME/.cache}/kvrouter/image), cached by path between runs;
# each run removes the images it no longer needs. Other knobs (environment): KVROUTER_IMAGE_DOCKERFILE (default
# Dockerfile), KVROUTER_IMAGE_TAG (default localhost/kvrouter:ci). Under CI (CI=true) a missing podman or
# mmdebstrap is installed with apt-get; elsewhere the script stops with the install command.
# Output: progress on stderr; last line on stdout: `image TAG SIZE_MB build_s SECONDS`.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"

cache="${KVROUTER_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvrouter/image}"
dockerfile="${KVROUTER_IMAGE_DOCKERFILE:-Dockerfile}"
tag="${KVROUTER_IMAGE_TAG:-localhost/kvrouter:ci}"
container=kvrouter-ci-smoke
suite=bookworm
base_packages=python3,python3-venv,python-is-python3
# What a Debian base needs beyond the python images to compile (the headers of Debian's python3).
build_packages=python3-dev

start=$(date +%s)
log() { echo "build-image +$(( $(date +%s) - start ))s: $*" >&2; }
fail() { log "FAILED: $*"; exit 1; }

in_ci() { case "${CI:-}" in "" | 0 | false | no) return 1 ;; *) return 0 ;; esac; }

need_tools() {
    local missing=()
    command -v podman >/dev/null 2>&1 || missing+=(podman)
    command -v mmdebstrap >/dev/null 2>&1 || missing+=(mmdebstrap)
    [ "${#missing[@]}" -eq 0 ] && return 0
    in_ci || fail "${missing[*]} not installed: apt-get install ${missing[*]}"
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

[ "$(id -u)" -eq 0 ] || fail "run as root (podman builds with --isolation chroot and the smoke test chroots)"
[ -f "$dockerfile" ] || fail "no Dockerfile at $dockerfile"
need_tools
tools_python=$(bash .ci/setup-deploy-tools.sh | tail -n 1)

mkdir -p "$cache/podman/tmp" "$cache/logs"
podman_=(podman --root "$cache/podman/root" --runroot "$cache/podman/run" --tmpdir "$cache/podman/tmp"
    --storage-driver vfs --cgroup-manager cgroupfs --events-backend file)

# --- cleanup: processes by PID, then mounts, then the smoke container --------------------------------------
pids=()
rootfs=""
unmount_under() {  # every mount point under $1, deepest first
    local point
    awk -v prefix="$1/" 'index($2, prefix) == 1 { print $2 }' /proc/self/mounts | sort -r | while read -r point; do
        umount "$point" 2>/dev/null || umount --lazy "$point"
    done
}
cleanup() {
    local pid
    for pid in "${pids[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    pids=()
    unmount_under "$cache/podman/root"
    "${podman_[@]}" umount "$container" >/dev/null 2>&1 || true
    "${podman_[@]}" rm --force --ignore "$container" >/dev/null 2>&1 || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM
cleanup  # what a killed run may have left

# --- the base: a Debian rootfs, made once per package list and kept as a tarball ----------------------------
key=$(echo "$suite $base_packages minbase nodoc" | sha256sum | cut -c1-12)
base_tar="$cache/base-$suite-$key.tar"
base_image="localhost/kvrouter-base:$suite-$key"
if [ ! -f "$base_tar" ]; then
    log "making the $suite base with mmdebstrap ($base_packages)"
    # Documentation, man pages and translations are dropped, as Debian's slim images do; copyright files stay.
    mmdebstrap --variant=minbase --format=tar --include="$base_packages" \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        "$suite" "$base_tar.part" \
        "deb http://deb.debian.org/debian $suite main" \
        "deb http://deb.debian.org/debian $suite-updates main" \
        "deb http://deb.debian.org/debian-security $suite-security main" >"$cache/logs/mmdebstrap.log" 2>&1 \
        || { tail -n 20 "$cache/logs/mmdebstrap.log" >&2; fail "mmdebstrap could not make the base"; }
    mv "$base_tar.part" "$base_tar"
fi
if ! "${podman_[@]}" image exists "$base_image"; then
    log "importing $base_tar as $base_image"
    "${podman_[@]}" import --quiet "$base_tar" "$base_image" >/dev/null
fi

# --- pip's settings on this machine, for the build --------------------------------------------------------
pip_options=()
pip_lines=$("$tools_python" .ci/pip_build_args.py python3) || fail "could not read pip's configuration (python3 -m pip config list)"
[ -z "$pip_lines" ] || mapfile -t pip_options <<<"$pip_lines"

# --- build -----------------------------------------------------------------------------------------------
build_log="$cache/logs/build.log"
build_args=(--build-arg PYTHON_IMAGE="$base_image" --build-arg BUILD_PACKAGES="$build_packages")
pip_build_args=()
for option in "${pip_options[@]}"; do
    case "$option" in --build-arg=*) pip_build_args+=("$option") ;; esac
done
log "podman build -f $dockerfile -t $tag (PYTHON_IMAGE=$base_image; ${#pip_options[@]} pip options)"
build_start=$(date +%s)
# Two passes: the build stage with pip's mounts, then the whole image without them, reusing the first pass's
# layers. A bind mount leaves its empty mount point in the layer of every RUN step it is given to, and the runtime
# stage's RUN must not carry this machine's index paths. Tagging the build stage keeps its layers (the next run's
# cache) safe from the prune below.
if ! { "${podman_[@]}" build --isolation chroot --pull=never --layers -f "$dockerfile" --target build \
        "${build_args[@]}" "${pip_options[@]}" -t "$tag-build" "$repo" \
    && "${podman_[@]}" build --isolation chroot --pull=never --layers -f "$dockerfile" \
        "${build_args[@]}" "${pip_build_args[@]}" -t "$tag" "$repo"; } >"$build_log" 2>&1; then
    tail -n 25 "$build_log" >&2
    fail "podman build of $dockerfile failed (last lines above; full log: $build_log)"
fi
build_s=$(( $(date +%s) - build_start ))
size=$("${podman_[@]}" image inspect --format '{{.Size}}' "$tag")
size_mb=$(( size / 1000000 ))
log "built $tag in ${build_s} s: $size_mb MB"
# Keep the newest image and the layers it was built from (the next build's cache); drop older builds.
"${podman_[@]}" image prune --force >/dev/null

# --- run it from the inside ------------------------------------------------------------------------------
"${podman_[@]}" create --name "$container" "$tag" >/dev/null
rootfs=$("${podman_[@]}" mount "$container")
mount -t proc proc "$rootfs/proc"
mount --bind /dev "$rootfs/dev"

# The image's own user, environment, working directory and entry point, as a container runtime would use them.
mapfile -t config < <("${podman_[@]}" image inspect --format '{{json .Config}}' "$tag" | "$tools_python" -c '
import json, sys
config = json.load(sys.stdin)
print(config.get("User") or "0")
print(config.get("WorkingDir") or "/")
print(json.dumps(config.get("Entrypoint") or []))
for item in config.get("Env") or []:
    print(item)
')
user=${config[0]}
workdir=${config[1]}
mapfile -t entrypoint < <("$tools_python" -c 'import json, sys; print(*json.loads(sys.argv[1]), sep="\n")' "${config[2]}")
image_env=("${config[@]:3}")
case "${user%%:*}" in 0 | root | "") fail "the image runs as root (USER ${user:-unset}); it must not" ;; esac
home=$(awk -F: -v uid="${user%%:*}" '$3 == uid { print $6 }' "$rootfs/etc/passwd")
[ -n "$home" ] || fail "user ${user%%:*} has no /etc/passwd entry in the image"

in_image() {  # in_image COMMAND...: run COMMAND in the image as its user
    chroot --userspec="$user" "$rootfs" /usr/bin/env -i -C "$workdir" "${image_env[@]}" HOME="$home" "$@"
}
in_image_bg() {  # in_image_bg COMMAND...: the same in the background, started by this shell itself, so that $!
    # is the command's own PID (chroot and env exec it) and a SIGTERM to it reaches the program. (`in_image ... &`
    # would background a subshell: its PID dies at the TERM and leaves the program running.)
    chroot --userspec="$user" "$rootfs" /usr/bin/env -i -C "$workdir" "${image_env[@]}" HOME="$home" "$@" &
}

log "kvrouter --help (entry point ${entrypoint[*]}, user $user)"
help_text=$(in_image "${entrypoint[@]}" --help) || fail "'kvrouter --help' fails in the image"
[[ "$help_text" == *"usage: kvrouter"* ]] || fail "'kvrouter --help' prints no usage in the image: $help_text"
log "the three C extensions import"
in_image python -c 'import kvrouter._blockkeys, kvrouter._blocktable, kvrouter._costfit
from kvrouter.blocktable import native_backend
native_backend()' || fail "kvrouter's C extensions do not import in the image"

first_port=$("$tools_python" - <<'PY'
import random, socket
for _ in range(200):
    first = random.randrange(12000, 30000)
    sockets = [socket.socket() for _ in range(7)]
    try:
        for offset, sock in enumerate(sockets):
            sock.bind(("127.0.0.1", first + offset))
    except OSError:
        continue
    finally:
        for sock in sockets:
            sock.close()
    print(first)
    break
else:
    raise SystemExit("no run of 7 free ports on 127.0.0.1")
PY
)
router_port=$(( first_port + 6 ))
smoke_dir=/tmp/kvrouter-smoke
in_image mkdir -p "$smoke_dir"
log "smoke: 2 simulated replicas on 127.0.0.1:$first_port-$(( first_port + 1 )), router on :$router_port"
in_image_bg "${entrypoint[@]}" sim --replicas 2 --host 127.0.0.1 --base-port "$first_port" \
    --kv-base-port "$(( first_port + 2 ))" --block-size 16 --model-name smoke \
    --write-replicas "$smoke_dir/replicas.yaml" >"$cache/logs/smoke-sim.log" 2>&1
pids+=($!)
for _ in $(seq 100); do
    [ -s "$rootfs$smoke_dir/replicas.yaml" ] && break
    kill -0 "${pids[0]}" 2>/dev/null || break
    sleep 0.2
done
[ -s "$rootfs$smoke_dir/replicas.yaml" ] || { tail -n 20 "$cache/logs/smoke-sim.log" >&2; fail "kvrouter sim did not start in the image"; }
in_image_bg "${entrypoint[@]}" --replicas "$smoke_dir/replicas.yaml" --host 127.0.0.1 --port "$router_port" \
    >"$cache/logs/smoke-router.log" 2>&1
pids+=($!)
if ! "$tools_python" .ci/image_smoke_client.py "http://127.0.0.1:$router_port" --model smoke; then
    tail -n 20 "$cache/logs/smoke-router.log" "$cache/logs/smoke-sim.log" >&2
    fail "the smoke run through the image's router failed"
fi
for pid in "${pids[@]}"; do
    kill -TERM "$pid"
done
for pid in "${pids[@]}"; do
    # 143: ended by the SIGTERM itself; anything else is a crash on the way out.
    status=0
    wait "$pid" || status=$?
    case "$status" in 0 | 143) ;; *) fail "a process in the image exited with status $status after SIGTERM (logs: $cache/logs/smoke-*.log)" ;; esac
done
pids=()
cleanup
log "image checks passed; disk used under $cache: $(du -sh "$cache" | cut -f1)"
echo "image $tag ${size_mb}MB build_s $build_s"
