#!/usr/bin/env bash
# `make gpu-kit`: the offline real-GPU acceptance kit, a folder (and a .tar.gz of it) of at
# most 64 MiB with everything a bare GPU machine lacks (docs/gpu.md, "The acceptance kit").
#
#   scripts/gpu-kit.sh [OUT_DIR]          # default build/gpu-kit (+ build/gpu-kit.tar.gz)
#
# Target: x86-64, NVIDIA driver >= 550 (nvidia-smi, libcuda), CUDA 13 runtime and cuBLAS
# somewhere on the machine (a toolkit, or a Python's nvidia wheels), Python 3.11 or 3.12 with
# numpy, root, offline, no firejail, no sandbox user. The kit carries:
#   firejail/   firejail's Debian package unpacked (dpkg -x): usr/bin/firejail, its helpers and
#               seccomp filters (usr/lib/x86_64-linux-gnu/firejail) and etc/firejail
#   lib/        the shared libraries firejail needs, from their Debian packages (libapparmor1,
#               libselinux1, libpcre2-8-0), and llama.cpp's libgomp1: installed on the target
#               only where it lacks them
#   wheels/     the appliance as a wheel and what its server needs, for CPython 3.11 and 3.12
#               (manylinux x86-64), nvidia-ml-py, pip itself (the target may have no pip), the
#               CUDA build of llama-cpp-python (scripts/cuda-wheel.sh; $CUDA_WHEEL, else
#               build/cuda-wheel/) and its requirements but numpy (the target's own is used)
#   models/     a tiny random llama GGUF (tests/models.py), for the GPU session and offload
#   benchmarks/ the checks (gpu_acceptance.py) and the contention mix they reuse
#   gpu-acceptance.sh, kit.json (what went in: versions, commit, sizes)
# Downloads are cached under $APPLIANCE_KIT_CACHE (default ~/.cache/appliance-gpu-kit), keyed
# on the wheel's requirements, so a second build is offline and takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-build/gpu-kit}
LIMIT_MB=${GPU_KIT_LIMIT_MB:-64}
CACHE=${APPLIANCE_KIT_CACHE:-$HOME/.cache/appliance-gpu-kit}
PY=${PY:-$(scripts/venv-dir.sh)/bin/python}
PYTHONS=(3.11 3.12)
# What the kit's checks need besides the appliance's own requirements (none needs numpy).
EXTRA=(nvidia-ml-py)
mkdir -p "$CACHE"
rm -rf "$OUT" "$OUT.tar.gz"
mkdir -p "$OUT/wheels" "$OUT/benchmarks"

# 1. firejail, unpacked. A cached .deb serves machines where apt cannot download.
deb=$(ls "$CACHE"/firejail_*_amd64.deb 2>/dev/null | tail -1 || true)
if [ -z "$deb" ]; then
  (cd "$CACHE" && apt-get download firejail >/dev/null 2>&1) || {
    echo "gpu-kit: cannot download firejail's .deb (apt-get download firejail); put one in $CACHE" >&2; exit 1; }
  deb=$(ls "$CACHE"/firejail_*_amd64.deb | tail -1)
fi
dpkg-deb -x "$deb" "$OUT/firejail.full"
mkdir -p "$OUT/firejail/usr/bin" "$OUT/firejail/usr/lib/x86_64-linux-gnu" "$OUT/firejail/etc"
mv "$OUT/firejail.full/usr/bin/firejail" "$OUT/firejail/usr/bin/"
mv "$OUT/firejail.full/usr/lib/x86_64-linux-gnu/firejail" "$OUT/firejail/usr/lib/x86_64-linux-gnu/"
mv "$OUT/firejail.full/etc/firejail" "$OUT/firejail/etc/"
rm -rf "$OUT/firejail.full"   # docs, man pages, firecfg, apparmor profiles: not needed

