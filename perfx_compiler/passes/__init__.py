"""Graph passes (phase 1): one pass per file, run in ``ORDER``.

A pass module defines ``NAME``, ``ORDER`` (int), ``DEFAULT`` (bool: in the
default list) and ``apply(mod, weights, ctx) -> (mod, weights)``. ``weights``
maps each weight parameter's name (the Relax parameter name) to its numpy
array, in parameter order; a pass that changes the parameters (merging Q/K/V,
packing int4) changes both the functions' signatures and this dict. Adding a
pass means adding a file.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import tvm

from perfx_compiler.errors import PerfXError


@dataclass
class PassContext:
    target: Any  # TargetDescription
    options: Any  # CompileOptions
    desc: Any = None  # ModelDescription (config, quantized GGUF blocks for passthrough)


def discover() -> list[ModuleType]:
    """Every pass module of this package, sorted by ORDER."""
    mods = []
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(mod, "apply") and hasattr(mod, "ORDER"):
            mods.append(mod)
    return sorted(mods, key=lambda m: m.ORDER)


def run_passes(
    mod: tvm.IRModule, weights: dict[str, Any], target: Any, options: Any, desc: Any = None
) -> tuple[tvm.IRModule, dict[str, Any]]:
    """Run the selected passes (``options.passes`` or every DEFAULT pass) in ORDER."""
    available = discover()
    names = {m.NAME: m for m in available}
    wanted = getattr(options, "passes", None)
    if wanted is None:
        selected = [m for m in available if m.DEFAULT]
    else:
        unknown = [n for n in wanted if n not in names]
        if unknown:
            raise PerfXError(f"unknown pass(es) {', '.join(unknown)}; available: {', '.join(names)}")
        selected = [m for m in available if m.NAME in wanted]
    ctx = PassContext(target=target, options=options, desc=desc)
    for m in selected:
        mod, weights = m.apply(mod, weights, ctx)
    return mod, weights
