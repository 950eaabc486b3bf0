#!/usr/bin/env bash
# The real-GPU acceptance run, from the folder `make gpu-kit` builds (docs/gpu.md, "The
# acceptance kit"). On a bare GPU machine, as root, offline, in under 8 minutes:
#
#   tar xzf gpu-kit.tar.gz -C /opt && /opt/gpu-kit/gpu-acceptance.sh
#
# The CI rehearsal (scripts/gpu-rehearsal.sh) runs exactly that in a bare Debian root, with
# KIT_SIMULATE=1 in its environment (simulated devices, the stand-in libcuda and nvidia-smi
# it finds where a driver's would be). It prepares what a bare machine lacks, then checks:
#   1. the sandbox user (uid 1001, home /workspace) and /workspace, created if missing;
#   2. firejail installed from the kit under $KIT_HOME (default /opt/appliance-gpu-kit), owned
#      by root and setuid (whoever unpacked the kit); the shared libraries it needs that the
#      host lacks (libapparmor.so.1, libselinux.so.1, libpcre2-8.so.0), and llama.cpp's
#      libgomp.so.1, go to $KIT_HOME/lib;
#   3. a Python 3.11/3.12 (PYTHON, else python3.12/python3.11/python3 on PATH, /usr/bin, or a
#      venv under /opt) whose base interpreter is under /usr (a jail sees no other), and the kit's venv ($KIT_HOME/venv, KIT_VENV) with the appliance and the
#      kit's CUDA build of llama-cpp-python, installed offline from the kit's wheels;
#   4. the driver's and CUDA's libraries by absolute path (ldconfig -p, LD_LIBRARY_PATH,
#      /usr/local/nvidia, /usr/local/cuda, a Python's nvidia/cu13 wheels): libcuda.so.1 (handed
#      to the appliance as SANDBOX_GPU_LIBCUDA), libcudart.so.13 and libcublas(Lt).so.13;
# then, in a private mount namespace (the host's files are not changed): firejail's helpers
# bound over its compiled-in paths, an ld.so.cache of the host's plus $KIT_HOME/lib and the
# library folders bound over /etc/ld.so.cache (setuid firejail ignores LD_LIBRARY_PATH; jails
# get a clean environment and read the cache), and one real jail as uid 1001 that runs the
# venv's Python and imports llama_cpp (fails fast: firejail not setuid, a library missing, an
# interpreter the jail cannot see). Then the checks (benchmarks/gpu_acceptance.py).
# The compute mode and MIG are never changed: --mps (which sets EXCLUSIVE_PROCESS) is refused
# outside simulation. A report, $KIT_OUT (default ./report)/gpu-acceptance.{json,md}, is
# written in every case, a failure before the checks included. Exit status: 0 when no check
# FAILed.
#
# Environment: PYTHON, KIT_HOME, KIT_VENV, KIT_OUT, KIT_TIMEOUT (default 420 s for the checks),
# FIREJAIL (an installed setuid firejail instead of the kit's), KIT_SIMULATE=1, KIT_WHEELS /
# --wheels DIR (another llama-cpp-python build and its wheels), KIT_RUN="cmd" (runs cmd instead
# of the checks, with SANDBOX_FIREJAIL and VENV set: the GPU CI's contention benchmark). Other
# arguments go to `python -m benchmarks.gpu_acceptance` (--help there).
set -euo pipefail
KIT=$(cd "$(dirname "$0")" && pwd)
OUT=${KIT_OUT:-$KIT/report}
KIT_HOME=${KIT_HOME:-/opt/appliance-gpu-kit}
export KIT_VENV=${KIT_VENV:-$KIT_HOME/venv}
SANDBOX_UID=1001
FJ_LIB=/usr/lib/x86_64-linux-gnu/firejail
FJ_ETC=/etc/firejail
KIT_LIBS=(libapparmor.so.1 libselinux.so.1 libpcre2-8.so.0 libgomp.so.1)
CUDA_LIBS=(libcuda.so.1 libnvidia-ml.so.1 libcudart.so.13 libcublas.so.13 libcublasLt.so.13)
# nvidia-smi where a driver mounted into a machine puts it, when PATH does not say.
export PATH=$PATH:/usr/local/nvidia/bin

