#!/usr/bin/env bash
# The acceptance kit's bare-machine rehearsal (tests/test_gpu_kit.py runs it in `make test`):
# the kit, as `make gpu-kit` built it, unpacked and run with the docs' command in a fresh
# minimal Debian 12 root (debootstrap --variant=minbase, cached as a tarball), as bare as the
# lent GPU machine: no sandbox user, no /workspace, no firejail, no libapparmor1 and no
# libgomp1, the interpreter a venv under /opt (ahead of /usr/bin on PATH) that holds numpy
# (the system's Python has none), the "driver" only under
# /usr/local/nvidia and reached through LD_LIBRARY_PATH, and the CUDA 13 runtime and cuBLAS
# only inside that venv's nvidia wheels (as PyTorch's pip wheels bring them). The GPU is
# simulated (KIT_SIMULATE=1): the stand-in libcuda (tests/stub_libcuda.c) is the "driver"'s
# libcuda.so.1 and the stand-in nvidia-smi (tests/stub_nvidia_smi.py) its nvidia-smi. Run as
# root (chroot, mounts):
#
#   scripts/gpu-rehearsal.sh [KIT_TARBALL] [REPORT_DIR]    # build/gpu-kit.tar.gz, build/gpu-rehearsal
#   scripts/gpu-rehearsal.sh --cuda-libs    # only fetch the CUDA runtime's wheels; print their lib folder
#
# Exit status: the kit's. The report is copied to REPORT_DIR. Nothing of the root is kept
# (a fresh copy each run); the debootstrap tarball and the downloaded wheels are cached under
# $GPU_REHEARSAL_CACHE (default /var/tmp/appliance-gpu-rehearsal).
set -euo pipefail
cd "$(dirname "$0")/.."
LIBS_ONLY=0
if [ "${1:-}" = --cuda-libs ]; then LIBS_ONLY=1; shift; fi
KIT_TGZ=$(readlink -f "${1:-build/gpu-kit.tar.gz}")
REPORT=${2:-build/gpu-rehearsal}
CACHE=${GPU_REHEARSAL_CACHE:-/var/tmp/appliance-gpu-rehearsal}
PY=${PY:-$(scripts/venv-dir.sh)/bin/python}
CUDART=nvidia-cuda-runtime==13.0.96
CUBLAS=nvidia-cublas==13.0.0.19
NUMPY=numpy==2.4.6
say() { echo "gpu-rehearsal: $*" >&2; }
mkdir -p "$CACHE"
# The CUDA 13 runtime and cuBLAS as pip wheels (what a PyTorch venv holds), downloaded once.
wheels="$CACHE/wheels"
if [ ! -e "$wheels/.complete" ]; then
  say "downloading $CUDART and $CUBLAS (once; cached in $wheels)"
  rm -rf "$wheels" && mkdir -p "$wheels"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 "$CUDART" "$CUBLAS" -d "$wheels" \
    2> >(grep -v 'is ignored: it is neither' >&2)
  touch "$wheels/.complete"
fi
numpy_dir="$CACHE/numpy"   # the rehearsal's venv holds numpy, as a PyTorch venv does
if [ "$LIBS_ONLY" = 0 ] && [ ! -e "$numpy_dir/.complete" ]; then
  rm -rf "$numpy_dir" && mkdir -p "$numpy_dir"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    "$NUMPY" -d "$numpy_dir" 2> >(grep -v 'is ignored: it is neither' >&2)
  touch "$numpy_dir/.complete"
