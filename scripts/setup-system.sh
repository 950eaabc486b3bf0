#!/usr/bin/env bash
# System prerequisites of the appliance on Debian/Ubuntu: firejail (setuid), Debian's
# python3 + venv (jailed code runs it as uid 1001, so it must not live in a private home),
# and the sandbox user whose home is /workspace. Idempotent; uses sudo when not root.
set -euo pipefail
SANDBOX_UID="${SANDBOX_UID:-1001}"
if [ "$(id -u)" = 0 ]; then SUDO=""; elif command -v sudo >/dev/null; then SUDO="sudo"; else
  echo "setup: need root (or sudo) to install firejail and create the sandbox user" >&2; exit 1; fi

need=()
command -v firejail >/dev/null || need+=(firejail)
[ -x /usr/bin/python3 ] || need+=(python3)
/usr/bin/python3 -c 'import ensurepip, venv' 2>/dev/null || need+=(python3-venv)
# The egress allowlist (SANDBOX_OPEN_PORTS) and its tests: namespaces, veth pairs, nftables.
PATH="$PATH:/usr/sbin:/sbin" command -v ip >/dev/null || need+=(iproute2)
PATH="$PATH:/usr/sbin:/sbin" command -v nft >/dev/null || need+=(nftables)
# A C compiler: llama-cpp-python builds from source, and the GPU tests build a stand-in libcuda.
{ command -v gcc && command -v g++; } >/dev/null || need+=(gcc g++ libc6-dev)
# The GPU kit's bare-machine rehearsal (tests/test_gpu_kit.py, scripts/gpu-rehearsal.sh) makes a
# Debian root with debootstrap; the kit run on this host copies /usr/bin/python3's numpy (the
# kit carries none).
PATH="$PATH:/usr/sbin:/sbin" command -v debootstrap >/dev/null || need+=(debootstrap)
/usr/bin/python3 -c 'import numpy' 2>/dev/null || need+=(python3-numpy)
# npm installs the E2B JavaScript SDK the tests run (`make js`, from tests/js/e2b's lockfile,
# which also pins the node it runs under); Debian's npm brings Debian's node to run npm itself.
command -v npm >/dev/null || need+=(npm)
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}" >&2
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
fj=$(command -v firejail)
if [ ! -u "$fj" ]; then echo "setup: $fj is not setuid root" >&2; exit 1; fi

# Only SANDBOX_UID needs an account: the other uids of SANDBOX_UID_RANGE (one per jail) get
# theirs inside each jail from the server, and a uid with a host account is left out of it.
if ! getent passwd "$SANDBOX_UID" >/dev/null; then
  getent group "$SANDBOX_UID" >/dev/null || $SUDO groupadd -g "$SANDBOX_UID" sandbox
  $SUDO useradd -u "$SANDBOX_UID" -g "$SANDBOX_UID" -d /workspace -M -s /usr/sbin/nologin sandbox
fi
home=$(getent passwd "$SANDBOX_UID" | cut -d: -f6)
if [ "$home" != /workspace ]; then
  echo "setup: uid $SANDBOX_UID has home $home; the appliance needs /workspace" >&2; exit 1; fi
$SUDO mkdir -p /workspace
$SUDO chown "$SANDBOX_UID:$SANDBOX_UID" /workspace
