"""Rewrite linears over quantized weights: the Relax surgery shared by every weight-only scheme
(own int4 ``quantize_int4``, ``q8``, GGUF passthrough, AWQ).

A scheme hands over, per weight W [N, K] read by a linear, a :class:`Packed`: the arrays that
replace W in the weight table (in kernel-argument order, named ``<W><suffix>``) and a factory of
reference PrimFuncs tagged ``perfx.quant`` (a schedule template swaps each for its kernel):

* ``matmul`` (static rows <= GEMV_MAX_ROWS, decode; on CPU also ``paged_decode``'s symbolic batch
  of single rows, see ``use_batch_gemv``): ``y = x @ dequant(W)^T`` in one call;
* ``dequant`` (prefill, rows symbolic): the float W [N, K], followed by the float GEMM (on CPU
  targets ``weight_layout`` then has the kernel write W as the [N / nb, K, nb] panels the GEMM
  reads, as for a compile-time packed weight: no per-call repack);
* ``take``: the embedding gather straight from the packed table (a tied embedding keeps no
  float copy).

Kernel names are ``<family>_<kind>_<N>_<K>_<tag>[_<rows>]`` (``q4_matmul_576_576_g32m_1x1``).

Activations: under ``use_activations("int8")`` (the pipeline sets it from
``CompileOptions.activations``) each Packed that offers a VNNI variant is swapped for it: the
kernels then quantize x to int8 and use integer dot products (``formats/vnni.py``, x86 AVX-512 VNNI).
Prefill linears then call ``matmul`` with symbolic rows too (the int8 GEMM ``gemm_qvnni_cpu``,
N a multiple of 16) instead of dequantize + float GEMM (docs/decisions/quantized-linears.md).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import numpy as np
import tvm
from tvm import relax

from perfx_compiler.errors import PerfXError
from perfx_compiler.formats import GEMV_MAX_ROWS, Packed
from perfx_compiler.passes._relax_util import (
    SKIP,
    FuncInfo,
    exported,
    find_linears,
    op_name,
    replace_weight_params,
    rewrite_functions,
)

ACTIVATIONS = ("f32", "int8")
_ACTIVATIONS: contextvars.ContextVar[str] = contextvars.ContextVar("perfx_activations", default="f32")


@contextlib.contextmanager
def use_activations(mode: str) -> Iterator[None]:
    """Quantized linears built inside read ``f32`` or ``int8`` (VNNI layout) activations."""
    if mode not in ACTIVATIONS:
        raise PerfXError(f"activations must be one of {', '.join(ACTIVATIONS)}, not {mode!r}")
    token = _ACTIVATIONS.set(mode)
    try:
        yield
    finally:
        _ACTIVATIONS.reset(token)


def current_activations() -> str:
    return _ACTIVATIONS.get()


def finalized(pk: Packed, ctx: Any) -> Packed:
    """``pk`` in the layout its kernels read (its VNNI variant under int8 activations), as ``rewrite_linears``
    would take it, with its arrays handed to the compile's weights file (``PassContext.weight_file``) on CPU
    targets: a pass that packs weight by weight then holds one weight's arrays on the heap, not every
    weight's until the passes end. (GPU layouts are still rewritten after the passes: not staged.)"""
    if current_activations() == "int8" and pk.vnni is not None:
        pk = pk.vnni()
    pk.vnni = None  # final; its closure would hold the unpacked codes
    weight_file = getattr(ctx, "weight_file", None)
    if weight_file is not None and getattr(getattr(ctx, "target", None), "family", "") != "gpu":
        pk.arrays = [(suffix, weight_file.stage(a)) for suffix, a in pk.arrays]
    return pk


_BATCH_GEMV: contextvars.ContextVar[bool] = contextvars.ContextVar("perfx_batch_gemv", default=False)


@contextlib.contextmanager
def use_batch_gemv(on: bool) -> Iterator[None]:
    """Linears with a symbolic batch of <= GEMV_MAX_ROWS rows each (``paged_decode``: x [batch, 1, K])
    built inside call the quantized GEMV (its row loop reads the packed weights) instead of
    dequantize + float GEMM. The pipeline turns it on for CPU targets, whose int4/int8 GEMV
    templates take a symbolic row count (GPU templates do not)."""
    token = _BATCH_GEMV.set(bool(on))
    try:
        yield
    finally:
        _BATCH_GEMV.reset(token)


