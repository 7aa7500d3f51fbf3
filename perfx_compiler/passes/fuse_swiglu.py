"""SwiGLU ``silu(gate) * up`` over the merged gate|up projection -> one kernel.

After ``merge_projections`` the MLP reads ``gate = y[..., :F]`` and ``up = y[..., F:]`` from one
[1, seq, 2F] matmul result. This pass replaces the slices, the sigmoid and both multiplies with
one kernel that reads ``y`` directly (vectorized by the elementwise template with its polynomial
sigmoid) and is opaque to FuseOps, so it stays one launch whatever the matmul before it lowers to.
Unmerged gate/up projections are left alone: FuseOps already folds SiLU and the multiply into
the two matmuls' epilogues there.
"""

from __future__ import annotations

from typing import Any

import tvm
from tvm import relax

from perfx_compiler.kernels.swiglu import swiglu_kernel
from perfx_compiler.passes._relax_util import FUSED_OP_ATTR, SKIP, FuncInfo, exported, rewrite_functions

NAME = "fuse_swiglu"


def _slice_of(info: FuncInfo, var: Any) -> tuple[Any, int, int] | None:
    """(source, begin, end) when ``var`` is a unit-stride slice of the last axis of a 3-D tensor."""
    call = info.call(var, "relax.strided_slice")
    if call is None or len(call.args) < 4:
        return None
    try:
        axes = [int(a.value) for a in call.args[1].fields]
        begin = [int(a.value) for a in call.args[2].fields]
        end = [int(a.value) for a in call.args[3].fields]
        strides = [int(a.value) for a in call.args[4].fields] if len(call.args) > 4 else [1]
    except (AttributeError, TypeError, ValueError):
        return None
    if axes != [2] or strides != [1] or len(begin) != 1:
        return None
    return call.args[0], begin[0], end[0]


def _match(info: FuncInfo, var: Any) -> dict[str, Any] | None:
    """``var = (g * sigmoid(g)) * u`` with g = y[..., :F], u = y[..., F:2F]."""
    outer = info.call(var, "relax.multiply")
    if outer is None:
        return None
    for silu_var, u in ((outer.args[0], outer.args[1]), (outer.args[1], outer.args[0])):
        silu = info.call(silu_var, "relax.multiply")
        if silu is None:
            continue
        for g, sg_var in ((silu.args[0], silu.args[1]), (silu.args[1], silu.args[0])):
            sg = info.call(sg_var, "relax.sigmoid")
            if sg is None or not sg.args[0].same_as(g):
                continue
            gs, us = _slice_of(info, g), _slice_of(info, u)
            if gs is None or us is None or not gs[0].same_as(us[0]):
                continue
            F = gs[2] - gs[1]
            y = gs[0]
            if gs[1] != 0 or us[1] != F or us[2] != 2 * F or int(y.ty.shape.values[-1]) != 2 * F:
                continue
            inner = [silu_var, sg_var, g, u]
            if any(info.uses.get(v, 0) != (2 if v.same_as(g) else 1) for v in inner):
                continue  # g is read by sigmoid and the multiply; nothing else may read these
            return {"y": y, "F": F, "skip": inner}
    return None


def apply(mod: tvm.IRModule, weights: dict[str, Any], ctx: Any) -> tuple[tvm.IRModule, dict[str, Any]]:
    matches: dict[str, list[tuple[Any, dict[str, Any]]]] = {}
    kernels: dict[str, Any] = {}
    for fn in exported(mod):
        info = FuncInfo.of(mod[fn])
        found = []
        for var in list(info.values):
            m = _match(info, var)
            if m is not None:
                if f"swiglu_{m['F']}" not in kernels:  # built once: parsing TVMScript is slow
                    kernels[f"swiglu_{m['F']}"] = swiglu_kernel(m["F"]).with_attr(FUSED_OP_ATTR, '{"op": "swiglu"}')
                found.append((var, m))
        matches[fn] = found
    if not kernels:
        return mod, weights

    def plan_for(fn: str, func: relax.Function, info: FuncInfo, gvars: dict[str, Any]) -> dict[Any, Any]:
        plan: dict[Any, Any] = {}
        for var, m in matches[fn]:
            for v in m["skip"]:
                plan[v] = SKIP

            def fused(rw: Any, binding: Any, m=m) -> None:
                ty = binding.var.ty
                call = relax.call_tir(gvars[f"swiglu_{m['F']}"], [rw.arg(m["y"])], relax.TensorType(ty.shape, ty.dtype))
                rw.remap(binding.var, rw.emit(call, binding.var))

            plan[var] = fused
        return plan

    mod, _ = rewrite_functions(mod, plan_for, kernels)
    return mod, weights
