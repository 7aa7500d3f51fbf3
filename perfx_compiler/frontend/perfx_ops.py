"""Converters from PerfX's own ONNX operators (domain ``perfx``) to Relax.

``perfx.CachedAttention`` becomes one call of the fused attention kernel that
updates the KV cache in place (``call_tir_inplace``: outputs 1 and 2 alias the
cache inputs, so the runtime's cache tensors are written, never copied).
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter

from perfx_compiler.kernels.attention import attention_decode_kernel, attention_prefill_kernel
from perfx_compiler.kernels.attention_gpu import cached_attention_kernel_gpu
from perfx_compiler.kernels.paged_attention import paged_attention_kernel
from perfx_compiler.kernels.paged_attention_gpu import paged_attention_kernel_gpu

# Target family of the compilation being imported ("cpu" | "gpu"); the pipeline's import phase
# sets it, converters pick the kernel variant from it.
TARGET_FAMILY = "cpu"


def set_target_family(family: str) -> None:
    global TARGET_FAMILY
    TARGET_FAMILY = family

# Kernels are shared by every function imported in one compilation (prefill, decode, ...):
# one GlobalVar object per kernel configuration, added to the merged module afterwards.
_KERNELS: dict[tuple, tuple[relax.GlobalVar, tirx.PrimFunc]] = {}


def kernel_global_var(name: str, builder, *args, **features) -> relax.GlobalVar:
    """The GlobalVar of ``builder(*args, **features)``, built once per configuration.

    ``features``: attention variants a model family asks for (``window``, ``softcap``); only
    non-default ones are passed, so a plain Llama kernel keeps its name (and its tuning records)."""
    features = {k: v for k, v in features.items() if v}
    key = (name, *args, *sorted(features.items()))
    if key not in _KERNELS:
        suffix = "_".join([str(a) for a in args]
                          + [f"{k}{v:g}" if isinstance(v, (int, float)) else f"{k}{v}" for k, v in sorted(features.items())])
        func = builder(*args, **features)
        # A throwaway BlockBuilder gives the GlobalVar its function type.
        gv = relax.BlockBuilder().add_func(func, f"{name}_{suffix}")
        _KERNELS[key] = (gv, func)
    return _KERNELS[key][0]


def add_kernels(mod: tvm.IRModule) -> tvm.IRModule:
    """Add every kernel referenced by an imported function to ``mod``."""
    used = _used_global_vars(mod)
    for gv, func in _KERNELS.values():
        if gv in used:
            mod[gv] = func
    return mod


def _used_global_vars(mod: tvm.IRModule) -> set:
    used: set = set()
    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(
                func.body, lambda e: used.add(e) if isinstance(e, relax.GlobalVar) else None
            )
    return used


def _static(dim) -> int:
    return int(dim)


def _features(attr: dict) -> dict:
    """The attention node's variant attributes: ``window`` (sliding-window length, 0 = full causal)
    and ``softcap`` (attention-logit soft-capping, 0 = none)."""
    return {"window": int(attr.get("window", 0)), "softcap": float(attr.get("softcap", 0.0))}


def _index_args(index: relax.Expr) -> tuple[str, ...]:
    """The kernels' index-dtype argument: the graph's integer input dtype (int32 on WebGPU).
    Empty for int64, the default, so int64 kernels keep their names."""
    dtype = str(index.ty.dtype)
    return () if dtype == "int64" else (dtype,)


def _cache_storage(cache: relax.Expr) -> dict:
    """The attention kernels' ``kv_cache`` argument for a cache (or paged pool) of this dtype: none for
    float32, so a float32 kernel keeps its name; a narrow cache on a GPU target is refused."""
    kv_cache = str(cache.ty.dtype)
    if kv_cache == "float32":
        return {}
    if TARGET_FAMILY == "gpu":
        raise ValueError(f"a {kv_cache} KV cache is a CPU-target feature (the GPU attention reads float32 caches)")
    return {"kv_cache": kv_cache}


class CachedAttention(OnnxOpConverter):
    """q, k, v, cache_k, cache_v, past_len, rope_cos, rope_sin -> out, cache_k, cache_v."""

    @classmethod
    def _impl_v1(cls, bb: relax.BlockBuilder, inputs, attr, params):
        q, k, v, kc, vc, past, cos, sin = inputs
        _, kvh, maxc, _row = (_static(x) for x in kc.ty.shape)
        d = 2 * _static(cos.ty.shape[1])  # an int8 cache's row is d + 4 (its scale): the head size is the table's
        heads = _static(q.ty.shape[2]) // d
        idx = _index_args(past)
        narrow = _cache_storage(kc)
        if TARGET_FAMILY == "gpu":
            gv = kernel_global_var(
                "cached_attention_gpu", cached_attention_kernel_gpu, heads, kvh, d, maxc, q.ty.dtype, *idx,
                **_features(attr),
            )
        elif getattr(q.ty.shape[1], "value", None) == 1:
            # the decode function (one token): its own kernel, so the template gives it decode knobs
            gv = kernel_global_var(
                "cached_attention_decode", attention_decode_kernel, heads, kvh, d, maxc, q.ty.dtype, *idx,
                **_features(attr), **narrow,
            )
        else:
            gv = kernel_global_var("cached_attention", attention_prefill_kernel, heads, kvh, d, maxc, q.ty.dtype, *idx,
                                   **_features(attr), **narrow)
        out_ty = [relax.TensorType(q.ty.shape, q.ty.dtype), kc.ty, vc.ty]
        call = relax.call_tir_inplace(gv, [q, k, v, kc, vc, past, cos, sin], [-1, 3, 4], out_ty)
        return bb.emit(call)


class PagedAttention(OnnxOpConverter):
    """q, k, v, pool_k, pool_v, positions, page_table, rope_cos, rope_sin -> out, pool_k, pool_v."""

    @classmethod
    def _impl_v1(cls, bb: relax.BlockBuilder, inputs, attr, params):
        q, k, v, kp, vp, pos, table, cos, sin = inputs
        _, page_size, kvh, _row = kp.ty.shape
        page_size, kvh = _static(page_size), _static(kvh)
        d = 2 * _static(cos.ty.shape[1])  # an int8 pool's row is d + 4 (its scale): the head size is the table's
        heads = _static(q.ty.shape[2]) // d
        maxc = _static(cos.ty.shape[0])
        narrow = _cache_storage(kp)
        name, builder = "paged_attention", paged_attention_kernel
        if TARGET_FAMILY == "gpu":  # a block per (query tile, sequence, head), tree reductions across threads
            name, builder = "paged_attention_gpu", paged_attention_kernel_gpu
        gv = kernel_global_var(name, builder, heads, kvh, d, maxc, page_size, q.ty.dtype, *_index_args(pos),
                               **_features(attr), **narrow)
        out_ty = [relax.TensorType(q.ty.shape, q.ty.dtype), kp.ty, vp.ty]
        call = relax.call_tir_inplace(gv, [q, k, v, kp, vp, pos, table, cos, sin], [-1, 3, 4], out_ty)
        return bb.emit(call)


PERFX_CONVERTERS: dict[str, type] = {"CachedAttention": CachedAttention, "PagedAttention": PagedAttention}
