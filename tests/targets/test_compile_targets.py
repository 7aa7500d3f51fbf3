"""Every target file compiles the tiny model into a bundle with its device code and DEPLOY.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from targets_common import MAX_CONTEXT

from perfx_compiler.targets import list_targets, load_target

pytestmark = pytest.mark.targets
GPU_FILES = {
    "opencl": ["kernels.cl"],
    "cuda": ["kernels.cu"],
    "rocm": ["kernels.{mcpu}.s", "kernels.{mcpu}.hsaco"],
    "webgpu": ["kernels.wgsl"],
}


@pytest.mark.parametrize("target", [t for t in list_targets() if not t.startswith("x86")])
def test_target_compiles(target: str, tiny_gguf: Path, tmp_path: Path) -> None:
    from perfx_compiler.pipeline import compile_model

    out = compile_model(str(tiny_gguf), target, tmp_path / target, progress=False, max_context=MAX_CONTEXT)
    t = load_target(target)
    files = {p.name for p in out.iterdir()}
    assert {"model.so", "weights.bin", "perfx-config.json", "DEPLOY.md"} <= files
    manifest = json.loads((out / "perfx-config.json").read_text())
    assert manifest["target"]["name"] == target
    assert manifest["index_dtype"] == t.raw.get("index_dtype", "int64")
    for pattern in GPU_FILES.get(t.tvm_target["kind"], []):
        assert pattern.format(mcpu=t.tvm_target.get("mcpu")) in files, files
    elf = (out / "model.so").read_bytes()[:20]
    machine = int.from_bytes(elf[18:20], "little")
    want = {"x86_64": 62, "aarch64": 183, "riscv64": 243}[t.host_triple.split("-")[0]]
    assert machine == want, f"model.so is for ELF machine {machine}, expected {want} ({t.host_triple})"


# adreno, mali, vulkan, arm64-neon and the host run the tiny Gemma 3 end to end (test_opencl_pocl.py,
# test_vulkan_wgpu.py, test_arm64_qemu.py); every other target file compiles it here
GEMMA3_COMPILE_ONLY = [t for t in list_targets() if t not in ("adreno", "mali", "vulkan", "arm64-neon", "x86-avx512")]


@pytest.mark.parametrize("target", GEMMA3_COMPILE_ONLY)
def test_target_compiles_gemma3(target: str, gemma3_folder: Path, tmp_path: Path) -> None:
    """A new family's features (sliding-window and QK-norm attention, GeGLU, sandwich norms) on every target."""
    from perfx_compiler.pipeline import compile_model

    out = compile_model(str(gemma3_folder), target, tmp_path / target, progress=False, max_context=MAX_CONTEXT)
    manifest = json.loads((out / "perfx-config.json").read_text())
    assert manifest["model"]["architecture"] == "gemma3" and manifest["model"]["sliding_layers"]
    assert (out / "model.so").is_file()
