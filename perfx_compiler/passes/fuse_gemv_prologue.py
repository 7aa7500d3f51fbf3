"""Residual add + RMSNorm, or SwiGLU, fused into the VNNI GEMV that reads its result (decode).

In a decode step the x of every projection but ``o`` is made by a small kernel: ``add_rms_norm``
before qkv and gate/up, ``swiglu`` before down. Each is a serial call on the launching thread, and
with the two threads on two cores its input is half on the other core (the GEMV before it wrote
its rows there) and its output is read back by the other core's GEMV task. This pass replaces
``kernel -> GEMV`` by one GEMV whose x is made inside the call, group by group as it is quantized
(``schedules/_vnni_kernels.gemv``'s ``prologue``; by every row task with ``tquant``): one launch
fewer, and x is never stored. ``add_rms_norm`` still returns ``a + b`` (the next residual).

Only where the GEMV is the VNNI one of one activation row (decode on an AVX-512 VNNI CPU; int4 or
int8 codes, e.g. GGUF Q4_0/Q4_1/Q8_0) and is the only reader of the small kernel's output;
everything else is left as is.
Whole decode step replayed in alternation: TinyLlama x1.004 on two cores (the other core's half of the
previous GEMV's output is still read, now inside the tasks), SmolLM2 x1.015
(benchmarks/results/decode_step_ab_tinyllama-q4_0_gemv_prologue.csv, ..._smollm2-q4_1_gemv_prologue.csv).
"""

from __future__ import annotations

import json
from typing import Any

import tvm
from tvm import relax

from perfx_compiler.passes._quant_attr import QUANT_ATTR
from perfx_compiler.passes._qvnni import vnni_compute
from perfx_compiler.passes._relax_util import FUSED_OP_ATTR, SKIP, FuncInfo, exported, rewrite_functions

NAME = "fuse_gemv_prologue"
ORDER = 70  # after the weight formats (which emit the VNNI GEMVs), before weight_layout
DEFAULT = True


def _callee(mod: tvm.IRModule, value: Any) -> tuple[str, Any] | None:
    """(name, PrimFunc) of a ``call_tir`` binding's callee."""
    if not isinstance(value, relax.Call) or getattr(value.op, "name", "") != "relax.call_tir":
        return None
    gv = value.args[0]
    func = mod[gv] if isinstance(gv, relax.GlobalVar) and gv in mod.functions else None
    return (gv.name_hint, func) if isinstance(func, tvm.tirx.PrimFunc) else None


def _attr(func: Any, key: str) -> dict[str, Any] | None:
    if func.attrs is None or key not in func.attrs:
        return None
    return json.loads(str(func.attrs[key]))


def _one_row_gemv(func: Any) -> dict[str, Any] | None:
    """The ``perfx.quant`` facts of a VNNI GEMV (int4 or int8 codes) with x of shape [1, 1, K], else None."""
    info = _attr(func, QUANT_ATTR)
    if not info or info.get("layout") != "vnni" or info.get("kind") != "matmul" or info.get("bits") not in (4, 8):
        return None
    if info.get("prologue") or int(info["K"]) % 16:
        return None
    shape = [getattr(d, "value", None) for d in func.params[0].shape]
    return info if shape == [1, 1, int(info["K"])] else None


def _tensor(var: Any) -> Any:
    return relax.TensorType(var.ty.shape, var.ty.dtype)


def _only_reader(info: FuncInfo, var: Any, reader: Any) -> bool:
    return info.uses.get(var, 0) == 1 and info.users(var) == [reader] and not info.used_outside(var)


def apply(mod: tvm.IRModule, weights: dict[str, Any], ctx: Any) -> tuple[tvm.IRModule, dict[str, Any]]:
    kernels: dict[str, Any] = {}
    matches: dict[str, list[dict[str, Any]]] = {}
    for fn in exported(mod):
        info = FuncInfo.of(mod[fn])
        found = []
        for var, value in info.values.items():
            gemv = _callee(mod, value)
            q = _one_row_gemv(gemv[1]) if gemv else None
            if q is None:
                continue
            x = value.args[1].fields[0]
            if any(c in info.values for c in value.args[1].fields[1:]):
                continue  # codes computed in the function (not weights): the fused call may move before them
            m = _match_add_norm(mod, info, x, var) or _match_swiglu(mod, info, x, var)
            if m is None:
                continue
            name = f"{m['op']}_{gemv[0]}"
            if name not in kernels:
                kernels[name] = vnni_compute(int(q["N"]), int(q["K"]), int(q["group"]), int(q["bits"]), bool(q["sym"]),
                                             bool(q["offset"]), "matmul", (1, 1), prologue=m["op"], eps=m["eps"])
            found.append({**m, "gemv": var, "name": name})
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
            if m["op"] == "swiglu":

                def swiglu(rw: Any, binding: Any, m=m, gv=gv, codes=codes) -> None:
                    args = [rw.arg(m["inputs"][0]), *(rw.arg(c) for c in codes)]
                    rw.remap(binding.var, rw.emit(relax.call_tir(gv, args, _tensor(binding.var)), binding.var))

                plan[m["gemv"]] = swiglu
            else:
                plan[m["gemv"]] = SKIP

                def add_norm(rw: Any, binding: Any, m=m, gv=gv, codes=codes) -> None:
                    # at the norm's place: the fused call, its sum for the norm's first output, its y for the GEMV's
                    args = [*(rw.arg(a) for a in m["inputs"]), *(rw.arg(c) for c in codes)]
                    out = rw.emit(relax.call_tir(gv, args, [_tensor(m["sum"]), _tensor(m["gemv"])]))
                    rw.remap(m["sum"], rw.emit(relax.TupleGetItem(out, 0), m["sum"]))
                    rw.remap(m["gemv"], rw.emit(relax.TupleGetItem(out, 1), m["gemv"]))

                plan[m["norm"]] = add_norm
        return plan

    mod, _ = rewrite_functions(mod, plan_for, kernels)
    return mod, weights


def _match_add_norm(mod: tvm.IRModule, info: FuncInfo, x: Any, gemv: Any) -> dict[str, Any] | None:
    """``t = add_rms_norm(a, b, w); s = t[0]; x = t[1]`` with x read only by the GEMV and t only by s and x."""
    get = info.value(x)
    if not isinstance(get, relax.TupleGetItem) or get.index != 1 or not _only_reader(info, x, gemv):
        return None
    norm = get.tuple_value
    callee = _callee(mod, info.value(norm))
    op = _attr(callee[1], FUSED_OP_ATTR) if callee else None
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
    callee = _callee(mod, info.value(x))
    op = _attr(callee[1], FUSED_OP_ATTR) if callee else None
    if not op or op.get("op") != "swiglu" or not _only_reader(info, x, gemv):
        return None
    return {"op": "swiglu", "eps": 0.0, "inputs": list(info.value(x).args[1].fields), "skip": [x]}
