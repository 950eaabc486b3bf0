#!/usr/bin/env bash
# `make gpu-kit`: the offline real-GPU acceptance kit, a folder (and a .tar.gz of it) of at
# most 64 MiB with everything a bare GPU machine lacks (docs/gpu.md, "The acceptance kit").
#
#   scripts/gpu-kit.sh [OUT_DIR]          # default build/gpu-kit (+ build/gpu-kit.tar.gz)
#
# Target: x86-64, NVIDIA driver >= 550 (nvidia-smi, libcuda), Python 3.11 or 3.12, root,
# offline, no firejail. The kit carries:
#   firejail/   firejail's Debian package unpacked (dpkg -x): usr/bin/firejail, its helpers and
#               seccomp filters (usr/lib/x86_64-linux-gnu/firejail) and etc/firejail; the
#               script binds the last two over their compiled-in paths in a private mount
#               namespace (firejail cannot be told another place), so the host is not changed
#   wheels/     the appliance as a wheel and what its server needs, for CPython 3.11 and 3.12
#               (manylinux x86-64), nvidia-ml-py, and pip itself (the target may have no pip)
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

# 2. The appliance's wheel, built from this checkout (no network).
"$PY" -m pip wheel -q --no-deps -w "$OUT/wheels" . >"$OUT/.wheel.log" 2>&1 || { cat "$OUT/.wheel.log" >&2; exit 1; }
rm -f "$OUT/.wheel.log"
wheel=$(ls "$OUT"/wheels/appliance-*.whl)

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

# 4. The checks and the runner.
cp benchmarks/__init__.py benchmarks/gpu_contention.py benchmarks/gpu_acceptance.py "$OUT/benchmarks/"
cp scripts/gpu-acceptance.sh "$OUT/"
chmod +x "$OUT/gpu-acceptance.sh"
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
"$PY" - "$OUT" "$commit" "$deb" <<'EOF'
import json, sys, time
from pathlib import Path
out, commit, deb = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]).name
files = sorted(p for p in out.rglob("*") if p.is_file())
json.dump({"commit": commit, "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "firejail_deb": deb, "pythons": ["3.11", "3.12"],
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
