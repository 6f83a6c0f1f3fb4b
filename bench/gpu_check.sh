#!/usr/bin/env bash
# The whole GPU check in one call, for a lent GPU machine (see docs/benchmarks.md):
#   versions, MPS, tests/gpu, the kernel benchmark and the main collectives at 2 and 4 ranks
#   beside gloo on CUDA tensors. Logs and JSON go to $OUT (or ./gpu-check-out).
# Run from the repository root:  bash bench/gpu_check.sh
set -uo pipefail
out=${OUT:-gpu-check-out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
bench() { python3 -m gpucomm._bench.cli "$@"; }
{
    nvidia-smi -L
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    python3 -c "import cupy; print('cupy', cupy.__version__)" || echo "cupy: not importable"
} 2>&1 | tee "$out/versions.txt"

# MPS lets the ranks' kernels run at the same time on the one GPU; without it they take turns.
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
if nvidia-cuda-mps-control -d 2>>"$out/versions.txt"; then mps=on; else mps=off; fi
echo "MPS: $mps" | tee -a "$out/versions.txt"

status=0
python3 -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tee "$out/tests_gpu.log" || status=1
bench kernels -b 4K -e 256M -f 4 --json "$out/kernels.json" 2>&1 | tee "$out/bench.log" || status=1
# One JSON per world size (the device tool brings back at most 8 files).
for p in 2 4; do
    bench all --nproc "$p" -b 8 -e 64M -f 4 --compare gloo --json "$out/collectives_np$p.json" 2>&1 | tee -a "$out/bench.log" || status=1
done
[ "$mps" = on ] && echo quit | nvidia-cuda-mps-control
exit $status
