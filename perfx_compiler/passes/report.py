"""Kernel-launch counts per exported function (what ``--report`` prints before/after fusion).

Not a pass (no ``apply``): a helper over any phase's module. After phase 2 every kernel launch is
a ``call_tir``/``call_tir_inplace``; before lowering, each remaining Relax operator call becomes
at least one kernel, so it is counted as one too.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import tvm
from tvm import relax

from perfx_compiler.passes._relax_util import exported

# Operators that never launch a kernel (shape/tuple plumbing, in-place views).
_FREE_OPS = {"relax.shape_of", "relax.shape_to_tensor", "relax.reshape", "relax.null_value"}
_TIR_CALLS = {"relax.call_tir", "relax.call_tir_inplace", "relax.call_dps_packed"}


def _calls(func: relax.Function) -> list[str]:
    """Names of the kernels a function launches, in binding order."""
    out: list[str] = []
    for block in func.body.blocks:
        for b in block.bindings:
            v = b.value
            if not isinstance(v, relax.Call) or not isinstance(v.op, tvm.ir.Op):
                continue
            name = str(v.op.name)
            if name in _TIR_CALLS:
                callee = v.args[0]
                out.append(getattr(callee, "name_hint", str(callee)))
            elif name not in _FREE_OPS:
                out.append(name)
    return out


def kernel_counts(mod: tvm.IRModule) -> dict[str, int]:
    """Kernel launches per call of each exported function (``decode``: per generated token)."""
    return {fn: len(_calls(mod[fn])) for fn in exported(mod)}


def kernel_breakdown(mod: tvm.IRModule, fn: str = "decode") -> dict[str, int]:
    """Launch count per kernel (callee name or operator) of one function."""
    return dict(Counter(_calls(mod[fn])))


def matmul_count(mod: tvm.IRModule, fn: str = "decode") -> int:
    """Linear layers (float or quantized) one call of ``fn`` runs."""
    n = 0
    for name in _calls(mod[fn]):
        if "matmul" in name.lower() or name.startswith("q4_") or name.startswith("q8_"):
            n += 1
    return n


def summary(mod: tvm.IRModule) -> dict[str, Any]:
    """Everything above for ``decode``, as one JSON-friendly dict."""
    return {"kernels": kernel_counts(mod), "decode_matmuls": matmul_count(mod), "decode": kernel_breakdown(mod)}
