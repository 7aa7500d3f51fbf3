"""SwiGLU fused into the VNNI GEMM that makes its input (prefill chunks, batched decode).

``gate_up = GEMM(x); h = swiglu(gate_up)`` becomes one call returning h (``schedules/gemm_qvnni_cpu``'s
``epilogue="swiglu"``): each task takes a block of gate columns into a scratch tile, then the up block
of the same columns, and writes ``silu(gate) * up``. gate|up's output, twice h's size, is never
stored: for TinyLlama's FFN a 512-token prefill call held 22 MiB for it (issue #26: peak RSS over an
8k prefill against weights + KV cache), and one elementwise pass over it is gone.

Only for the VNNI GEMM (symbolic rows, or static rows above the GEMV's 8; an AVX-512 VNNI CPU with
int8 activations) whose output's only reader is swiglu, with gate and up halves of whole 16-column tiles;
the one-row decode GEMV takes swiglu in ``fuse_gemv_prologue``, which runs first.
"""

from __future__ import annotations

from typing import Any

import tvm
from tvm import relax

from perfx_compiler.formats import GEMV_MAX_ROWS, QUANT_ATTR
from perfx_compiler.formats.vnni import vnni_compute
from perfx_compiler.passes._relax_util import (
    SKIP,
    FuncInfo,
    call_tir_callee,
    exported,
    json_attr,
    rewrite_functions,
    swiglu_reader,
)

NAME = "fuse_gemm_swiglu"


def _gemm_rows(func: Any) -> tuple[int | None, int | None] | None:
    """The (batch, rows) of a plain VNNI matmul that the GEMM template runs (not the GEMV), else None."""
    info = json_attr(func, QUANT_ATTR)
    if not info or info.get("layout") != "vnni" or info.get("kind") != "matmul":
        return None
    if info.get("prologue") or info.get("epilogue") or int(info["N"]) % 32:
        return None
    rows = tuple(getattr(d, "value", None) for d in list(func.params[0].shape)[:2])
    if None not in rows and rows[0] * rows[1] <= GEMV_MAX_ROWS:
        return None
    return rows


def apply(mod: tvm.IRModule, weights: dict[str, Any], ctx: Any) -> tuple[tvm.IRModule, dict[str, Any]]:
    kernels: dict[str, Any] = {}
    matches: dict[str, list[tuple[Any, Any, str]]] = {}  # fn -> (GEMM var, swiglu var, fused kernel name)
    for fn in exported(mod):
        info = FuncInfo.of(mod[fn])
        found = []
        for var, value in info.values.items():
            callee = call_tir_callee(mod, value)
            rows = _gemm_rows(callee[1]) if callee else None
            h = swiglu_reader(mod, info, var) if rows is not None else None
            if h is None:
                continue
            q = json_attr(callee[1], QUANT_ATTR)
            name = f"{callee[0]}_swiglu"
            if name not in kernels:
                kernels[name] = vnni_compute(int(q["N"]), int(q["K"]), int(q["group"]), int(q["bits"]), bool(q["sym"]),
                                             bool(q["offset"]), "matmul", rows, epilogue="swiglu",
                                             sb=int(q.get("sb", 0)), lut=str(q.get("lut", "")))
            found.append((var, h, name))
        matches[fn] = found
    if not kernels:
        return mod, weights

    def plan_for(fn: str, func: relax.Function, info: FuncInfo, gvars: dict[str, Any]) -> dict[Any, Any]:
        plan: dict[Any, Any] = {}
        for gemm, h, name in matches[fn]:
            plan[gemm] = SKIP

            def fused(rw: Any, binding: Any, gv=gvars[name], args=tuple(info.values[gemm].args[1].fields)) -> None:
                # at swiglu's place: the GEMM's own inputs (x and the weight arrays) are all defined before it
                out = relax.call_tir(gv, [rw.arg(a) for a in args], relax.TensorType(binding.var.ty.shape,
                                                                                     binding.var.ty.dtype))
                rw.remap(binding.var, rw.emit(out, binding.var))

            plan[h] = fused
        return plan

    mod, _ = rewrite_functions(mod, plan_for, kernels)
    return mod, weights
