"""Cross toolchains used by the target checks: locating qemu-user, cross compilers and the aarch64 TVM
runtime (the ptxas and AMDGPU statistics parsers live with the exporter, device_export.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

CACHE = Path(os.environ.get("PERFX_TARGETS_CACHE", Path.home() / ".cache" / "perfx-targets"))


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
