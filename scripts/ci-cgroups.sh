#!/usr/bin/env bash
# CI: the image, run with the documented cgroup settings, enforces per-run cgroups (issue 13).
#
#   scripts/ci-cgroups.sh IMAGE          (scripts/ci-images.sh calls it with the image it built)
#
# Runs the container as docs/deploy.md says (its own cgroup namespace, the capabilities and
# seccomp profile the jails need; the entrypoint remounts the container's cgroup subtree
# read-write), then checks that /readyz names cgroups as the layer enforcing memory, cpu and
# pids, and that a run whose children together pass SANDBOX_MEMORY_MB ends `memory_limit`.
# Exits non-zero, naming what failed. Extra podman flags: CI_CGROUPS_PODMAN_ARGS.
set -euo pipefail

IMAGE=${1:?usage: scripts/ci-cgroups.sh IMAGE}
REPO=$(cd "$(dirname "$0")/.." && pwd)
NAME=ci-cgroups
PODMAN=(podman --runtime runc)
cap_limit() { local hard=$1; if [ "$hard" = unlimited ] || [ "$hard" -gt 16384 ]; then echo 16384; else echo "$hard"; fi; }
NOFILE=$(cap_limit "$(ulimit -Hn)")
NPROC=$(cap_limit "$(ulimit -Hu)")
# shellcheck disable=SC2206  # word splitting of the extra flags is wanted
EXTRA=(${CI_CGROUPS_PODMAN_ARGS:-})

log() { printf '[ci-cgroups] %s\n' "$*"; }
die() { log "FAIL: $*"; "${PODMAN[@]}" logs "$NAME" 2>&1 | tail -20 || true; exit 1; }
trap '"${PODMAN[@]}" rm -f "$NAME" >/dev/null 2>&1 || true' EXIT
"${PODMAN[@]}" rm -f "$NAME" >/dev/null 2>&1 || true

log "podman run --cgroupns=private (SANDBOX_CGROUPS=require, SANDBOX_MEMORY_MB=512)"
"${PODMAN[@]}" run -d --name "$NAME" --cgroupns=private \
    --ulimit "nofile=$NOFILE:$NOFILE" --ulimit "nproc=$NPROC:$NPROC" \
    --cap-add=SYS_ADMIN,NET_ADMIN,MKNOD --security-opt "seccomp=$REPO/images/seccomp.json" \
    --security-opt apparmor=unconfined -e SANDBOX_CGROUPS=require -e SANDBOX_MEMORY_MB=512 \
    "${EXTRA[@]}" "$IMAGE" >/dev/null || die "podman run failed"

# Inside the container, with the image's own Python and the REST endpoint (the image carries
# the server only, not the client package): nothing needed on the host.
"${PODMAN[@]}" exec -i "$NAME" /opt/appliance/venv/bin/python - <<'PY' || die "cgroups are not enforcing in the container"
import json, time, urllib.error, urllib.request

body: dict = {}
for _ in range(900):
    try:
        with urllib.request.urlopen("http://127.0.0.1:9100/readyz", timeout=5) as r:
            body = json.load(r)
            break
    except (OSError, urllib.error.URLError, ValueError):
        time.sleep(0.2)
print("readyz limits:", body.get("limits"), "cgroups:", body.get("cgroups"))
assert body.get("status") == "ready", body
assert set(body["limits"].values()) <= {"cgroup-v1", "cgroup-v2"}, body["limits"]
code = ("import subprocess, sys\n"
        "child = 'b = bytearray(300 << 20); import time; time.sleep(20)'\n"
        "ps = [subprocess.Popen([sys.executable, '-c', child]) for _ in range(4)]\n"
        "print([p.wait() for p in ps])\n")
request = urllib.request.Request(
    "http://127.0.0.1:9100/v1/exec",
    data=json.dumps({"type": "execute", "id": "ci-cgroups", "code": code, "timeout_ms": 30000}).encode(),
    headers={"Content-Type": "application/json"},
)
with urllib.request.urlopen(request, timeout=120) as r:
    frames = [json.loads(line) for line in r.read().splitlines() if line.strip()]
done = frames[-1]
stderr = "".join(f.get("text", "") for f in frames if f.get("type") == "stream" and f.get("name") == "stderr")
print("four children of 300 MiB under 512 MiB:", done.get("status"), done.get("message"))
assert done.get("type") == "done" and done.get("status") == "memory_limit", (done, stderr[-300:])
PY
log "OK: /readyz reports cgroups enforcing memory, cpu and pids; an over-limit run ended memory_limit"
