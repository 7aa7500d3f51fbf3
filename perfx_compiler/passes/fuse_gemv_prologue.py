"""Residual add + RMSNorm, or SwiGLU, fused into the VNNI GEMV that reads its result (decode).

In a decode step the x of every projection but ``o`` is made by a small kernel: ``add_rms_norm``
before qkv and gate/up, ``swiglu`` before down. Each is a serial call on the launching thread, and
with the two threads on two cores its input is half on the other core (the GEMV before it wrote
its rows there) and its output is read back by the other core's GEMV task. This pass replaces
``kernel -> GEMV`` by one GEMV whose x is made inside the call, group by group as it is quantized
(``schedules/_vnni_kernels.gemv``'s ``prologue``; by every row task with ``tquant``): one launch
fewer, and x is never stored. ``add_rms_norm`` still returns ``a + b`` (the next residual).

SwiGLU goes the other way where it can: into the gate|up GEMV that makes its input (``epilogue``):
each task takes the same range of gate and of up rows and writes their ``silu(gate) * up`` from its
own y rows, so the down GEMV reads h (half of gate|up's size) and only quantizes it; without it,
both of down's tasks computed swiglu over all of gate|up, half of which the other core wrote. A
gate|up GEMV whose halves are not whole row units keeps swiglu as down's prologue.

Only where the GEMV is the VNNI one of one activation row (decode on an AVX-512 VNNI CPU; codes of any
width: GGUF Q4_0/Q4_1/Q8_0, the K-quants, Q5_0/Q5_1, IQ4) and is the only reader of the small kernel's output;
everything else is left as is. Measurements: docs/decisions/quantized-linears.md.
"""

from __future__ import annotations

from typing import Any

import tvm
from tvm import relax

from perfx_compiler.formats import QUANT_ATTR
from perfx_compiler.formats.vnni import ROWS_PER_UNIT, vnni_compute
from perfx_compiler.passes._relax_util import (
    FUSED_OP_ATTR,
    SKIP,
    FuncInfo,
    call_tir_callee,
    exported,
    json_attr,
    rewrite_functions,
    swiglu_reader,
)

NAME = "fuse_gemv_prologue"


def _one_row_gemv(func: Any) -> dict[str, Any] | None:
    """The ``perfx.quant`` facts of a VNNI GEMV (codes of any width) with x of shape [1, 1, K], else None."""
    info = json_attr(func, QUANT_ATTR)
    if not info or info.get("layout") != "vnni" or info.get("kind") != "matmul" or info.get("bits") not in ROWS_PER_UNIT:
        return None
    if info.get("prologue") or int(info["K"]) % 16:
        return None
    shape = [getattr(d, "value", None) for d in func.params[0].shape]
    return info if shape == [1, 1, int(info["K"])] else None


def _tensor(var: Any) -> Any:
    return relax.TensorType(var.ty.shape, var.ty.dtype)


def _only_reader(info: FuncInfo, var: Any, reader: Any) -> bool:
    return info.uses.get(var, 0) == 1 and info.users(var) == [reader] and not info.used_outside(var)


def _gemvs(mod: tvm.IRModule, info: FuncInfo) -> dict[Any, tuple[str, dict[str, Any]]]:
    """var -> (callee name, quant facts) of the function's one-row VNNI GEMVs over weight codes."""
    out = {}
    for var, value in info.values.items():
        gemv = call_tir_callee(mod, value)
        q = _one_row_gemv(gemv[1]) if gemv else None
        # codes computed in the function (not weights) are left alone: the fused call may move before them
        if q is not None and not any(c in info.values for c in value.args[1].fields[1:]):
            out[var] = (gemv[0], q)
    return out


