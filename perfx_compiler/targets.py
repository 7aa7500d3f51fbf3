"""Target descriptions: one JSON file per target in ``targets/``.

Adding a target means adding a file; nothing here lists targets by name.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from perfx_compiler.errors import PerfXError, UnknownTargetError

TARGETS_DIR = Path(__file__).resolve().parent.parent / "targets"


def targets_dir() -> Path:
    """Where target files live: the repo's targets/, or the installed copy (a target file elsewhere
    is named by its path: ``load_target("my/target.json")``)."""
    if TARGETS_DIR.is_dir():
        return TARGETS_DIR
    return Path(__file__).resolve().parent / "data" / "targets"


@dataclass
class TargetDescription:
    name: str
    description: str
    tvm_target: dict[str, Any]
    family: str  # "cpu" | "gpu"
    host: dict[str, Any] | None = None  # TVM target dict of the host (cross targets)
    host_triple: str = "x86_64-linux-gnu"
    cross_compiler: str | None = None  # e.g. "aarch64-linux-gnu-g++"
    vector_bits: int = 0
    cores: int = 0
    warp_size: int = 0
    max_threads_per_block: int = 0
    max_shared_memory_bytes: int = 0
    memory_bandwidth_gbs: float = 0.0
    peak_gflops_fp32: float = 0.0
    templates: dict[str, dict[str, Any]] = field(default_factory=dict)  # template name -> defaults
    runnable_here: bool = False
    # perfx-compile --knob (knobs.py): template name -> config values that win over every default and record
    knobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)

    def tvm(self):  # -> tvm.target.Target
        import tvm

        if self.host is not None:
            return tvm.target.Target(self.tvm_target, host=self.host)
        return tvm.target.Target(self.tvm_target)


def list_targets() -> list[str]:
    return sorted(p.stem for p in targets_dir().glob("*.json"))


def cpuinfo(field: str) -> str:
    """The first ``field`` ("flags", "vendor_id", "model name", ...) of /proc/cpuinfo, or "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith(field)), "")
    except OSError:
        return ""
    return line.partition(":")[2].strip()


def cpu_flags() -> set[str]:
    """This CPU's feature flags (avx512f, avx512_vnni, amx_int8, ...); empty where /proc/cpuinfo has none."""
    return set(cpuinfo("flags").split())


def _detect_host() -> str:
    """Pick the x86 target file matching this CPU's vector extensions."""
    flags = cpu_flags()
    if {"avx512f", "avx512bw"} <= flags:
        return "x86-avx512"
    if "avx2" in flags:
        return "x86-avx2"
    import platform

    if platform.machine() in ("aarch64", "arm64"):
        return "arm64-neon"
    return "x86-generic" if (targets_dir() / "x86-generic.json").exists() else "x86-avx2"


def _cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD, ...), or "" where there is none."""
    return cpuinfo("vendor_id")


def _with_vendor(data: dict[str, Any], vendor: str) -> dict[str, Any]:
    """The host's target data with the file's ``vendor_templates[vendor]`` template defaults merged in."""
    extra = (data.get("vendor_templates") or {}).get(vendor) or {}
    templates = {name: dict(knobs) for name, knobs in (data.get("templates") or {}).items()}
    for name, knobs in extra.items():
        templates[name] = {**templates.get(name, {}), **knobs}
    return {**data, "cpu_vendor": vendor, "templates": templates}


def load_target(name: str) -> TargetDescription:
    """Load ``targets/<name>.json``, or the target file ``name`` when it is a path ending in ``.json``;
    ``host`` resolves to the file matching this machine."""
    resolved = _detect_host() if name == "host" else name
    path = targets_dir() / f"{resolved}.json"
    if name.endswith(".json"):
        path = Path(name).expanduser()
        resolved = path.stem
    if not path.exists():
        known = ", ".join(["host", *list_targets()])
        raise UnknownTargetError(f"unknown target '{name}'; known targets: {known}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise PerfXError(f"target file {path} is not valid JSON ({err}); fix or remove it") from None
    if name == "host":
        data = {**data, "detected_as": resolved}
        cores = os.cpu_count() or 1
        data.setdefault("tvm_target", {})["num-cores"] = cores
        data["cores"] = cores
        data = _with_vendor(data, _cpu_vendor())
    known_fields = TargetDescription.__dataclass_fields__
    kwargs = {k: v for k, v in data.items() if k in known_fields and k != "raw"}
    kwargs.setdefault("name", resolved)
    return TargetDescription(**kwargs, raw=data)


def index_dtype_of(target: TargetDescription) -> str:
    """Element type of the graph's integer inputs (ids, past_len, positions, page_table) for ``target``:
    the target file's ``"index_dtype"`` ("int32" where the device has no 64-bit integers, e.g. WebGPU)."""
    dtype = str((target.raw or {}).get("index_dtype", "int64"))
    if dtype not in ("int64", "int32"):
        raise PerfXError(f"target {target.name}: index_dtype must be 'int64' or 'int32', not {dtype!r}")
    return dtype