say() { echo "gpu-acceptance: $*" >&2; }

# ---- inside the private mount namespace --------------------------------------------------------
if [ "${KIT_INNER:-}" = 1 ]; then
  fail() { printf '%s\n' "$*" >"$OUT/.kit-failure"; say "$*"; exit 1; }
  if [ -z "${FIREJAIL:-}" ]; then
    mount --bind "$KIT_HOME/firejail$FJ_LIB" "$FJ_LIB"
    mount --bind "$KIT_HOME/firejail$FJ_ETC" "$FJ_ETC"
    FIREJAIL=$KIT_HOME/firejail/usr/bin/firejail
  fi
  # Library folders a jail cannot see (outside /usr: the kit's own, a Python's nvidia wheels
  # under /opt) are bound under /usr/lib/appliance-gpu-kit, and the cache names them there
  # (not under /usr/local: a jail that whitelists /usr/local/nvidia/lib64 sees nothing else
  # of /usr/local).
  i=0
  conf=$KIT_HOME/ld.so.conf
  cat /etc/ld.so.conf >"$conf" 2>/dev/null || : >"$conf"
  while read -r dir; do
    [ -n "$dir" ] || continue
    case $dir in
      /usr/*) echo "$dir" >>"$conf" ;;
      *) mount --bind "$dir" "/usr/lib/appliance-gpu-kit/$i"; echo "/usr/lib/appliance-gpu-kit/$i" >>"$conf"; i=$((i + 1)) ;;
    esac
  done <"$KIT_HOME/lib-dirs"
  ldconfig -X -f "$conf" -C "$KIT_HOME/ld.so.cache" 2>"$KIT_HOME/ldconfig.log" ||
    fail "ldconfig failed: $(tail -3 "$KIT_HOME/ldconfig.log")"
  mount --bind "$KIT_HOME/ld.so.cache" /etc/ld.so.cache
  # One real jail as the sandbox user before anything else: firejail must be setuid root (a
  # jail as root would hide it) and find its libraries, and the jail must see the interpreter:
  # its /tmp is private and, as in the appliance's jails, only the venv is whitelisted (a base
  # interpreter under /tmp is gone). Started as the appliance starts its jails: a clean
  # environment, no "--" (firejail would run the command through the login shell, nologin).
  jail() {
    setpriv --reuid="$SANDBOX_UID" --regid="$SANDBOX_UID" --clear-groups \
      env -i PATH=/usr/bin:/bin HOME=/workspace container=docker \
      "$FIREJAIL" --quiet --noprofile --private-tmp --private-dev \
      --whitelist="$KIT_VENV" --read-only="$KIT_VENV" \
      ${JAIL_LIBCUDA_DIR:+--whitelist="$JAIL_LIBCUDA_DIR" --read-only="$JAIL_LIBCUDA_DIR"} \
      "$KIT_VENV/bin/python" -c "$1" 2>&1
  }
  cd /
  if ! jail_out=$(jail "import sys, appliance; print(sys.executable, sys.version.split()[0])"); then
    why=""
    if [ ! -u "$FIREJAIL" ] || [ "$(stat -c %u "$FIREJAIL")" != 0 ]; then why=" ($FIREJAIL is not setuid root)"; fi
    fail "a jail as uid $SANDBOX_UID failed ($FIREJAIL, $KIT_VENV/bin/python)$why: $(echo "$jail_out" | tail -5 | tr '\n' ' ')"
  fi
  say "a jail as uid $SANDBOX_UID runs $(echo "$jail_out" | tail -1)"
  # llama.cpp's CUDA build, loaded in a jail through the cache alone: its outcome goes to the
  # report (the checks that need it fail with it), and the other checks still run.
  if [ -n "${LLAMA_PROBE:-}" ]; then
    if jail_out=$(jail "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"); then
      echo "ok $(echo "$jail_out" | tail -1)" >"$OUT/llama-jail"
    else
      echo "llama_cpp does not import in a jail as uid $SANDBOX_UID: $(echo "$jail_out" | tail -3 | tr '\n' ' ')" >"$OUT/llama-jail"
    fi
    say "$(cat "$OUT/llama-jail")"
  fi
  if [ -n "${KIT_RUN:-}" ]; then
    export SANDBOX_FIREJAIL=$FIREJAIL VENV=$KIT_VENV
    exec bash -c "$KIT_RUN"
  fi
  cd "$KIT"
  exec env PYTHONPATH="$KIT" timeout "${KIT_TIMEOUT:-420}" "$KIT_VENV/bin/python" -m benchmarks.gpu_acceptance \
    --out "$OUT" --firejail "$FIREJAIL" --budget-s $(( ${KIT_TIMEOUT:-420} - 20 )) \
    --prepared "$OUT/prepare.json" "$@"
fi

# ---- outside: prepare the host, then the namespace -----------------------------------------------
STARTED=$(date +%s)
REASON=""
STAGE=start
made=()
mkdir -p "$OUT" 2>/dev/null || true
rm -f "$OUT/gpu-acceptance.json" "$OUT/gpu-acceptance.md" "$OUT/.kit-failure" "$OUT/prepare.json" "$OUT/llama-jail" 2>/dev/null || true
json_str() { printf '%s' "$1" | tr '\n\t' '  ' | sed 's/\\/\\\\/g; s/"/\\"/g'; }
# A report in every case: where the checks never ran (or died before writing theirs), one
# saying at which stage and why.
report_failure() {
  local detail=$1 secs=$(( $(date +%s) - STARTED ))
  mkdir -p "$OUT" || return 0
  local kit
  kit=$(tr '\n' ' ' <"$KIT/kit.json" 2>/dev/null || true)
  printf '{"meta": {"mode": "%s", "host": "%s", "seconds": %s, "when": "%s", "kit": %s, "counts": {"PASS": 0, "FAIL": 1, "SKIP": 0, "INFO": 0}},\n "checks": [{"name": "kit.%s", "status": "FAIL", "detail": "%s", "seconds": %s, "data": {}}]}\n' \
    "$([ "${SIM:-0}" = 1 ] && echo simulated || echo real-gpu)" "$(hostname 2>/dev/null || echo unknown)" "$secs" \
    "$(date -u +%FT%TZ)" "${kit:-"{}"}" "$STAGE" "$(json_str "$detail")" "$secs" \
    >"$OUT/gpu-acceptance.json"
  printf '# GPU acceptance (failed before the checks)\n\n%s, %s s.\n\nPASS 0, FAIL 1, SKIP 0; INFO 0.\n\n| check | result | detail | s |\n|---|---|---|---|\n| kit.%s | FAIL | %s | %s |\n' \
    "$(date -u +%FT%TZ)" "$secs" "$STAGE" "$(printf '%s' "$detail" | tr '\n|' ' /')" "$secs" >"$OUT/gpu-acceptance.md"
}
on_exit() {
  local rc=$?
  for dir in "${made[@]}"; do rmdir "$dir" 2>/dev/null || true; done
  if [ ! -s "$OUT/gpu-acceptance.json" ]; then
    local detail=${REASON:-"stopped (exit $rc) at stage $STAGE"}
    if [ -s "$OUT/.kit-failure" ]; then detail=$(cat "$OUT/.kit-failure"); fi
    report_failure "$detail"
    [ "$rc" != 0 ] || rc=1
  fi
  rm -f "$OUT/.kit-failure"
  say "report in $OUT/gpu-acceptance.md and .json (exit $rc)"
  exit "$rc"
}
trap on_exit EXIT
trap 'REASON=${REASON:-"line $LINENO: $BASH_COMMAND failed"}' ERR
fail() { REASON="$*"; say "$*"; exit 1; }

SIM=${KIT_SIMULATE:-0}
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case ${args[$i]} in
    --simulate) SIM=1 ;;
    --wheels) KIT_WHEELS=${args[$((i + 1))]:-} ;;
    --libcuda) LIBCUDA=${args[$((i + 1))]:-} ;;
    --mps) MPS=1 ;;
  esac
done
if [ "$SIM" = 1 ] && [[ " $* " != *" --simulate "* ]]; then set -- --simulate "$@"; fi
STAGE=root
[ "$(id -u)" = 0 ] || fail "run as root (it installs firejail setuid and starts jails)"
if [ "${MPS:-0}" = 1 ] && [ "$SIM" != 1 ]; then
  fail "--mps sets EXCLUSIVE_PROCESS and starts an MPS daemon; the kit never changes a machine's compute mode or MIG (simulation only)"
fi

# 1. The sandbox user and its home.
STAGE=user
if ! getent passwd "$SANDBOX_UID" >/dev/null; then
  getent group "$SANDBOX_UID" >/dev/null || groupadd -g "$SANDBOX_UID" sandbox 2>/dev/null ||
    echo "sandbox:x:$SANDBOX_UID:" >>/etc/group
  useradd -u "$SANDBOX_UID" -g "$SANDBOX_UID" -d /workspace -M -s /usr/sbin/nologin sandbox 2>/dev/null ||
    echo "sandbox:x:$SANDBOX_UID:$SANDBOX_UID::/workspace:/usr/sbin/nologin" >>/etc/passwd
  say "created the sandbox user (uid $SANDBOX_UID, home /workspace)"
fi
home=$(getent passwd "$SANDBOX_UID" | cut -d: -f6)
[ "$home" = /workspace ] || fail "uid $SANDBOX_UID exists with home $home, not /workspace (the appliance needs /workspace)"
install -d -o "$SANDBOX_UID" -g "$(getent passwd "$SANDBOX_UID" | cut -d: -f4)" -m 0755 /workspace

# 2. firejail, root-owned and setuid, and the libraries it lacks, in $KIT_HOME.
STAGE=firejail
install -d -m 0755 "$KIT_HOME" "$KIT_HOME/lib"
if [ -z "${FIREJAIL:-}" ]; then
  rm -rf "$KIT_HOME/firejail"
  cp -a "$KIT/firejail" "$KIT_HOME/firejail"
  chown -R root:root "$KIT_HOME/firejail"
  chmod -R go-w "$KIT_HOME/firejail"
  chmod 4755 "$KIT_HOME/firejail/usr/bin/firejail"
  for dir in "$FJ_LIB" "$FJ_ETC"; do
    if [ ! -d "$dir" ]; then mkdir -p "$dir"; made+=("$dir"); fi
  done
fi
rm -f "$KIT_HOME"/lib/*.so*
LDCACHE=$(ldconfig -p)   # read once (and grep -q on a pipe would fail it under pipefail)
have() { grep -E "^[[:space:]]*$1 \(libc6,x86-64" >/dev/null <<<"$LDCACHE"; }
for lib in "${KIT_LIBS[@]}"; do
  if ! have "$lib"; then
    [ -e "$KIT/lib/$lib" ] || fail "the host lacks $lib and the kit carries none"
    cp "$KIT/lib/$lib" "$KIT_HOME/lib/"
    say "$lib: the host has none; the kit's (from its Debian package) in $KIT_HOME/lib"
  fi
done

# 3. A Python for the kit's venv, which jails run as the sandbox uid.
STAGE=python
version_ok() { "$1" -c 'import sys; sys.exit(sys.version_info[:2] not in ((3, 11), (3, 12)))' 2>/dev/null; }
# The appliance's jails see /usr, /bin and /lib, a private /tmp, and of the rest only the
# venv they run (whitelisted): the base interpreter the venv points to must live under /usr
# (or /bin, /lib), not under /opt, /tmp, /root or /home.
outside_jail_view() {
  local where
  where=$("$1" -c 'import os, sys; print(os.path.realpath(sys._base_executable)); print(os.path.realpath(sys.base_prefix))' 2>/dev/null) || return 0
  grep -q -v -E '^/(usr|bin|sbin|lib|lib64)(/|$)' <<<"$where"
}
usable() {
  version_ok "$1" && ! outside_jail_view "$1" &&
    setpriv --reuid=65534 --regid=65534 --clear-groups "$1" -c pass 2>/dev/null
}
if [ -z "${PYTHON:-}" ]; then
  for candidate in python3.12 python3.11 python3 /usr/bin/python3.12 /usr/bin/python3.11 \
      /opt/*/bin/python3 /opt/*/.venv/bin/python3 /opt/*/venv/bin/python3; do
    path=$(command -v "$candidate" 2>/dev/null || true)
    [ -n "$path" ] && [ "${path#"$KIT_VENV"/}" = "$path" ] || continue
    if usable "$path"; then PYTHON=$path; break; fi
  done
