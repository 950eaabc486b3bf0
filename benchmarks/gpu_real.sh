#!/usr/bin/env bash
# The GPU contention benchmark against a real GPU: one command, well under 8 minutes.
#
#   sudo bash benchmarks/gpu_real.sh            # on a host with an NVIDIA GPU, after `make setup`
#   sudo MPS=1 bash benchmarks/gpu_real.sh      # the same with a CUDA MPS daemon (started and
#                                               # stopped here; limits are proven only on a GPU
#                                               # already in EXCLUSIVE_PROCESS compute mode)
#
# Starts the appliance with SANDBOX_GPU=1 (NVML backend) on a free loopback port, runs
# benchmarks/gpu_contention.py --server against it (each run allocates its GPU memory with
# the CUDA driver API inside its jail), writes benchmarks/results/gpu_contention_real-gpu.*,
# and stops the server. Exits non-zero if the appliance does not start (e.g. no driver).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-$(scripts/venv-dir.sh 2>/dev/null || echo .venv)}
PY=$VENV/bin/python
PORT=${PORT:-$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
LOG=$(mktemp /tmp/appliance-gpu-bench.XXXXXX.log)
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv || true
[ -e /dev/nvidia-uvm ] || nvidia-modprobe -u -c=0 || true   # jails cannot run the setuid helper
MPS_ENV=()
if [ "${MPS:-0}" = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps CUDA_MPS_LOG_DIRECTORY=/tmp/nvidia-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d
  MPS_ENV=(SANDBOX_GPU_MPS=auto SANDBOX_GPU_MPS_PIPE_DIR="$CUDA_MPS_PIPE_DIRECTORY")
fi
env "${MPS_ENV[@]}" SANDBOX_GPU=1 SANDBOX_PYTHON=$PY SANDBOX_PRELOAD= SANDBOX_POOL_SIZE=2 SANDBOX_MAX_CONCURRENCY=16 \
  SANDBOX_MEMORY_MB=4096 SANDBOX_GPU_MARGIN_MB=256 SANDBOX_MAX_EXEC_MS=60000 \
  timeout 450 "$VENV/bin/appliance" serve --host 127.0.0.1 --port "$PORT" 2>"$LOG" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; [ "${MPS:-0}" = 1 ] && echo quit | nvidia-cuda-mps-control; echo "server log: $LOG"' EXIT
for _ in $(seq 1 240); do
  if curl -fsS "http://127.0.0.1:$PORT/readyz" >/dev/null 2>&1; then break; fi
  if ! kill -0 $SERVER 2>/dev/null; then echo "the appliance did not start:"; tail -5 "$LOG"; exit 1; fi
  sleep 0.5
done
curl -fsS "http://127.0.0.1:$PORT/readyz"; echo
NAME=gpu_contention_real-gpu$([ "${MPS:-0}" = 1 ] && echo -mps)
timeout 360 "$PY" -m benchmarks.gpu_contention --server "ws://127.0.0.1:$PORT/exec" --name "$NAME"
echo "results: benchmarks/results/$NAME.{json,md,png}"
