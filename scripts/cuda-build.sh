#!/usr/bin/env bash
# A CUDA build of llama-cpp-python in the appliance's venv (`make venv` calls this).
#
#   make cuda-build                       # or: APPLIANCE_CUDA_BUILD=1 make venv (same thing),
#                                         # or: APPLIANCE_CUDA_BUILD=1 scripts/cuda-build.sh VENV/bin/python
#
# Opt-in: compiling llama.cpp's CUDA kernels takes many minutes, and a CI machine may have
# nvcc but no GPU, so `make setup` / `make test` never start it unasked; with nvcc present
# and the variable unset, this prints how to ask. With APPLIANCE_CUDA_BUILD=1 it needs nvcc,
# rebuilds the installed llama-cpp-python version with CMAKE_ARGS="-DGGML_CUDA=on" (plus
# CMAKE_CUDA_ARCHITECTURES when CUDA_ARCHS is set, e.g. CUDA_ARCHS=90 for H100/H200 only:
# much faster to build), and fails unless llama_supports_gpu_offload() is then true.
# whisper.cpp stays PyPI's CPU wheel: a source build with CUDA keeps plain ggml SONAMEs that
# clash with llama-cpp-python's in one process (docs/gpu.md; /readyz reports a clash).
set -euo pipefail
py=${1:?usage: scripts/cuda-build.sh PYTHON}
probe='import llama_cpp, sys; sys.exit(0 if llama_cpp.llama_supports_gpu_offload() else 1)'
if [ "${APPLIANCE_CUDA_BUILD:-0}" != 1 ]; then
  if command -v nvcc >/dev/null 2>&1 && ! "$py" -c "$probe" 2>/dev/null; then
    echo "cuda-build: nvcc is here but llama-cpp-python is a CPU build; for GPU offload run" \
         "make cuda-build (a long build; docs/gpu.md)" >&2
  fi
  exit 0
fi
nvcc=$(command -v nvcc || true)
if [ -z "$nvcc" ]; then
  echo "cuda-build: APPLIANCE_CUDA_BUILD=1 needs nvcc (the CUDA toolkit) on PATH" >&2
  exit 1
fi
if "$py" -c "$probe" 2>/dev/null; then
  echo "cuda-build: llama-cpp-python already offloads to the GPU" >&2
  exit 0
fi
version=$("$py" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))' 2>/dev/null || true)
spec=llama-cpp-python${version:+==$version}
cmake_args="-DGGML_CUDA=on${CUDA_ARCHS:+ -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCHS}"
echo "cuda-build: building $spec with CMAKE_ARGS=\"$cmake_args\" (nvcc: $nvcc)" >&2
CUDACXX=$nvcc CMAKE_ARGS="$cmake_args" FORCE_CMAKE=1 \
  "$py" -m pip install -q --force-reinstall --no-cache-dir --no-deps --no-binary llama-cpp-python "$spec"
if ! "$py" -c "$probe"; then
  echo "cuda-build: $spec was rebuilt but llama_supports_gpu_offload() is still false" >&2
  exit 1
fi
echo "cuda-build: llama-cpp-python offloads to the GPU" >&2