def batch_gemv_rows(rows: list[int | None], family: str) -> bool:
    """A symbolic batch of few-row linears that the batched GEMV serves (f32 activations; under
    int8 activations the VNNI GEMM already takes symbolic rows)."""
    return (_BATCH_GEMV.get() and current_activations() == "f32" and family in ("q4", "q8")
            and rows[0] is None and rows[1] is not None and rows[1] <= GEMV_MAX_ROWS)


def weight_uses(mod: tvm.IRModule, names: set[str]) -> dict[str, set[str]]:
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


def linear_weights(mod: tvm.IRModule, weights: dict[str, Any]) -> tuple[set[str], dict[str, set[str]]]:
    """(names of 2-D weights some linear reads, their uses)."""
    candidates = {n for n, a in weights.items() if np.ndim(a) == 2}  # np.ndim: no float copy of a lazy weight
    uses = weight_uses(mod, candidates)
    return {n for n, u in uses.items() if "linear" in u}, uses


def packed_weights(mod: tvm.IRModule, weights: dict[str, Any]) -> set[str]:
    """Names of the 2-D weights a weight-format pass packs: every linear's, and an untied embedding's (only
    gathered: its rows are dequantized from the packed codes as they are gathered; no float32 copy)."""
    quant, uses = linear_weights(mod, weights)
    return quant | {n for n, u in uses.items() if "take" in u and "other" not in u}


def static_dim(expr: Any, axis: int) -> int | None:
    """A dim's value when it is a constant, or an expression that is one for every length >= 1
    (prefill's last-token slice has ``min(INT64_MAX, seq) - min(max(seq - 1, 0), seq)`` rows: 1)."""
    d = expr.ty.shape.values[axis]
    if isinstance(d, tvm.tirx.IntImm):
        return int(d.value)
    from tvm import sym

    analyzer = sym.Analyzer()
    for v in tvm.tirx.analysis.undefined_vars(d):
        analyzer.update(v, sym.ConstIntBound(1, 1 << 40))
    out = analyzer.simplify(d)
    return int(out.value) if isinstance(out, tvm.tirx.IntImm) else None


