#!/usr/bin/env bash
# The real-GPU acceptance run, from the folder `make gpu-kit` builds (docs/gpu.md, "The
# acceptance kit"). On the GPU machine, as root, offline, in under 8 minutes:
#
#   sudo ./gpu-acceptance.sh                  # every check; report in ./report/
#   sudo ./gpu-acceptance.sh --mps            # plus the MPS section (sets EXCLUSIVE_PROCESS,
#                                             # starts/stops the daemon, restores the mode)
#   sudo ./gpu-acceptance.sh --gguf m.gguf --wheels DIR
#                                             # plus llama.cpp offload: DIR holds a CUDA build of
#                                             # llama-cpp-python (llama_cpp_python-*.whl, for this
#                                             # Python and CUDA) and its requirements' wheels; the
#                                             # kit carries none (far over 64 MiB)
#
# Environment: PYTHON (default: python3.12, python3.11 or python3 of either version),
# KIT_VENV (default /opt/appliance-gpu-kit/venv: a place the sandbox uid can read, which a
# kit under /root is not; checked before anything is installed), KIT_WHEELS (as --wheels),
# KIT_OUT (default ./report), KIT_TIMEOUT (default 470 s for the
# checks), FIREJAIL (an installed firejail instead of the kit's). Other arguments go to
# `python -m benchmarks.gpu_acceptance` (see --help there). KIT_RUN="cmd" runs cmd instead of
# the checks, with the kit's firejail (SANDBOX_FIREJAIL) and venv (VENV), e.g.
# KIT_RUN="cd ~/appliance && bash benchmarks/gpu_real.sh" for the contention benchmark.
#
# The kit's firejail is run from this folder: it finds its helpers and seccomp filters only
# under the paths compiled into it (/usr/lib/x86_64-linux-gnu/firejail, /etc/firejail), so
# the checks run in a private mount namespace (unshare -m) where the kit's copies are bound
# over those paths; the host's own files are not changed (missing mount points are created
# empty and removed afterwards). As root, firejail needs no setuid bit.
# Whatever happens, the exit trap restores the compute mode the MPS section recorded and
# stops an MPS daemon the section started. Exit status: 0 when no check FAILed.
set -euo pipefail
KIT=$(cd "$(dirname "$0")" && pwd)
OUT=${KIT_OUT:-$KIT/report}
FJ_LIB=/usr/lib/x86_64-linux-gnu/firejail
FJ_ETC=/etc/firejail

if [ "${KIT_INNER:-}" = 1 ]; then  # inside the private mount namespace
  if [ -z "${FIREJAIL:-}" ]; then
    mount --bind "$KIT/firejail$FJ_LIB" "$FJ_LIB"
    mount --bind "$KIT/firejail$FJ_ETC" "$FJ_ETC"
    FIREJAIL=$KIT/firejail/usr/bin/firejail
  fi
  if ! "$FIREJAIL" --quiet --noprofile --private-dev -- /bin/true; then
    echo "gpu-acceptance: firejail ($FIREJAIL) cannot start a jail here" >&2
    exit 1
  fi
  if [ -n "${KIT_RUN:-}" ]; then  # another command with the kit's firejail and venv (the GPU CI's benchmark)
    export SANDBOX_FIREJAIL=$FIREJAIL VENV=$KIT_VENV
    exec bash -c "$KIT_RUN"
  fi
  cd "$KIT"
  exec env PYTHONPATH="$KIT" timeout "${KIT_TIMEOUT:-470}" "$KIT_VENV/bin/python" -m benchmarks.gpu_acceptance \
    --out "$OUT" --firejail "$FIREJAIL" --budget-s $(( ${KIT_TIMEOUT:-470} - 20 )) "$@"
fi

[ "$(id -u)" = 0 ] || { echo "gpu-acceptance: run as root (the appliance starts jails and sets the compute mode)" >&2; exit 1; }
# The jails run this interpreter as the sandbox uid: one under root's 0700 home (pyenv) cannot.
usable() {
  "$1" -c 'import sys; sys.exit(sys.version_info[:2] not in ((3, 11), (3, 12)))' 2>/dev/null &&
    setpriv --reuid=65534 --regid=65534 --clear-groups "$1" -c pass 2>/dev/null
}
if [ -z "${PYTHON:-}" ]; then
  for candidate in /usr/bin/python3.12 /usr/bin/python3.11 /usr/bin/python3 python3.12 python3.11 python3; do
    if command -v "$candidate" >/dev/null && usable "$(command -v "$candidate")"; then
      PYTHON=$(command -v "$candidate"); break
    fi
  done
fi
[ -n "${PYTHON:-}" ] || { echo "gpu-acceptance: needs Python 3.11 or 3.12 that any uid can run (set PYTHON)" >&2; exit 1; }
usable "$PYTHON" || { echo "gpu-acceptance: $PYTHON is not Python 3.11/3.12 runnable by the sandbox uid" >&2; exit 1; }
export KIT_VENV=${KIT_VENV:-/opt/appliance-gpu-kit/venv}