# 1b. The shared libraries firejail links (setuid: LD_LIBRARY_PATH cannot supply them) and
# llama.cpp's OpenMP runtime (libgomp1: not on a bare machine), from their Debian packages; the
# target installs only those it lacks.
mkdir -p "$OUT/lib"
for pkg in libapparmor1 libselinux1 libpcre2-8-0 libgomp1; do
  pdeb=$(ls "$CACHE"/${pkg}_*_amd64.deb 2>/dev/null | tail -1 || true)
  if [ -z "$pdeb" ]; then
    (cd "$CACHE" && apt-get download "$pkg" >/dev/null 2>&1) || {
      echo "gpu-kit: cannot download $pkg's .deb (apt-get download $pkg); put one in $CACHE" >&2; exit 1; }
    pdeb=$(ls "$CACHE"/${pkg}_*_amd64.deb | tail -1)
  fi
  dpkg-deb -x "$pdeb" "$OUT/lib.full"
done
for lib in libapparmor.so.1 libselinux.so.1 libpcre2-8.so.0 libgomp.so.1; do
  cp -L "$(find "$OUT/lib.full" -name "$lib" | head -1)" "$OUT/lib/$lib"
done
rm -rf "$OUT/lib.full"
missing=$(LD_LIBRARY_PATH="$OUT/lib" ldd "$OUT/firejail/usr/bin/firejail" | grep 'not found' || true)
[ -z "$missing" ] || { echo "gpu-kit: firejail still lacks: $missing" >&2; exit 1; }

# 2. The appliance's wheel and its client's, built from this checkout (no network).
"$PY" -m pip wheel -q --no-deps -w "$OUT/wheels" . >"$OUT/.wheel.log" 2>&1 || { cat "$OUT/.wheel.log" >&2; exit 1; }
rm -f "$OUT/.wheel.log"
wheel=$(ls "$OUT"/wheels/appliance-*.whl)
# The client distribution (client/): the acceptance checks reach the server through it. Its one
# requirement (websockets) is among the appliance's own.
"$PY" -m pip wheel -q --no-deps -w "$OUT/wheels" ./client >"$OUT/.wheel.log" 2>&1 || { cat "$OUT/.wheel.log" >&2; exit 1; }
rm -f "$OUT/.wheel.log"

# 3. Its requirements for each Python, binary wheels only, cached by what is required.
key=$( (unzip -p "$wheel" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==';
        printf '%s\n' "${EXTRA[@]}" "${PYTHONS[@]}") | sha256sum | cut -c1-16)