fi
if [ "$LIBS_ONLY" = 1 ]; then   # unpacked once, readable by any uid (tests/test_gpu_kit.py)
  if [ ! -e "$CACHE/site/.complete" ]; then
    rm -rf "$CACHE/site" && mkdir -p "$CACHE/site"
    for whl in "$wheels"/*.whl; do "$PY" -m zipfile -e "$whl" "$CACHE/site"; done
    chmod -R a+rX "$CACHE" && touch "$CACHE/site/.complete"
  fi
  echo "$CACHE/site/nvidia/cu13/lib"
  exit 0
fi
[ "$(id -u)" = 0 ] || { say "run as root (debootstrap, chroot, mounts)"; exit 1; }
[ -f "$KIT_TGZ" ] || { say "no kit at $KIT_TGZ (make gpu-kit)"; exit 1; }

# 1. The bare root: Debian 12 minbase and python3, made once and kept as a tarball.
base="$CACHE/bookworm-minbase-python3.tar"
if [ ! -s "$base" ]; then
  command -v debootstrap >/dev/null || { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; }
  say "debootstrap --variant=minbase --include=python3 bookworm (once; cached in $base)"
  rm -rf "$CACHE/rootfs.new"
  debootstrap --variant=minbase --include=python3 bookworm "$CACHE/rootfs.new" \
      http://deb.debian.org/debian >"$CACHE/debootstrap.log" 2>&1 || { tail -20 "$CACHE/debootstrap.log" >&2; exit 1; }
  tar -C "$CACHE/rootfs.new" -cf "$base.tmp" . && mv "$base.tmp" "$base"
  rm -rf "$CACHE/rootfs.new"
fi

ROOT=$(mktemp -d /var/tmp/appliance-gpu-rehearsal-root.XXXXXX)
mounts=()
cleanup() {
  local m
  for ((k = ${#mounts[@]} - 1; k >= 0; k--)); do umount -l "${mounts[$k]}" 2>/dev/null || true; done
  # Jails the kit left (none should be) would keep the root busy: theirs, by this root's path.
  rm -rf --one-file-system "$ROOT" 2>/dev/null || true
}
trap cleanup EXIT
tar -C "$ROOT" -xf "$base"
# The bare machine's facts, checked, so the rehearsal cannot pass on a prepared root.
! chroot "$ROOT" getent passwd 1001 >/dev/null || { say "the base root has uid 1001"; exit 1; }
[ ! -e "$ROOT/workspace" ] && [ ! -e "$ROOT/usr/bin/firejail" ] || { say "the base root is not bare"; exit 1; }
! chroot "$ROOT" /sbin/ldconfig -p | grep -q -E 'libapparmor.so.1|libgomp.so.1' || { say "the base root has libapparmor or libgomp"; exit 1; }
! chroot "$ROOT" /usr/bin/python3.11 -c 'import numpy' 2>/dev/null || { say "the base root's Python has numpy"; exit 1; }

# 3. The interpreter: a venv under /opt, first on PATH, holding numpy and the CUDA runtime's
# wheels (as a PyTorch venv does).
chroot "$ROOT" /usr/bin/python3.11 -m venv --without-pip /opt/venv
site=$(chroot "$ROOT" /opt/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
for whl in "$wheels"/*.whl "$numpy_dir"/*.whl; do "$PY" -m zipfile -e "$whl" "$ROOT$site"; done
chmod -R a+rX "$ROOT/opt/venv"
rm -f "$ROOT/usr/bin/python3"   # python3 on PATH is the venv's
# 4. The "driver": the stand-in libcuda and nvidia-smi under /usr/local/nvidia, in no ld.so.cache.
install -d -m 0755 "$ROOT/usr/local/nvidia/lib64" "$ROOT/usr/local/nvidia/bin"
gcc -shared -fPIC -O1 -o "$ROOT/usr/local/nvidia/lib64/libcuda.so.1" tests/stub_libcuda.c
{ echo '#!/opt/venv/bin/python'; tail -n +2 tests/stub_nvidia_smi.py; } >"$ROOT/usr/local/nvidia/bin/nvidia-smi"
chmod 0755 "$ROOT/usr/local/nvidia/bin/nvidia-smi"
# 5. The kit, unpacked as the docs say; the kernel's file systems the machine would have.
cp "$KIT_TGZ" "$ROOT/root/gpu-kit.tar.gz"
# The root a mount point of its own, as a machine's / is (unshare --propagation needs one).
mount --bind "$ROOT" "$ROOT"
mounts+=("$ROOT")
for m in proc sys dev dev/pts sys/fs/cgroup; do
  mkdir -p "$ROOT/$m"
  case $m in
    proc) mount -t proc proc "$ROOT/proc" ;;
    *) mount --rbind "/$m" "$ROOT/$m"; mount --make-rslave "$ROOT/$m" ;;
  esac
  mounts+=("$ROOT/$m")
done
mkdir -p "$ROOT/tmp" && chmod 1777 "$ROOT/tmp"
cp /etc/resolv.conf "$ROOT/etc/" 2>/dev/null || true
say "running the kit in $ROOT"
rc=0
# The docs' command, with the simulation's switch in the environment.
chroot "$ROOT" /usr/bin/env -i HOME=/root TERM=dumb KIT_SIMULATE=1 STUB_SMI_STATE=/root/smi.json \
  PATH=/opt/venv/bin:/usr/local/nvidia/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  LD_LIBRARY_PATH=/usr/local/nvidia/lib64 \
  /bin/bash -c 'cd /root && tar xzf gpu-kit.tar.gz -C /opt && /opt/gpu-kit/gpu-acceptance.sh' || rc=$?
rm -rf "$REPORT" && mkdir -p "$REPORT"
cp -r "$ROOT/opt/gpu-kit/report/." "$REPORT/" 2>/dev/null || true
# What the kit did to the bare root, for the test to check.
{
  echo "passwd: $(chroot "$ROOT" getent passwd 1001 || true)"
  echo "workspace: $(stat -c '%u %a' "$ROOT/workspace" 2>/dev/null || true)"
  echo "firejail: $(stat -c '%u %A' "$ROOT/opt/appliance-gpu-kit/firejail/usr/bin/firejail" 2>/dev/null || true)"
  echo "kit-libs: $(ls "$ROOT/opt/appliance-gpu-kit/lib" 2>/dev/null | tr '\n' ' ')"
  echo "ld.so.cache-unchanged: $(cmp -s "$ROOT/etc/ld.so.cache" <(tar -xOf "$base" ./etc/ld.so.cache) && echo yes || echo no)"
} >"$REPORT/rehearsal.txt"
say "kit exit $rc; report in $REPORT"
exit $rc