fi
[ -n "${PYTHON:-}" ] || fail "no Python 3.11 or 3.12 whose base interpreter is under /usr and that the sandbox uid can run (set PYTHON)"
version_ok "$PYTHON" || fail "PYTHON=$PYTHON is not Python 3.11 or 3.12"
outside_jail_view "$PYTHON" && fail "PYTHON=$PYTHON: its base interpreter is not under /usr, so a jail (which sees only /usr, /bin, /lib and the kit's venv) cannot run it; name another with PYTHON="
usable "$PYTHON" || fail "PYTHON=$PYTHON cannot be run by another uid (a folder above it is not o+x)"
pyver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')

# The venv: the jails run its Python as the sandbox uid, so every folder above it must let any
# uid through (a runner's temp folder or a home directory often does not).
mkdir -p "$(dirname "$KIT_VENV")"
if ! setpriv --reuid=65534 --regid=65534 --clear-groups test -x "$(dirname "$KIT_VENV")"; then
  fail "KIT_VENV=$KIT_VENV: the sandbox uid cannot reach $(dirname "$KIT_VENV") (a folder above it is not o+x); leave KIT_VENV unset ($KIT_HOME/venv) or pick a place every uid can traverse"
fi
STAGE=venv
pip_wheel=$(ls "$KIT"/wheels/pip-*.whl | head -1)
kit_pip() { "$KIT_VENV/bin/python" "$pip_wheel/pip" install -q --no-index --disable-pip-version-check "$@"; }
stamp="$(cat "$KIT/kit.json" 2>/dev/null | sha256sum | cut -c1-16) $PYTHON"
if [ ! -x "$KIT_VENV/bin/appliance" ] || [ "$(cat "$KIT_VENV/.kit-stamp" 2>/dev/null)" != "$stamp" ]; then
  say "installing the appliance into $KIT_VENV (Python $pyver from $PYTHON, offline, from $KIT/wheels)"
  rm -rf "$KIT_VENV"
  "$PYTHON" -m venv --without-pip "$KIT_VENV"
  kit_pip --find-links "$KIT/wheels" appliance appliance-client nvidia-ml-py
  echo "$stamp" >"$KIT_VENV/.kit-stamp"