for ver in "${PYTHONS[@]}"; do
  dest="$CACHE/wheels-$ver-$key"
  if [ ! -e "$dest/.complete" ]; then
    rm -rf "$dest" && mkdir -p "$dest"
    "$PY" -m pip download -q --dest "$dest" --only-binary=:all: --python-version "$ver" \
      --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux_2_28_x86_64 "$wheel" "${EXTRA[@]}" pip 2> >(grep -v 'is ignored: it is neither' >&2)
    rm -f "$dest"/appliance-*.whl
    touch "$dest/.complete"
  fi
  cp -n "$dest"/*.whl "$OUT/wheels/"
done

# 3b. The CUDA build of llama-cpp-python (built here once: make cuda-wheel) and its
# requirements but numpy (16 MiB a Python): gpu-acceptance.sh copies the machine's own.
# Where it is looked for: CUDA_WHEEL, build/cuda-wheel/, then ../shared/cuda-wheel/ (a copy
# beside the checkout travels to other machines and CI). GPU_KIT_LLAMA=venv instead packs the
# venv's own (CPU) build: for the kit in simulation only, and kit.json says so.
cuda_wheel=${CUDA_WHEEL:-$(ls build/cuda-wheel/llama_cpp_python-*.whl ../shared/cuda-wheel/llama_cpp_python-*.whl 2>/dev/null | head -1 || true)}
if [ "${GPU_KIT_LLAMA:-}" = venv ]; then
  mkdir -p "$OUT/.llama" && "$PY" scripts/wheel_slim.py --installed "$OUT/.llama/llama.whl" -
  cuda_wheel=""
  llama_kind="the venv's own build, packed by scripts/wheel_slim.py (no CUDA: simulation only)"
  mv "$OUT/.llama/llama.whl" "$OUT/wheels/llama_cpp_python-$("$PY" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))')-py3-none-linux_x86_64.whl"
  rm -rf "$OUT/.llama"
elif [ -z "$cuda_wheel" ] || [ ! -f "$cuda_wheel" ]; then
  echo "gpu-kit: no CUDA build of llama-cpp-python; build it once with \`make cuda-wheel\`" \
       "(scripts/cuda-wheel.sh, needs nvcc) or name one with CUDA_WHEEL=" >&2
  exit 1
else
  llama_kind="CUDA build: $(sed -n 1p "$(dirname "$cuda_wheel")/BUILD-INFO" 2>/dev/null || echo "$cuda_wheel")"
  cp "$cuda_wheel" "$OUT/wheels/"
fi
llama_wheel=$(ls "$OUT"/wheels/llama_cpp_python-*.whl)
llama_reqs=$(unzip -p "$llama_wheel" '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: \([^;]*\)$/\1/p' | tr -d ' ')
for ver in "${PYTHONS[@]}"; do
  dest="$CACHE/llama-reqs-$ver-$(echo "$llama_reqs" | sha256sum | cut -c1-16)"
  if [ ! -e "$dest/.complete" ]; then
    rm -rf "$dest" && mkdir -p "$dest"
    # shellcheck disable=SC2086  # one requirement a word
    "$PY" -m pip download -q --dest "$dest" --only-binary=:all: --python-version "$ver" \
      --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux_2_28_x86_64 $llama_reqs 2> >(grep -v 'is ignored: it is neither' >&2)
    touch "$dest/.complete"
  fi
  for whl in "$dest"/*.whl; do
    case $(basename "$whl") in numpy-*) continue ;; esac
    cp -n "$whl" "$OUT/wheels/"
  done
done

# 3c. A tiny random llama GGUF (two layers, a few MiB): the GPU session and offload checks.
mkdir -p "$OUT/models"
"$PY" -c 'import sys; from pathlib import Path; from tests.models import write_tiny_llama; write_tiny_llama(Path(sys.argv[1]))' \
  "$OUT/models/kit-tiny.gguf"

# 4. The checks and the runner.
cp benchmarks/__init__.py benchmarks/gpu_contention.py benchmarks/gpu_acceptance.py "$OUT/benchmarks/"
cp scripts/gpu-acceptance.sh "$OUT/"
chmod +x "$OUT/gpu-acceptance.sh"
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
"$PY" - "$OUT" "$commit" "$deb" "${cuda_wheel:+$(dirname "$cuda_wheel")/BUILD-INFO}" "$llama_kind" <<'EOF'
import json, sys, time
from pathlib import Path
out, commit, deb = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]).name
files = sorted(p for p in out.rglob("*") if p.is_file())
info = Path(sys.argv[4]) if sys.argv[4] else None
llama = next((p.name for p in (out / "wheels").glob("llama_cpp_python-*.whl")), None)
json.dump({"commit": commit, "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "firejail_deb": deb, "pythons": ["3.11", "3.12"],
           "llama": llama, "llama_kind": sys.argv[5],
           "cuda_llama": llama if info else None,
           "cuda_llama_build": info.read_text().splitlines() if info and info.exists() else None,
           "firejail_libs": sorted(p.name for p in (out / "lib").iterdir()),
           "wheels": sorted(p.name for p in (out / "wheels").glob("*.whl")),
           "bytes": sum(p.stat().st_size for p in files)}, open(out / "kit.json", "w"), indent=1)
EOF

# 5. The size limit holds for the folder and the archive.
tar -C "$(dirname "$OUT")" -czf "$OUT.tar.gz" "$(basename "$OUT")"
folder_kb=$(du -sk "$OUT" | cut -f1)
archive_kb=$(( $(stat -c %s "$OUT.tar.gz") / 1024 ))
echo "gpu-kit: $OUT ($((folder_kb / 1024)) MiB), $OUT.tar.gz ($((archive_kb / 1024)) MiB), limit $LIMIT_MB MiB"
if [ "$folder_kb" -gt $((LIMIT_MB * 1024)) ] || [ "$archive_kb" -gt $((LIMIT_MB * 1024)) ]; then
  echo "gpu-kit: over the $LIMIT_MB MiB limit" >&2
  exit 1
fi
