"""Run cross-compiled (aarch64) artifacts under qemu-user with the TVM runtime of PyPI's aarch64 wheels.

``native/vm_decode.cc`` is a small C++ program linked against ``libtvm_runtime.so`` +
``libtvm_ffi.so`` (aarch64, unpacked by tests/setup.sh); it loads ``model.so``,
creates the Relax VM and runs ``decode`` for a list of tokens, writing the logits. The plan file
tells it each argument after (input_ids, past_len): KV caches as zeros, weights read from
``weights.bin`` at their manifest offsets.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np

from perfx_compiler.targets_exec.toolchains import aarch64_runtime_dir

NATIVE = Path(__file__).resolve().parent / "native"
ARCHES = {"aarch64": ("aarch64-linux-gnu-g++", "qemu-aarch64", "/usr/aarch64-linux-gnu")}


def qemu_missing(arch: str = "aarch64") -> str | None:
    """None when the cross compiler, qemu-user and (aarch64) runtime libraries are present, else why not."""
    cxx, qemu, _ = ARCHES[arch]
    for tool in (cxx, qemu):
        if shutil.which(tool) is None:
            return f"{tool} not found; run tests/setup.sh"
    if aarch64_runtime_dir() is None:
        return "aarch64 TVM runtime libraries missing; run tests/setup.sh"
    return None


def build_vm_decode(work: Path) -> Path:
    """Cross-compile native/vm_decode.cc next to the aarch64 runtime libraries."""
    import tvm_ffi.libinfo

    libdir = aarch64_runtime_dir()
    assert libdir is not None
    exe = work / "vm_decode"
    cmd = [
        ARCHES["aarch64"][0], "-std=c++17", "-O1", f"-I{tvm_ffi.libinfo.find_include_path()}",
        str(NATIVE / "vm_decode.cc"), f"-L{libdir}", "-ltvm_ffi", "-ltvm_runtime", "-o", str(exe),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return exe


def write_plan(artifact: Path, plan: Path) -> None:
    manifest = json.loads((artifact / "perfx-config.json").read_text())
    kv = manifest["kv_cache"]
    lines = []
    for _ in range(kv["count"]):
        lines.append(f"f32 {len(kv['shape'])} {' '.join(map(str, kv['shape']))} - 0 0")
    for w in manifest["weights"]:
        dt = {"float32": "f32", "float16": "f16", "int64": "i64", "int32": "i32", "uint32": "u32", "int8": "i8",
              "uint8": "u8"}[w["dtype"]]
        shape = w["shape"]
        lines.append(
            f"{dt} {len(shape)} {' '.join(map(str, shape))} {artifact / 'weights.bin'} {w['offset']} {w['nbytes']}"
        )
    plan.write_text("\n".join(lines) + "\n")


def run_decode_qemu(artifact: Path, tokens: list[int], work: Path, timeout: int = 600) -> np.ndarray:
    """Logits [len(tokens), vocab] of ``decode`` run token by token under qemu-aarch64."""
    work.mkdir(parents=True, exist_ok=True)
    exe = build_vm_decode(work)
    plan = work / "plan.txt"
    write_plan(artifact, plan)
    out = work / "logits.bin"
    env = dict(os.environ, LD_LIBRARY_PATH=str(aarch64_runtime_dir()))
    cmd = ["qemu-aarch64", "-L", ARCHES["aarch64"][2], str(exe), str(artifact / "model.so"), str(plan), str(out)]
    proc = subprocess.run(cmd + [str(t) for t in tokens], capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"vm_decode under qemu-aarch64 failed ({proc.returncode}): {proc.stderr[-3000:]}")
    vocab = json.loads((artifact / "perfx-config.json").read_text())["model"]["vocab_size"]
    return np.fromfile(out, dtype=np.float32).reshape(len(tokens), vocab)