fi
# llama-cpp-python: the kit's CUDA build, or --wheels DIR's (any build, for llama_offload).
llama=$(ls "$KIT"/wheels/llama_cpp_python-*.whl 2>/dev/null | tail -1 || true)
llama_from=kit
if [ -n "${KIT_WHEELS:-}" ]; then
  [ -d "$KIT_WHEELS" ] || fail "--wheels/KIT_WHEELS: $KIT_WHEELS is not a folder"
  KIT_WHEELS=$(cd "$KIT_WHEELS" && pwd)
  if [[ " $* " != *" --wheels "* ]]; then set -- "$@" --wheels "$KIT_WHEELS"; fi
  llama=$(ls "$KIT_WHEELS"/llama_cpp_python-*.whl 2>/dev/null | tail -1 || true)
  llama_from="--wheels $KIT_WHEELS"
  [ -n "$llama" ] || say "$KIT_WHEELS holds no llama_cpp_python-*.whl; llama_offload will say so"
fi
"$KIT_VENV/bin/python" "$pip_wheel/pip" uninstall -q -y llama-cpp-python >/dev/null 2>&1 || true
llama_problem=""
site=$("$KIT_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# numpy, llama.cpp's one heavy requirement (16 MiB a Python), is not carried: the machine's
# Python has one (a PyTorch venv does; Debian's python3-numpy), copied into the kit's venv.
copy_numpy() {
  "$PYTHON" - "$site" <<'EOF'
import glob, importlib.util, os, shutil, sys
spec = importlib.util.find_spec("numpy")
if spec is None or not spec.submodule_search_locations:
    sys.exit("numpy is not installed for " + sys.executable)
import numpy
parent = os.path.dirname(list(spec.submodule_search_locations)[0])
for src in [os.path.join(parent, "numpy")] + glob.glob(os.path.join(parent, "numpy-*-info")) + glob.glob(os.path.join(parent, "numpy.libs")):
    dst = os.path.join(sys.argv[1], os.path.basename(src))
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, symlinks=True) if os.path.isdir(src) else shutil.copy2(src, dst)
print(numpy.__version__, "from", parent)
EOF
}
if [ -n "$llama" ]; then
  say "installing $(basename "$llama") into $KIT_VENV ($llama_from)"
  reqs=$("$KIT_VENV/bin/python" -c 'import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
for line in z.read(meta).decode().splitlines():
    if line.startswith("Requires-Dist:") and "extra ==" not in line and not line.split()[1].startswith("numpy"):
        print(line.split(":", 1)[1].strip().replace(" ", ""))' "$llama")
  if ! "$KIT_VENV/bin/python" -c 'import numpy' 2>/dev/null; then
    if got=$(copy_numpy 2>&1); then say "numpy $got"; else llama_problem="llama.cpp needs numpy: $got"; fi
  fi
  # shellcheck disable=SC2086  # one requirement a word
  if [ -z "$llama_problem" ] && ! err=$( { kit_pip --no-deps "$llama" &&
      { [ -z "$reqs" ] || kit_pip --find-links "$(dirname "$llama")" --find-links "$KIT/wheels" $reqs; }; } 2>&1); then
    llama_problem="installing $(basename "$llama") failed: $(echo "$err" | tail -2 | tr '\n' ' ')"
  fi
  [ -z "$llama_problem" ] || say "$llama_problem"
fi
chmod -R a+rX "$KIT_VENV"

# 4. The driver's and CUDA's libraries, by absolute path: ld.so.cache first, then where drivers
# and toolkits put them when the cache does not name them.
STAGE=libraries
search=()
IFS=: read -r -a ld_path <<<"${LD_LIBRARY_PATH:-}"
search+=("${ld_path[@]}" /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu /usr/lib64
         /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-13*/lib64)
for py in "$PYTHON" "$KIT_VENV/bin/python"; do
  while read -r site; do search+=("$site"/nvidia/cu13/lib "$site"/nvidia/*/lib); done \
    < <("$py" -c 'import site, sys; print("\n".join(p for p in sys.path if p.endswith("-packages")))' 2>/dev/null || true)
done
echo "$KIT_HOME/lib" >"$KIT_HOME/lib-dirs"
declare -A found=()
for lib in "${CUDA_LIBS[@]}"; do
  path=$(awk -v l="$lib" '$1 == l && /x86-64/ {print $NF; exit}' <<<"$LDCACHE")
  if [ -z "$path" ]; then
    for dir in "${search[@]}"; do
      if [ -n "$dir" ] && [ -e "$dir/$lib" ]; then path=$(readlink -f "$dir/$lib"); break; fi
    done
    [ -z "$path" ] || grep -qx "$(dirname "$path")" "$KIT_HOME/lib-dirs" || dirname "$path" >>"$KIT_HOME/lib-dirs"
  fi
  found[$lib]=$path
done
LIBCUDA=${LIBCUDA:-${found[libcuda.so.1]}}
[ -n "$LIBCUDA" ] || fail "libcuda.so.1 not found (ldconfig -p, LD_LIBRARY_PATH, /usr/local/nvidia): is the NVIDIA driver installed?"
case $LIBCUDA in /*) ;; *) fail "--libcuda $LIBCUDA: an absolute path, please" ;; esac
[ -e "$LIBCUDA" ] || fail "--libcuda $LIBCUDA does not exist"
found[libcuda.so.1]=$LIBCUDA
# The jails' CUDA runtime opens libcuda.so.1 by name: its folder goes into the kit's cache too.
grep -qx "$(dirname "$LIBCUDA")" "$KIT_HOME/lib-dirs" || grep -F " => $LIBCUDA" >/dev/null <<<"$LDCACHE" ||
  dirname "$LIBCUDA" >>"$KIT_HOME/lib-dirs"
if [[ " $* " != *" --libcuda "* ]]; then set -- "$@" --libcuda "$LIBCUDA"; fi
if [[ " $* " != *" --gguf "* ]] && [ -f "$KIT/models/kit-tiny.gguf" ]; then set -- "$@" --gguf "$KIT/models/kit-tiny.gguf"; fi
for lib in libcudart.so.13 libcublas.so.13 libcublasLt.so.13; do
  if [ -z "${found[$lib]}" ] && [ -n "$llama" ] && [ -z "$llama_problem" ]; then
    llama_problem="$lib not found (ldconfig -p, LD_LIBRARY_PATH, /usr/local/cuda, a Python's nvidia/cu13 wheels): llama.cpp's CUDA build needs the CUDA 13 runtime and cuBLAS"
  fi
done
n=$(wc -l <"$KIT_HOME/lib-dirs")
for ((j = 0; j < n; j++)); do install -d -m 0755 "/usr/lib/appliance-gpu-kit/$j"; done
# What was prepared, for the report (benchmarks.gpu_acceptance --prepared).
{
  printf '{"python": "%s", "python_version": "%s", "venv": "%s", "firejail": "%s",' "$PYTHON" "$pyver" "$KIT_VENV" \
    "${FIREJAIL:-$KIT_HOME/firejail/usr/bin/firejail}"
  printf ' "kit_libs": [%s],' "$(ls "$KIT_HOME/lib" | sed 's/.*/"&"/' | paste -sd, -)"
  printf ' "lib_dirs": [%s], "libraries": {' "$(sed 's/.*/"&"/' "$KIT_HOME/lib-dirs" | paste -sd, -)"
  first=1
  for lib in "${CUDA_LIBS[@]}"; do
    [ $first = 1 ] || printf ', '
    first=0
    printf '"%s": "%s"' "$lib" "${found[$lib]}"
  done
  printf '}, "llama": "%s", "llama_from": "%s", "llama_problem": "%s"}\n' "$(basename "${llama:-}")" \
    "$(json_str "$llama_from")" "$(json_str "$llama_problem")"
} >"$OUT/prepare.json"
export LLAMA_PROBE="" JAIL_LIBCUDA_DIR=""
# In simulation the appliance names the stand-in libcuda by path, so its jails whitelist that
# folder (which hides the rest of its parent): the first jail does the same.
if [ "$SIM" = 1 ]; then JAIL_LIBCUDA_DIR=$(dirname "$LIBCUDA"); fi
if [ -n "$llama" ] && [ -z "$llama_problem" ]; then LLAMA_PROBE=1; fi

STAGE=jail
rc=0
KIT_INNER=1 KIT_HOME="$KIT_HOME" unshare --mount --propagation private "$0" "$@" || rc=$?
for ((j = 0; j < n; j++)); do rmdir "/usr/lib/appliance-gpu-kit/$j" 2>/dev/null || true; done
rmdir /usr/lib/appliance-gpu-kit 2>/dev/null || true
exit $rc
