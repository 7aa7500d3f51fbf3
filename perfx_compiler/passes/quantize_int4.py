"""Weight-only int4 group quantization of every linear layer (``CompileOptions.quantization``).

``q4_g128`` / ``q4_g64`` / ``q4_g32``: asymmetric (scale + zero point per group of G input
columns); ``q4_sym_g128`` (also g64/g32): symmetric. Each weight W [N, K] becomes three
parameters at its position in the weight table: ``<W>_q4`` (uint32 codes, interleaved layout of
``_quant.py``), ``<W>_q4_scale`` (fp16) and ``<W>_q4_zero`` (uint8). Each linear
``matmul(x, permute_dims(W)) [+ b]`` becomes one call of a dequantize+matmul PrimFunc (opaque to
FuseOps) that ``schedules/gemv_int4_cpu.py`` replaces by its GEMV kernel. Many-row linears
(prefill, M symbolic) become ``dequantize -> float matmul``: the GEMM template then runs at fp32
speed and the dequantized scratch is reused from layer to layer. A tied embedding is gathered straight from the packed table, so no
float copy of it remains.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import tvm
from tvm import relax

from perfx_compiler.errors import PerfXError
from perfx_compiler.passes._quant import (
    Int4Format,
    int4_matmul_compute,
    pack_int4,
    quantize_int4,
)
from perfx_compiler.passes._relax_util import (
    SKIP,
    FuncInfo,
    exported,
    find_linears,
    op_name,
    replace_weight_params,
    rewrite_functions,
)

NAME = "quantize_int4"
ORDER = 60  # after the merges (quantize the merged weights), before weight_layout
DEFAULT = True

KNOWN = ("f32",)
NOT_YET = ("q8", "gguf", "q4_awq_g128")  # planned schemes: refuse rather than silently compile f32
GEMV_MAX_ROWS = 8  # more rows than this (prefill): dequantize once, then the float GEMM
_Q4 = re.compile(r"^q4_(sym_)?g(32|64|128)$")


def parse(quantization: str) -> Int4Format | None:
    """The int4 format a quantization name asks for; None for non-int4 schemes; error if unknown."""
    m = _Q4.match(quantization)
    if m:
        return Int4Format(group=int(m.group(2)), symmetric=bool(m.group(1)))
    if quantization in KNOWN:
        return None
    if quantization in NOT_YET:
        raise PerfXError(f"quantization '{quantization}' is not implemented yet; use f32 or q4_g128/g64/g32 (or q4_sym_*)")
    raise PerfXError(
        f"unknown quantization '{quantization}'; use one of f32, q4_g128, q4_g64, q4_g32, "
        "q4_sym_g128, q4_sym_g64, q4_sym_g32"
    )


def _weight_uses(mod: tvm.IRModule, names: set[str]) -> dict[str, set[str]]:
    """For each weight name, the kinds of use it has across exported functions: linear, take, other."""
    uses: dict[str, set[str]] = {n: set() for n in names}
    for fn in exported(mod):
        info = FuncInfo.of(mod[fn])
        lin_perms = {lin.permute for lin in find_linears(info)}
        for var, value in info.values.items():
            args = list(value.args) if isinstance(value, relax.Call) else []
            for a in args:
                if isinstance(a, relax.Var) and a.name in names and a not in info.values:
                    if op_name(value) == "relax.permute_dims" and var in lin_perms:
                        uses[a.name].add("linear")
                    elif op_name(value) == "relax.take" and int(value.attrs.axis) == 0 and a.same_as(args[0]):
                        uses[a.name].add("take")
                    elif op_name(value) == "relax.shape_of":
                        uses[a.name].add("shape")  # the importer's negative-id wrap: a constant
                    else:
                        uses[a.name].add("other")
    return uses


def quantize_linears(
    mod: tvm.IRModule, weights: dict[str, Any], fmt: Int4Format, prepare: Any = None
) -> tuple[tvm.IRModule, dict[str, Any]]:
    """The pass body, reusable by AWQ (``prepare(name, W) -> W'`` adjusts a weight first)."""
    candidates = {n for n, a in weights.items() if np.asarray(a).ndim == 2}
    uses = _weight_uses(mod, candidates)
    quant = {n for n, u in uses.items() if "linear" in u}
    if not quant:
        return mod, weights
    new_weights: dict[str, Any] = {}
    shapes: dict[str, tuple[int, int, int]] = {}
    for name, arr in weights.items():
        if name not in quant:
            new_weights[name] = arr
            continue
        w = np.asarray(arr, dtype=np.float32)
        if prepare is not None:
            w = prepare(name, w)
        n, k = w.shape
        lanes = fmt.lanes(k)
        codes, scale, zero = quantize_int4(w, fmt)
        if "other" in uses[name]:
            new_weights[name] = arr  # still read as floats somewhere: keep both
        new_weights[f"{name}_q4"] = pack_int4(codes, lanes)
        new_weights[f"{name}_q4_scale"] = scale
        new_weights[f"{name}_q4_zero"] = zero
        shapes[name] = (n, k, lanes)
    mod, new_weights, params = replace_weight_params(mod, weights, new_weights)

    kernels: dict[str, Any] = {}

    def kernel(kind: str, name: str, lead: Any) -> str:
        n, k, lanes = shapes[name]
        if kind == "dequant":
            key = f"q4_dequant_{n}_{k}_g{fmt.group}{'s' if fmt.symmetric else ''}"
            kernels.setdefault(key, int4_matmul_compute(n, k, fmt.group, lanes, fmt.symmetric, kind="dequant"))
            return key
        if len(lead.ty.shape.values) != (3 if kind == "matmul" else 2):
            raise PerfXError(f"internal: int4 {kind} of {name} expects a rank-3 input, got {lead.ty}")
        rows = (relax_static_dim(lead, 0), relax_static_dim(lead, 1))
        tag = "x".join("n" if r is None else str(r) for r in rows)
        key = f"q4_{kind}_{n}_{k}_g{fmt.group}{'s' if fmt.symmetric else ''}_{tag}"
        if key not in kernels:
            kernels[key] = int4_matmul_compute(n, k, fmt.group, lanes, fmt.symmetric, kind=kind, rows=rows)
        return key

    plans: dict[str, list[tuple[str, Any, Any]]] = {}
    for fn in exported(mod):
        info = FuncInfo.of(mod[fn])
        todo: list[tuple[str, Any, Any]] = []
        for lin in find_linears(info):
            if lin.weight.name in quant:
                rows = [relax_static_dim(lin.x, 0), relax_static_dim(lin.x, 1)]
                if None not in rows and rows[0] * rows[1] <= GEMV_MAX_ROWS:
                    todo.append(("linear", lin, kernel("matmul", lin.weight.name, lin.x)))
                else:
                    todo.append(("dequant", lin, kernel("dequant", lin.weight.name, None)))
        for var, value in info.values.items():
            if op_name(value) == "relax.shape_of" and getattr(value.args[0], "name", None) in shapes:
                if value.args[0] not in info.values:
                    todo.append(("shape", var, shapes[value.args[0].name][:2]))
            if op_name(value) == "relax.take" and isinstance(value.args[0], relax.Var):
                wname = value.args[0].name
                if wname in quant and value.args[0] not in info.values and int(value.attrs.axis) == 0:
                    ids = value.args[1]
                    if len(ids.ty.shape.values) == 2 and "other" not in uses[wname]:
                        todo.append(("take", var, kernel("take", wname, ids)))
        plans[fn] = todo

    def plan_for(fn: str, func: relax.Function, info: FuncInfo, gvars: dict[str, Any]) -> dict[Any, Any]:
        plan: dict[Any, Any] = {}
        p = params[fn]
        for kind, item, key in plans[fn]:
            if kind == "linear":
                lin = item
                for v in lin.vars:
                    plan[v] = SKIP
                wn = lin.weight.name

                def linear(rw: Any, binding: Any, lin=lin, wn=wn, key=key) -> None:
                    x = rw.arg(lin.x)
                    ty = lin.matmul.ty
                    y = rw.emit(
                        relax.call_tir(
                            gvars[key],
                            [x, p[f"{wn}_q4"], p[f"{wn}_q4_scale"], p[f"{wn}_q4_zero"]],
                            relax.TensorType(ty.shape, "float32"),
                        ),
                        None if lin.add is not None else lin.matmul,
                    )
                    if lin.add is not None:
                        y = rw.emit(relax.op.add(y, rw.arg(lin.bias)), lin.add)
                    rw.remap(lin.out, y)

                plan[min(lin.vars[1:], key=lambda v: info.order[v])] = linear
            elif kind == "dequant":
                lin = item
                for v in lin.vars:
                    plan[v] = SKIP
                wn = lin.weight.name

                def dequant(rw: Any, binding: Any, lin=lin, wn=wn, key=key) -> None:
                    n, k, _ = shapes[wn]
                    w = rw.emit(
                        relax.call_tir(
                            gvars[key], [p[f"{wn}_q4"], p[f"{wn}_q4_scale"], p[f"{wn}_q4_zero"]],
                            relax.TensorType([n, k], "float32"),
                        )
                    )
                    pt = rw.emit(relax.op.permute_dims(w, axes=[1, 0]))
                    y = rw.emit(relax.op.matmul(rw.arg(lin.x), pt), None if lin.add is not None else lin.matmul)
                    if lin.add is not None:
                        y = rw.emit(relax.op.add(y, rw.arg(lin.bias)), lin.add)
                    rw.remap(lin.out, y)

                plan[lin.matmul] = dequant
            elif kind == "shape":
                n, k = key

                def shape(rw: Any, binding: Any, n=n, k=k) -> None:
                    rw.remap(binding.var, rw.emit(relax.ShapeExpr([n, k]), binding.var))

                plan[item] = shape
            else:
                var = item

                def take(rw: Any, binding: Any, key=key) -> None:
                    wn = binding.value.args[0].name
                    ty = binding.var.ty
                    call = relax.call_tir(
                        gvars[key],
                        [p[f"{wn}_q4"], p[f"{wn}_q4_scale"], p[f"{wn}_q4_zero"], rw.arg(binding.value.args[1])],
                        relax.TensorType(ty.shape, "float32"),
                    )
                    rw.remap(binding.var, rw.emit(call, binding.var))

                plan[var] = take
        return plan

    mod, _ = rewrite_functions(mod, plan_for, kernels)
    return mod, new_weights


def relax_static_dim(expr: Any, axis: int) -> int | None:
    d = expr.ty.shape.values[axis]
    return int(d.value) if isinstance(d, tvm.tirx.IntImm) else None


def apply(mod: tvm.IRModule, weights: dict[str, Any], ctx: Any) -> tuple[tvm.IRModule, dict[str, Any]]:
    quantization = getattr(ctx.options, "quantization", "f32") or "f32"
    fmt = parse(quantization)
    if fmt is None:
        return mod, weights
    return quantize_linears(mod, weights, fmt)
