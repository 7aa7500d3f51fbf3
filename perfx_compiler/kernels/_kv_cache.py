"""KV caches stored narrower than float32 (``kv_cache`` "float16" | "int8") in the CPU attention kernel.

float16: the cache holds the rows as float16; every load is widened to float32, every sum stays float32.

int8: one cached row (one token, one kv head, ``D`` values) is ``D`` int8 followed by its float32 scale
(symmetric absmax / 127), so a row is ``D + 4`` bytes and the cache is one int8 tensor
[1, KVH, MAXC, D + 4]. The scale sits in the row rather than in a separate [KVH, MAXC] buffer so the
kernel keeps its signature (the graph's cache inputs, the runtime's cache list, the fused-QKV rewrite
and the in-place aliasing are unchanged: only the caches' dtype and last dimension differ) and the
scale shares the row's cache line. The scale is read through a float32 view of the same memory
(offset ``(row + D) / 4``: needs D % 4 == 0). Scores fold the key's scale after the dot product
(scale_k * dot(q, k_int8)); the PV loop multiplies the weight by the value's scale once per key.

Every helper takes ``kvd`` (the cache dtype, a Python str) and is only used when it is not float32:
the float32 kernel is built from the original pieces, text for text.
"""

from __future__ import annotations

from typing import Any

from tvm.script import tirx as T

from perfx_compiler.kernels._lanes import add, fold_lanes, vector_type

KV_DTYPES = {"f32": "float32", "f16": "float16", "int8": "int8"}
SCALE_BYTES = 4  # the float32 scale after an int8 row


def kv_dtype(name: str) -> str:
    """TVM dtype of a cache option ("f32" | "f16" | "int8", or the dtype itself)."""
    if name in KV_DTYPES.values():
        return name
    if name not in KV_DTYPES:
        raise ValueError(f"unknown kv cache '{name}'; use f32, f16 or int8")
    return KV_DTYPES[name]


def row_stride(head_dim: int, kvd: str) -> int:
    """Elements of ``kvd`` per cached row: head_dim, plus the scale's 4 bytes for int8."""
    if kvd == "int8":
        if head_dim % SCALE_BYTES:
            raise ValueError(f"int8 kv cache needs head_dim % 4 == 0, got {head_dim}")
        return head_dim + SCALE_BYTES
    return head_dim


def bytes_per_token(num_kv_heads: int, head_dim: int, num_layers: int, kv_cache: str) -> int:
    """Bytes one token takes in the k and v caches of every layer."""
    kvd = kv_dtype(kv_cache)
    size = {"float32": 4, "float16": 2, "int8": 1}[kvd]
    return 2 * num_layers * num_kv_heads * row_stride(head_dim, kvd) * size


def row_scale(S: Any, off: Any, D: int, kvd: str) -> Any:
    """The scale of the row at element offset ``off`` (int8: from ``S``, the cache's float32 view), or 1."""
    if kvd == "int8":
        return S[(off + D) // SCALE_BYTES]
    return T.float32(1)


def _dot(q: Any, q_base: Any, k: Any, k_base: Any, D: int, L: int, kvd: str) -> Any:
    """q[q_base : + D] . float32(k[k_base : + D]) as one expression (L-lane products, folded)."""
    from tvm import tirx

    vt = vector_type("float32", L)

    def kload(off: Any) -> Any:
        return tirx.Cast(vt, k.vload([off], vector_type(kvd, L)))

    vec = q.vload([q_base], vt) * kload(k_base)
    for c in range(1, D // L):
        vec = vec + q.vload([q_base + c * L], vt) * kload(k_base + c * L)
    return fold_lanes(vec, L, add)


@T.macro
def store_row(dst, dsc, off, tmp, D, kvd):
    """dst[off : off + D] = tmp[0 : D] as ``kvd``; int8: round(tmp * 127 / absmax), absmax / 127 stored
    as the row's scale (an all-zero row: scale 0, values 0)."""
    if kvd == "int8":
        amax = T.decl_buffer((2,), "float32", scope="local")
        amax[0] = T.float32(0)
        for d in T.serial(D):
            amax[0] = T.max(amax[0], T.fabs(tmp[d]))
        amax[1] = T.if_then_else(amax[0] > T.float32(0), T.float32(127) / amax[0], T.float32(0))
        for d in T.vectorized(D):
            dst[off + d] = T.Cast("int8", T.max(T.min(T.round(tmp[d] * amax[1]), T.float32(127)), T.float32(-127)))
        dsc[(off + D) // SCALE_BYTES] = amax[0] / T.float32(127)
    else:
        for d in T.vectorized(D):
            dst[off + d] = T.Cast(kvd, tmp[d])


@T.macro
def append_row(KF, KS, VF, VS, off, K, V, b, s, col, COS, SIN, pos, D, kvd):
    """Rotate k (RoPE at ``pos``) and store it and v into the caches' rows at element offset ``off``."""
    tmp = T.decl_buffer((D,), "float32", scope="local")
    for d in T.vectorized(D // 2):
        tmp[d] = K[b, s, col + d] * COS[pos, d] - K[b, s, col + d + D // 2] * SIN[pos, d]
        tmp[d + D // 2] = K[b, s, col + d + D // 2] * COS[pos, d] + K[b, s, col + d] * SIN[pos, d]
    store_row(KF, KS, off, tmp, D, kvd)
    for d in T.vectorized(D):
        tmp[d] = V[b, s, col + d]
    store_row(VF, VS, off, tmp, D, kvd)


@T.macro
def tile_scores_kv(sc, qr, KF, KS, key_base, ctx, j0, n, rows, D, KT, L, kvd):
    """tile_scores over a narrow cache: sc[r * KT + jj] = scale_k * (q_r . k_{j0 + jj})."""
    for jj in T.serial(n):
        for r in T.serial(rows):
            sc[r * KT + jj] = _dot(qr, r * D, KF, key_base(ctx, j0 + jj), D, L, kvd) * row_scale(
                KS, key_base(ctx, j0 + jj), D, kvd)


@T.macro
def tile_pv_kv(acc, sc, st, VF, VS, key_base, ctx, j0, n, rows, D, KT, L, kvd):
    """tile_pv over a narrow cache: acc_r = rescale_r * acc_r + sum_jj (p[r, jj] * scale_v) * v_{j0 + jj}."""
    for r in T.serial(rows):
        for i in T.vectorized(D):
            acc[r * D + i] = acc[r * D + i] * st[2 * rows + r]
    for jj in T.serial(n):
        for r in T.serial(rows):
            sc[r * KT + jj] = sc[r * KT + jj] * row_scale(VS, key_base(ctx, j0 + jj), D, kvd)
            for c in T.serial(D // L):
                for lane in T.vectorized(L):
                    acc[r * D + c * L + lane] = acc[r * D + c * L + lane] + sc[r * KT + jj] * T.Cast(
                        "float32", VF[key_base(ctx, j0 + jj) + c * L + lane])