def apply(mod: tvm.IRModule, weights: dict[str, Any], ctx: Any) -> tuple[tvm.IRModule, dict[str, Any]]:
    kernels: dict[str, Any] = {}
    matches: dict[str, list[dict[str, Any]]] = {}
    for fn in exported(mod):
        info = FuncInfo.of(mod[fn])
        gemvs = _gemvs(mod, info)
        # swiglu of a GEMV's y, its only reader: fused after that GEMV (epilogue), not before down
        tails = {}
        for var, (_, q) in gemvs.items():
            # y splits into gate and up halves of whole row units (int4: row pairs, 5-bit: octets, ...)
            if int(q["N"]) % (2 * ROWS_PER_UNIT[int(q["bits"])]) == 0:
                if (h := swiglu_reader(mod, info, var)) is not None:
                    tails[var] = {"out": h}
        taken = {t["out"] for t in tails.values()}
        found = []
        for var, (callee, q) in gemvs.items():
            x = info.values[var].args[1].fields[0]
            m = _match_add_norm(mod, info, x, var)
            if m is None and x not in taken:
                m = _match_swiglu(mod, info, x, var)
            tail = tails.get(var)
            if m is None and tail is None:
                continue
            if tail is not None and m is not None and m["op"] == "swiglu":
                continue  # swiglu on both sides of one GEMV: no LLM has it, left unfused
            m = m or {"op": "", "eps": 0.0, "skip": []}
            name = "_".join(p for p in (m["op"], callee, "swiglu" if tail else "") if p)
            if name not in kernels:
                kernels[name] = vnni_compute(int(q["N"]), int(q["K"]), int(q["group"]), int(q["bits"]), bool(q["sym"]),
                                             bool(q["offset"]), "matmul", (1, 1), prologue=m["op"], eps=m["eps"],
                                             epilogue="swiglu" if tail else "", sb=int(q.get("sb", 0)),
                                             lut=str(q.get("lut", "")))
            found.append({**m, "gemv": var, "name": name, "tail": tail})
        matches[fn] = found
    if not kernels:
        return mod, weights

    def plan_for(fn: str, func: relax.Function, info: FuncInfo, gvars: dict[str, Any]) -> dict[Any, Any]:
        plan: dict[Any, Any] = {}
        for m in matches[fn]:
            gv, call = gvars[m["name"]], info.values[m["gemv"]]
            codes = list(call.args[1].fields[1:])
            for v in m["skip"]:
                plan[v] = SKIP
            tail = m["tail"]
            if tail is not None:
                plan[tail["out"]] = SKIP
            if m["op"] == "swiglu":

                def swiglu(rw: Any, binding: Any, m=m, gv=gv, codes=codes) -> None:
                    args = [rw.arg(m["inputs"][0]), *(rw.arg(c) for c in codes)]
                    rw.remap(binding.var, rw.emit(relax.call_tir(gv, args, _tensor(binding.var)), binding.var))

                plan[m["gemv"]] = swiglu
                continue

            def fused(rw: Any, binding: Any, m=m, gv=gv, codes=codes, tail=tail, x=call.args[1].fields[0]) -> None:
                # the fused call (at the norm's place with a prologue): the norm's sum, the GEMV's y and
                # the epilogue's h for the vars they replace
                outs = ([m["sum"]] if m["op"] else []) + [m["gemv"]] + ([tail["out"]] if tail else [])
                args = [*(rw.arg(a) for a in (m["inputs"] if m["op"] else [x])), *(rw.arg(c) for c in codes)]
                out = rw.emit(relax.call_tir(gv, args, [_tensor(v) for v in outs]))
                for i, v in enumerate(outs):
                    rw.remap(v, rw.emit(relax.TupleGetItem(out, i), v))

            if m["op"] == "add_rms_norm":
                plan[m["gemv"]] = SKIP
                plan[m["norm"]] = fused
            else:
                plan[m["gemv"]] = fused
        return plan

    mod, _ = rewrite_functions(mod, plan_for, kernels)
    return mod, weights


def _match_add_norm(mod: tvm.IRModule, info: FuncInfo, x: Any, gemv: Any) -> dict[str, Any] | None:
    """``t = add_rms_norm(a, b, w); s = t[0]; x = t[1]`` with x read only by the GEMV and t only by s and x."""
    get = info.value(x)
    if not isinstance(get, relax.TupleGetItem) or get.index != 1 or not _only_reader(info, x, gemv):
        return None
    norm = get.tuple_value
    callee = call_tir_callee(mod, info.value(norm))
    op = json_attr(callee[1], FUSED_OP_ATTR) if callee else None
    if not op or op.get("op") != "add_rms_norm":
        return None
    readers = info.users(norm)
    sums = [r for r in readers if isinstance(info.value(r), relax.TupleGetItem) and info.value(r).index == 0]
    if info.uses.get(norm, 0) != 2 or len(sums) != 1 or set(readers) != {sums[0], x} or info.used_outside(norm):
        return None
    return {"op": "add_rms_norm", "eps": float(op["eps"]), "inputs": list(info.value(norm).args[1].fields),
            "norm": norm, "sum": sums[0], "skip": [x, sums[0]]}


def _match_swiglu(mod: tvm.IRModule, info: FuncInfo, x: Any, gemv: Any) -> dict[str, Any] | None:
    """``x = swiglu(gate_up)`` read only by the GEMV."""
    callee = call_tir_callee(mod, info.value(x))
    op = json_attr(callee[1], FUSED_OP_ATTR) if callee else None
    if not op or op.get("op") != "swiglu" or not _only_reader(info, x, gemv):
        return None
    return {"op": "swiglu", "eps": 0.0, "inputs": list(info.value(x).args[1].fields), "skip": [x]}
