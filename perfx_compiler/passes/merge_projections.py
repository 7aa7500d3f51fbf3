"""Merge the Q/K/V projections into one matmul and gate/up into another.

Weights (and Q/K/V biases) are concatenated at compile time along the output axis, so each
merged linear reads its input once and launches once. The split costs nothing:

* Q/K/V: the attention kernel is re-targeted to read Q, K and V as strided views of the merged
  [1, seq, q+k+v] tensor (``kernels/attention_qkv.attention_over_qkv``); when that is not possible the
  result is split with ``strided_slice`` instead (correct, three small copies).
* gate/up: two ``strided_slice`` views of the [1, seq, 2F] result; ``fuse_swiglu`` turns
  ``silu(gate) * up`` over them into one kernel that reads the merged tensor directly.

A group whose members the GGUF passthrough would keep as blocks of different types (llama.cpp's
Q4_K_M gives attn_v Q6_K blocks beside Q4_K q/k in some layers) is not merged: each member keeps
its own block kernel, which beats one float32 matmul over all three.

The weight parameters change: ``q_proj``/``k_proj``/``v_proj`` -> ``qkv_proj`` (at q's position)
and ``gate_proj``/``up_proj`` -> ``gate_up_proj``, in every exported function alike.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import tvm
from tvm import relax

from perfx_compiler.errors import PerfXError
from perfx_compiler.kernels.attention_qkv import attention_over_qkv
from perfx_compiler.model.lazy import QuantizedWeight
from perfx_compiler.passes._relax_util import (
    SKIP,
    FuncInfo,
    Linear,
    find_linears,
    op_name,
    replace_weight_params,
    rewrite_functions,
)

NAME = "merge_projections"

# (merged suffix, member suffixes): names are Relax parameter names (dots became underscores).
GROUPS = (
    ("self_attn_qkv_proj", ("self_attn_q_proj", "self_attn_k_proj", "self_attn_v_proj")),
    ("mlp_gate_up_proj", ("mlp_gate_proj", "mlp_up_proj")),
)


def complete_groups(weights: dict[str, Any]) -> list[tuple[str, str, list[str]]]:
    """(prefix, merged suffix, member suffixes) for every complete group in the weight table (also
    used by the passthrough passes to merge their block tables the same way)."""
    out = []
    for merged, members in GROUPS:
        pat = re.compile(rf"^(.*){members[0]}_weight$")
        for name in weights:
            m = pat.match(name)
            if m and all(f"{m.group(1)}{s}_weight" in weights for s in members):
                out.append((m.group(1), merged, list(members)))
    return out


def _merged_weights(weights: dict[str, Any], groups: list[tuple[str, str, list[str]]]) -> dict[str, Any]:
    """The new weight table: each group's first member replaced by the concatenation, others dropped."""
    first: dict[str, tuple[str, list[str]]] = {}
    drop: set[str] = set()
    for prefix, merged, members in groups:
        for kind in ("weight", "bias"):
            names = [f"{prefix}{s}_{kind}" for s in members]
            present = [n in weights for n in names]
            if kind == "bias" and not any(present):
                continue
            if not all(present):
                raise PerfXError(f"internal: {prefix}{merged}: only some projections have a {kind}")
            first[names[0]] = (f"{prefix}{merged}_{kind}", names)
            drop.update(names[1:])
    out: dict[str, Any] = {}
    for name, arr in weights.items():
        if name in first:
            new, names = first[name]
            lazy = QuantizedWeight.concat([weights[n] for n in names])  # GGUF blocks stay blocks
            out[new] = lazy if lazy is not None else np.ascontiguousarray(
                np.concatenate([np.asarray(weights[n]) for n in names], axis=0))
        elif name not in drop:
            out[name] = arr
    return out


def _slice(x: Any, begin: int, end: int) -> Any:
    return relax.op.strided_slice(x, axes=[2], begin=[begin], end=[end])


def _block_types(ctx: Any, weights: dict[str, Any]) -> dict[str, str]:
    """Relax weight name -> the ggml type of the blocks the GGUF passthrough will keep for it, or that a K-quant
    quantization will make of it (``quantize_kquant.weight_types``: its mixes give V Q6_K in some layers)."""
    from perfx_compiler.passes.quantize_kquant import weight_types

    desc = getattr(ctx, "desc", None)
    quantization = getattr(getattr(ctx, "options", None), "quantization", None)
    if quantization != "gguf" or desc is None:
        return weight_types(weights, quantization or "")
    from perfx_compiler.passes._quantized_linears import current_activations
    from perfx_compiler.passes.gguf_passthrough import gpu_target, packable, relax_name

    vnni, gpu = current_activations() == "int8", gpu_target(ctx)
    return {relax_name(n): v[0] for n, v in (desc.quantized or {}).items() if packable(v[0], vnni, gpu)}


