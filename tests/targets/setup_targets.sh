#!/usr/bin/env bash
# Install what the target execution checks (pytest -m targets) need on a CPU-only Debian machine.
# Idempotent: every step is skipped when its piece is already present. Safe to rerun.
#
#   Debian: cross g++ (aarch64, riscv64), qemu-user, PoCL (OpenCL on the CPU), lavapipe (Vulkan on the CPU),
#           lld-19 + rocm-device-libs (AMDGPU code objects)
#   PyPI:   pyopencl, wgpu; the aarch64 apache-tvm / apache-tvm-ffi wheels (runtime libraries for qemu runs)
#   cache:  $PERFX_TARGETS_CACHE (default ~/.cache/perfx-targets): unpacked aarch64 runtime, ROCm path folder
set -u
CACHE="${PERFX_TARGETS_CACHE:-$HOME/.cache/perfx-targets}"
mkdir -p "$CACHE"
SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO="sudo"; fi

DEB_PKGS=(g++-aarch64-linux-gnu g++-riscv64-linux-gnu qemu-user pocl-opencl-icd ocl-icd-libopencl1
          ocl-icd-opencl-dev clinfo mesa-vulkan-drivers libvulkan1 lld-19 rocm-device-libs)
missing=()
for p in "${DEB_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup_targets: installing ${missing[*]}"
  if command -v apt-get >/dev/null; then
    $SUDO apt-get update -qq || echo "setup_targets: apt-get update failed"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" \
      || echo "setup_targets: apt-get install failed for some of: ${missing[*]}"
  else
    echo "setup_targets: no apt-get; cannot install ${missing[*]}"
  fi
fi

PY="${PYTHON:-python}"
for mod in pyopencl wgpu; do
  if ! "$PY" -c "import $mod" 2>/dev/null; then
    echo "setup_targets: pip install $mod"
    "$PY" -m pip install -q "$mod" || echo "setup_targets: pip install $mod failed"
  fi
done

# aarch64 TVM runtime: libtvm_runtime.so + libtvm_ffi.so from PyPI's manylinux aarch64 wheels, and a
# python-free layout under $CACHE/aarch64-runtime/lib.
AR="$CACHE/aarch64-runtime"
if [ ! -f "$AR/lib/libtvm_runtime.so" ] || [ ! -f "$AR/lib/libtvm_ffi.so" ]; then
  TVM_VER=$("$PY" -c "import importlib.metadata as m; print(m.version('apache-tvm'))" 2>/dev/null || echo 0.27.0.post1)
  FFI_VER=$("$PY" -c "import importlib.metadata as m; print(m.version('apache-tvm-ffi'))" 2>/dev/null || echo 0.1.14.post1)
  mkdir -p "$AR/wheels" "$AR/lib" "$AR/include"
  echo "setup_targets: downloading aarch64 wheels apache-tvm==$TVM_VER apache-tvm-ffi==$FFI_VER"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_aarch64 \
      --python-version 3.11 -d "$AR/wheels" "apache-tvm==$TVM_VER" "apache-tvm-ffi==$FFI_VER" \
    || echo "setup_targets: aarch64 wheel download failed"
  "$PY" - "$AR" <<'PYEOF'
import sys, zipfile, pathlib, shutil
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
print("setup_targets: aarch64 runtime libs:", sorted(p.name for p in (root / "lib").iterdir()))
PYEOF
fi

# ROCm: TVM wants $ROCM_PATH/amdgcn/bitcode and an ld.lld that understands LLVM 22's objects (lld-19).
RP="$CACHE/rocm"
if [ -d /usr/lib/x86_64-linux-gnu/amdgcn/bitcode ] && command -v ld.lld-19 >/dev/null; then
  mkdir -p "$RP/amdgcn" "$RP/bin"
  ln -sfn /usr/lib/x86_64-linux-gnu/amdgcn/bitcode "$RP/amdgcn/bitcode"
  ln -sfn "$(command -v ld.lld-19)" "$RP/bin/ld.lld"
fi
echo "setup_targets: done (cache $CACHE)"
