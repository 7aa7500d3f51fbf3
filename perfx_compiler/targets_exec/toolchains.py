"""Cross toolchains used by the target checks: nvcc/ptxas statistics, AMDGPU assembly statistics,
and locating qemu-user, cross compilers and the aarch64 TVM runtime."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

CACHE = Path(os.environ.get("PERFX_TARGETS_CACHE", Path.home() / ".cache" / "perfx-targets"))


def parse_ptxas(log: str) -> dict[str, dict[str, Any]]:
    """ptxas -v output -> {kernel: {registers, spill_stores, spill_loads, shared_bytes, stack_bytes}}."""
    out: dict[str, dict[str, Any]] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line) or re.search(r"Function properties for (\S+)", line)
        if m:
            current = m.group(1)
            out.setdefault(
                current, {"registers": 0, "spill_stores": 0, "spill_loads": 0, "shared_bytes": 0, "stack_bytes": 0}
            )
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            out[current].update(stack_bytes=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            out[current]["registers"] = int(m.group(1))
        m = re.search(r"(\d+) bytes smem", line)
        if m:
            out[current]["shared_bytes"] = int(m.group(1))
    return out


def parse_amdgpu_asm(asm: str) -> dict[str, dict[str, int]]:
    """AMDGPU assembly -> {kernel: {vgpr, sgpr, spill_vgpr, spill_sgpr, lds_bytes}} from the .amdhsa metadata."""
    out: dict[str, dict[str, int]] = {}
    for m in re.finditer(r"\.amdhsa_kernel (\S+)(.*?)\.end_amdhsa_kernel", asm, re.S):
        body = m.group(2)

        def field(name: str, body: str = body) -> int:
            f = re.search(rf"\.amdhsa_{name}\s+(\d+)", body)
            return int(f.group(1)) if f else 0

        out[m.group(1)] = {
            "vgpr": field("next_free_vgpr"),
            "sgpr": field("next_free_sgpr"),
            "lds_bytes": field("group_segment_fixed_size"),
            "scratch_bytes": field("private_segment_fixed_size"),
        }
    for name, stats in out.items():
        sp = re.search(rf"{re.escape(name)}.*?; ScratchSize: (\d+)", asm, re.S)
        if sp:
            stats["scratch_bytes"] = max(stats["scratch_bytes"], int(sp.group(1)))
    return out


def which(*names: str) -> str | None:
    for n in names:
        p = shutil.which(n)
        if p:
            return p
    return None


def aarch64_runtime_dir() -> Path | None:
    """Folder holding the aarch64 libtvm_runtime.so + libtvm_ffi.so (tests/setup.sh unpacks them)."""
    d = CACHE / "aarch64-runtime" / "lib"
    if (d / "libtvm_runtime.so").exists() and (d / "libtvm_ffi.so").exists():
        return d
    return None