def apply(mod: tvm.IRModule, weights: dict[str, Any], ctx: Any) -> tuple[tvm.IRModule, dict[str, Any]]:
    types = _block_types(ctx, weights)
    groups = [g for g in complete_groups(weights)
              if len({types.get(f"{g[0]}{s}_weight", "float") for s in g[2]}) == 1]
    if not groups:
        return mod, weights
    new_weights = _merged_weights(weights, groups)
    mod, new_weights, params = replace_weight_params(mod, weights, new_weights)

    # Attention kernels that can read the merged QKV tensor in place.
    kernels: dict[str, Any] = {}
    attn_variant: dict[str, str] = {}
    for gv, func in mod.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc) and gv.name_hint.startswith("cached_attention"):
            variant = attention_over_qkv(func)
            if variant is not None:
                kernels[gv.name_hint + "_qkv"] = variant
                attn_variant[gv.name_hint] = gv.name_hint + "_qkv"

    def plan_for(fn: str, func: relax.Function, info: FuncInfo, gvars: dict[str, Any]) -> dict[Any, Any]:
        by_weight = {lin.weight.name: lin for lin in find_linears(info)}
        plan: dict[Any, Any] = {}
        for prefix, merged, members in groups:
            lins: list[Linear] = [by_weight.get(f"{prefix}{s}_weight") for s in members]  # type: ignore[misc]
            if any(lin is None for lin in lins) or any(not lin.x.same_as(lins[0].x) for lin in lins):
                raise PerfXError(f"internal: {fn}: {prefix}{merged} members are not linears of one input")
            has_bias = lins[0].bias is not None
            wvar = params[fn][f"{prefix}{merged}_weight"]
            bvar = params[fn].get(f"{prefix}{merged}_bias") if has_bias else None
            widths = [int(lin.weight.ty.shape.values[0]) for lin in lins]
            for lin in lins:
                for v in lin.vars:
                    plan[v] = SKIP
            attn = _attention_consumer(info, lins) if merged.endswith("qkv_proj") else None
            gv_attn = None
            if attn is not None:
                callee = info.values[attn].args[0].name_hint
                gv_attn = gvars.get(attn_variant.get(callee, ""))
            state: dict[str, Any] = {}
            head = min((lin.matmul for lin in lins), key=lambda v: info.order[v])

            def merged_linear(rw: Any, binding: Any, lins=lins, wvar=wvar, bvar=bvar, widths=widths,
                              state=state, split=gv_attn is None) -> None:
                pt = rw.emit(relax.op.permute_dims(wvar, axes=[1, 0]))
                y = rw.emit(relax.op.matmul(rw.arg(lins[0].x), pt))
                if bvar is not None:
                    y = rw.emit(relax.op.add(y, bvar))
                state["y"] = y
                if split:
                    start = 0
                    for lin, w in zip(lins, widths, strict=True):
                        rw.remap(lin.out, rw.emit(_slice(y, start, start + w), lin.out))
                        start += w

            plan[head] = merged_linear
            if gv_attn is not None:

                def attention(rw: Any, binding: Any, gv=gv_attn, state=state) -> None:
                    call = binding.value
                    rest = [rw.arg(a) for a in list(call.args[1].fields)[3:]]
                    ty = binding.var.ty
                    out_ty = list(ty.fields) if hasattr(ty, "fields") else [ty]
                    new = relax.call_tir_inplace(gv, [state["y"], *rest], [-1, 1, 2], out_ty)
                    rw.remap(binding.var, rw.emit(new, binding.var))

                plan[attn] = attention
        return plan

    mod, _ = rewrite_functions(mod, plan_for, kernels)
    return mod, new_weights


def _attention_consumer(info: FuncInfo, lins: list[Linear]) -> Any | None:
    """The attention call reading exactly (q, k, v) as its first three arguments, if that is
    their only use."""
    readers = [info.users(lin.out) for lin in lins]
    if any(len(r) != 1 or info.uses.get(lin.out, 0) != 1 for r, lin in zip(readers, lins, strict=True)):
        return None
    var = readers[0][0]
    if any(not r[0].same_as(var) for r in readers):
        return None
    call = info.values.get(var)
    if op_name(call) != "relax.call_tir_inplace":
        return None
    args = list(call.args[1].fields)
    if len(args) < 3 or any(not a.same_as(lin.out) for a, lin in zip(args[:3], lins, strict=True)):
        return None
    return var