def rewrite_linears(
    mod: tvm.IRModule, weights: dict[str, Any], packed: dict[str, Packed]
) -> tuple[tvm.IRModule, dict[str, Any]]:
    """Replace each weight of ``packed`` by its arrays and every linear/gather over it by kernels."""
    if not packed:
        return mod, weights
    gemm_rows: set[str] = set()  # weights whose prefill linears run the int8 GEMM (gemm_qvnni_cpu)
    if current_activations() == "int8":
        # GGUF passthrough hands over packs already in the VNNI layout (tag suffix "v", no .vnni);
        # q6 / q5 / q3 / q2 (Q6_K's 6-bit row quads, the Q5 types' 5-bit row octets, Q3_K's / Q2_K's) exist only in it
        gemm_rows = {n for n, pk in packed.items() if pk.n % 16 == 0 and pk.int8_gemm and (
            pk.vnni is not None or (pk.family in ("q2", "q3", "q4", "q5", "q6", "q8") and pk.tag.endswith("v")))}
        packed = {n: (pk.vnni() if pk.vnni is not None else pk) for n, pk in packed.items()}
    _, uses = linear_weights(mod, weights)
    new_weights: dict[str, Any] = {}
    for name, arr in weights.items():
        if name not in packed:
            new_weights[name] = arr
            continue
        if "other" in uses.get(name, set()):
            new_weights[name] = arr  # still read as floats somewhere: keep both
        for suffix, a in packed[name].arrays:
            new_weights[f"{name}{suffix}"] = a
    mod, new_weights, params = replace_weight_params(mod, weights, new_weights)

    kernels: dict[str, Any] = {}

    def kernel(kind: str, name: str, lead: Any) -> str:
        pk = packed[name]
        if kind == "dequant":
            key = f"{pk.family}_dequant_{pk.n}_{pk.k}_{pk.tag}"
            if key not in kernels:
                kernels[key] = pk.compute("dequant", (None, None))
            return key
        if len(lead.ty.shape.values) != (3 if kind == "matmul" else 2):
            raise PerfXError(f"internal: quantized {kind} of {name} expects a rank-3 input, got {lead.ty}")
        rows = (static_dim(lead, 0), static_dim(lead, 1))
        tag = "x".join("n" if r is None else str(r) for r in rows)
        key = f"{pk.family}_{kind}_{pk.n}_{pk.k}_{pk.tag}_{tag}"
        ids_dtype = str(lead.ty.dtype) if kind == "take" else "int64"
        if ids_dtype != "int64":  # the graph's ids (int32 on targets without 64-bit integers)
            key += f"_{ids_dtype}"
        if key not in kernels:
            kernels[key] = pk.compute(kind, rows, ids_dtype) if kind == "take" else pk.compute(kind, rows)
        return key

    plans: dict[str, list[tuple[str, Any, Any]]] = {}
    for fn in exported(mod):
        info = FuncInfo.of(mod[fn])
        todo: list[tuple[str, Any, Any]] = []
        for lin in find_linears(info):
            if lin.weight.name in packed:
                rows = [static_dim(lin.x, 0), static_dim(lin.x, 1)]
                if ((None not in rows and rows[0] * rows[1] <= GEMV_MAX_ROWS) or lin.weight.name in gemm_rows
                        or batch_gemv_rows(rows, packed[lin.weight.name].family)):
                    todo.append(("linear", lin, kernel("matmul", lin.weight.name, lin.x)))
                else:
                    todo.append(("dequant", lin, kernel("dequant", lin.weight.name, None)))
        for var, value in info.values.items():
            if op_name(value) == "relax.shape_of" and getattr(value.args[0], "name", None) in packed:
                if value.args[0] not in info.values:
                    pk = packed[value.args[0].name]
                    todo.append(("shape", var, (pk.n, pk.k)))
            if op_name(value) == "relax.take" and isinstance(value.args[0], relax.Var):
                wname = value.args[0].name
                if wname in packed and value.args[0] not in info.values and int(value.attrs.axis) == 0:
                    ids = value.args[1]
                    if len(ids.ty.shape.values) == 2 and "other" not in uses[wname]:
                        todo.append(("take", var, kernel("take", wname, ids)))
        plans[fn] = todo

    def plan_for(fn: str, func: relax.Function, info: FuncInfo, gvars: dict[str, Any]) -> dict[Any, Any]:
        plan: dict[Any, Any] = {}
        p = params[fn]

        def qargs(wn: str) -> list[Any]:
            return [p[f"{wn}{suffix}"] for suffix, _ in packed[wn].arrays]

        for kind, item, key in plans[fn]:
            if kind == "linear":
                lin = item
                for v in lin.vars:
                    plan[v] = SKIP

                def linear(rw: Any, binding: Any, lin=lin, key=key) -> None:
                    ty = lin.matmul.ty
                    y = rw.emit(
                        relax.call_tir(gvars[key], [rw.arg(lin.x), *qargs(lin.weight.name)],
                                       relax.TensorType(ty.shape, "float32")),
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

                def dequant(rw: Any, binding: Any, lin=lin, key=key) -> None:
                    pk = packed[lin.weight.name]
                    w = rw.emit(relax.call_tir(gvars[key], qargs(lin.weight.name),
                                               relax.TensorType([pk.n, pk.k], "float32")))
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

                def take(rw: Any, binding: Any, key=key) -> None:
                    wn = binding.value.args[0].name
                    call = relax.call_tir(gvars[key], [*qargs(wn), rw.arg(binding.value.args[1])],
                                          relax.TensorType(binding.var.ty.shape, "float32"))
                    rw.remap(binding.var, rw.emit(call, binding.var))

                plan[item] = take
        return plan

    mod, _ = rewrite_functions(mod, plan_for, kernels)
    return mod, new_weights