# The jails run $KIT_VENV/bin/python as the sandbox uid, so every folder above the venv must
# let any uid through (a runner's temp folder or a home directory often does not): the server
# would refuse to start, after minutes of installing. Checked first, with the fix named.
mkdir -p "$(dirname "$KIT_VENV")"
if ! setpriv --reuid=65534 --regid=65534 --clear-groups test -x "$(dirname "$KIT_VENV")"; then
  echo "gpu-acceptance: KIT_VENV=$KIT_VENV: the sandbox uid cannot reach $(dirname "$KIT_VENV")" \
       "(a folder above it is not o+x); leave KIT_VENV unset (/opt/appliance-gpu-kit/venv) or pick" \
       "a place every uid can traverse" >&2
  exit 1
fi

# --wheels DIR (or KIT_WHEELS): a CUDA llama-cpp-python for the llama_offload check. Kept in
# the arguments, so the check can say where its llama-cpp-python came from.
WHEELS=${KIT_WHEELS:-}
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  if [ "${args[$i]}" = --wheels ]; then WHEELS=${args[$((i + 1))]:-}; fi
done
if [ -n "$WHEELS" ]; then
  [ -d "$WHEELS" ] || { echo "gpu-acceptance: --wheels/KIT_WHEELS: $WHEELS is not a folder" >&2; exit 1; }
  WHEELS=$(cd "$WHEELS" && pwd)
  if [ -n "${KIT_WHEELS:-}" ] && [[ " $* " != *" --wheels "* ]]; then set -- "$@" --wheels "$WHEELS"; fi
fi

# The appliance and its requirements, from the kit's wheels only. A Python without pip or
# ensurepip (Debian/Ubuntu without python3-venv) still works: pip runs from its own wheel.
pip_wheel=$(ls "$KIT"/wheels/pip-*.whl | head -1)
kit_pip() { "$KIT_VENV/bin/python" "$pip_wheel/pip" install -q --no-index --disable-pip-version-check "$@"; }
if [ ! -x "$KIT_VENV/bin/appliance" ]; then
  echo "gpu-acceptance: installing the appliance into $KIT_VENV (offline, from $KIT/wheels)"
  rm -rf "$KIT_VENV"
  "$PYTHON" -m venv --without-pip "$KIT_VENV"
  kit_pip --find-links "$KIT/wheels" appliance nvidia-ml-py
  chmod -R a+rX "$KIT_VENV"
fi
if [ -n "$WHEELS" ]; then
  llama=$(ls "$WHEELS"/llama_cpp_python-*.whl 2>/dev/null | tail -1 || true)
  if [ -z "$llama" ]; then
    echo "gpu-acceptance: $WHEELS holds no llama_cpp_python-*.whl; llama_offload will say so" >&2
  else
    # The given build replaces any other of the same version (--force-reinstall); its
    # requirements come from the folder or the kit. A failure is the check's SKIP, with why.
    echo "gpu-acceptance: installing $(basename "$llama") into $KIT_VENV (from $WHEELS)"
    if ! { kit_pip --find-links "$WHEELS" --find-links "$KIT/wheels" --force-reinstall --no-deps "$llama" &&
           kit_pip --find-links "$WHEELS" --find-links "$KIT/wheels" "$llama"; }; then
      echo "gpu-acceptance: installing $llama failed; llama_offload will say what does not import" >&2
    fi
    chmod -R a+rX "$KIT_VENV"
  fi
fi

mkdir -p "$OUT"
made=()
restore() {
  if [ -s "$OUT/compute-mode.orig" ]; then   # written by the MPS section before it changes anything
    "$KIT_VENV/bin/python" - "$OUT/compute-mode.orig" "${SMI:-nvidia-smi}" <<'EOF' || true
import json, subprocess, sys
for index, mode in json.load(open(sys.argv[1])).items():
    subprocess.run([*sys.argv[2].split(), "-i", index, "-c", mode.upper()], check=False)
EOF
    rm -f "$OUT/compute-mode.orig"
  fi
  if [ -s "$OUT/mps-started" ]; then   # the pipe directory of a daemon the MPS section started
    echo quit | CUDA_MPS_PIPE_DIRECTORY=$(cat "$OUT/mps-started") nvidia-cuda-mps-control || true
    rm -f "$OUT/mps-started"
  fi
  for dir in "${made[@]}"; do rmdir "$dir" 2>/dev/null || true; done
}
trap restore EXIT
SMI=nvidia-smi
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  if [ "${args[$i]}" = --nvidia-smi ]; then SMI=${args[$((i + 1))]}; fi
done
if [ -z "${FIREJAIL:-}" ]; then
  for dir in "$FJ_LIB" "$FJ_ETC"; do
    if [ ! -d "$dir" ]; then mkdir -p "$dir"; made+=("$dir"); fi
  done
fi
rc=0
KIT_INNER=1 unshare --mount --propagation private "$0" "$@" || rc=$?
echo "gpu-acceptance: report in $OUT/gpu-acceptance.md and .json (exit $rc)"
exit $rc
