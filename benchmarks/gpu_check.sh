#!/usr/bin/env bash
# One prepared GPU check for a lent NVIDIA H200 machine (no network there; <= 8 minutes):
# cuda-sm90 build of the model, logits vs the CPU build, GEMM vs torch.matmul (fp16), int4 GEMV
# bandwidth vs a device copy, decode tok/s -> one table. Usage: benchmarks/gpu_check.sh [MODEL]
set -u
cd "$(dirname "$0")/.."
MODEL="${1:-smollm2-135m}"
# TVM compiles CUDA with NVRTC (needs cuda-python) unless told to use nvcc; prefer nvcc when present.
if command -v nvcc >/dev/null 2>&1; then export TVM_CUDA_COMPILE_MODE="${TVM_CUDA_COMPILE_MODE:-nvcc}"; fi
export PERFX_NO_CUBIN="${PERFX_NO_CUBIN:-1}"   # the bundle's offline cubin export is not needed here
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null || echo "nvidia-smi not available"
python -c "import tvm, sys; print('tvm', tvm.__version__, 'cuda device:', tvm.cuda(0).exist)" || exit 1
timeout 470 python benchmarks/gpu_check.py --model "$MODEL" --target cuda-sm90 --steps 64
