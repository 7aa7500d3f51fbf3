"""Lowered model modules and host (x86 LLVM) reference runs of their PrimFuncs, for kernel checks."""

from __future__ import annotations

from typing import Any

import numpy as np


def lowered_module(
    model: Any, target: str, max_context: int = 64, schedule: bool = True, passes: list[str] | None = None,
    quantization: str = "auto",
) -> tuple[Any, Any]:
    """(state, {name: PrimFunc}) after phase 2 (lower) and, with ``schedule``, phase 3 for ``target``
    (``quantization``: as ``perfx-compile --quantization``).

    ``model`` is anything ``compile_model`` takes (a name, a GGUF path, a ModelDescription).
    """
    import tvm

    from perfx_compiler import pipeline as P
    from perfx_compiler.model.description import ModelDescription
    from perfx_compiler.targets import load_target

    if isinstance(model, ModelDescription):
        desc = model
    else:
        from perfx_compiler.model.loader import load_model

        desc = load_model(model, max_context=max_context)
    opts = P.CompileOptions(target=target, progress=False, passes=passes, quantization=quantization)
    state = P.CompileState(desc=desc, target=load_target(target), options=opts)
    phases = dict(P.PHASES)
    for name in ("import", "passes", "lower") + (("schedule",) if schedule else ()):
        phases[name](state)
    funcs = {gv.name_hint: f for gv, f in state.mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}
    return state, funcs


def host_reference(func: Any, arrays: list[Any]) -> list[Any]:
    """Run an unscheduled (or CPU-scheduled) PrimFunc with LLVM on this machine; return every argument after."""
    import tvm

    f = func.with_attr("global_symbol", "main")
    if f.attrs is not None and "tirx.is_scheduled" in f.attrs:
        f = f.without_attr("tirx.is_scheduled")
    lib = tvm.compile(tvm.IRModule({"main": f}), target=tvm.target.Target({"kind": "llvm"}))
    dev = tvm.cpu()
    vals = [tvm.runtime.tensor(a, dev) if isinstance(a, np.ndarray) else a for a in arrays]
    lib["main"](*vals)
    return [v.numpy() if hasattr(v, "numpy") else v for v in vals]
