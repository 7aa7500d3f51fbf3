"""Fused RoPE + paged-KV append + causal GQA attention for a batch of sequences.

The batched sibling of ``attention.py``: sequence ``b`` has ``positions[b]``
tokens cached in the pages listed in ``page_table[b]``; its ``seq`` new tokens
are rotated, written to (page, slot) = (page_table[b, p // PS], p % PS) in the
pools in place, and each query attends over cache positions ``0 .. p``.
Pools are [pages, PS, KVH, D] so one token's heads are contiguous.

``kv_cache`` "float16" | "int8" stores the pools' rows as the contiguous kernel's narrow caches do
(``_kv_cache.py``: an int8 row is D int8 + its float32 scale, so the pools are [pages, PS, KVH, D + 4]);
every element is widened to float32 as it is loaded and every sum stays float32.
"""

from __future__ import annotations

import math
from typing import Any

from tvm.script import tirx as T

from perfx_compiler.kernels._attention_common import (
    ROWS_SCRATCH,
    copy_row,
    fast_exp,
    first_key,
    lanes_for,
    rope_store,
    softmax_init,
    tile_pv,
    tile_scores,
    tile_softcap,
    tile_softmax,
)
from perfx_compiler.kernels._attention_tiled import tiled_attention_body
from perfx_compiler.kernels._kv_cache import append_row, kv_dtype, row_stride, tile_pv_kv, tile_scores_kv
from perfx_compiler.kernels.memo import memoized_kernel

KEY_TILE = 32  # keys per online-softmax step
# prompt chunks (seq > 1) take the tiled body; its configuration as the contiguous kernel's tuned prefill
# records mostly pick it (tuning_logs/x86-avx512: 16 queries and all of a kv head's query heads per task)
PREFILL_TILES = {"q_tile": 16, "k_tile": 64, "key_block": 4}


def _kb(ctx: Any, j: Any) -> Any:
    """Flat offset of key j's row in a [pages, PS, KVH, RS] pool: ctx = (page table, b, kh, PS, KVH, RS),
    RS the elements per row (D, or D + 4 for int8 rows)."""
    pt, b, kh, ps, kvh, rs = ctx
    return ((T.Cast("int64", pt[b, j // ps]) * ps + j % ps) * kvh + kh) * rs


def _key_row(ctx: Any, b: Any, kh: Any, j: Any) -> Any:
    """The tiled body's view of :func:`_kb`: ctx = (page table, positions, PS, KVH, RS)."""
    pt, _, ps, kvh, d = ctx
    return _kb((pt, b, kh, ps, kvh, d), j)


def _past(ctx: Any, b: Any) -> Any:
    return T.Cast("int64", ctx[1][b])


def paged_attention_func(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_context: int,
    page_size: int,
    dtype: str,
    index_dtype: str,
    body: Any,
    kv_cache: str = "float32",
) -> Any:
    """The PrimFunc of a paged attention kernel whose loop nest is the TVMScript macro
    ``body(Q, K, V, KP, VP, POS, PT, COS, SIN, OUT, batch, seq, pages)``: one signature and buffer
    declaration for the CPU and GPU kernels (``kernels/paged_attention_gpu.py``), so the Relax call
    that binds them (``frontend/perfx_ops.py``) sees the same arguments whatever the target.
    Arguments: q, k, v [batch, seq, heads * D]; the k and v pools [pages, PS, KVH, D] (updated in
    place); positions [batch] and page_table [batch, pages per sequence] (``index_dtype``); the RoPE
    cos and sin tables [max_context, D / 2]; out [batch, seq, H * D]. ``kv_cache``: the pools' element
    type (their rows are ``row_stride(D, kv_cache)`` long)."""
    H, KVH, D, MAXC, PS = num_heads, num_kv_heads, head_dim, max_context, page_size
    KVD = kv_dtype(kv_cache)
    RS = row_stride(D, KVD)
    NPP = -(-MAXC // PS)  # pages per sequence
    HALF = D // 2

    @T.prim_func(private=True)
    def paged_attention(
        q_h: T.handle, k_h: T.handle, v_h: T.handle, kp_h: T.handle, vp_h: T.handle,
        pos_h: T.handle, pt_h: T.handle, cos_h: T.handle, sin_h: T.handle, out_h: T.handle,
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        batch = T.int64()
        seq = T.int64()
        pages = T.int64()
        Q = T.match_buffer(q_h, (batch, seq, T.int64(H * D)), dtype)
        K = T.match_buffer(k_h, (batch, seq, T.int64(KVH * D)), dtype)
        V = T.match_buffer(v_h, (batch, seq, T.int64(KVH * D)), dtype)
        KP = T.match_buffer(kp_h, (pages, T.int64(PS), T.int64(KVH), T.int64(RS)), KVD)
        VP = T.match_buffer(vp_h, (pages, T.int64(PS), T.int64(KVH), T.int64(RS)), KVD)
        POS = T.match_buffer(pos_h, (batch,), index_dtype)
        PT = T.match_buffer(pt_h, (batch, T.int64(NPP)), index_dtype)
        COS = T.match_buffer(cos_h, (T.int64(MAXC), T.int64(HALF)), dtype)
        SIN = T.match_buffer(sin_h, (T.int64(MAXC), T.int64(HALF)), dtype)
        OUT = T.match_buffer(out_h, (batch, seq, T.int64(H * D)), dtype)
        body(Q, K, V, KP, VP, POS, PT, COS, SIN, OUT, batch, seq, pages)

    return paged_attention


@memoized_kernel
def paged_attention_kernel(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_context: int,
    page_size: int,
    dtype: str = "float32",
    index_dtype: str = "int64",
    window: int = 0,
    softcap: float = 0.0,
    kv_cache: str = "float32",
) -> Any:
    """``index_dtype``: element type of ``positions`` and ``page_table`` (the graph's integer inputs).
    ``window`` > 0: sliding window (the query at p sees keys p - window < j <= p; the key loop starts
    at the window's first key); ``softcap`` > 0: scores become softcap * tanh(s / softcap). Both 0:
    the plain causal kernel, text for text.

    Decode (one new token per sequence): one task per (sequence, kv head), its rows the query heads
    sharing the kv head (each key/value row is read once for all of them), keys in tiles with an online
    softmax. Prompt chunks (seq > 1): the tiled body (``_attention_tiled.py``), tiles of queries per
    task, so each key row is read once per tile rather than once per query. No buffer is
    max_context long. ``kv_cache`` "float16" | "int8": narrow pools (module docstring)."""
    H, KVH, D, MAXC, PS = num_heads, num_kv_heads, head_dim, max_context, page_size
    G = H // KVH
    HALF = D // 2
    L = lanes_for(D)
    KT = KEY_TILE
    scale = 1.0 / math.sqrt(D)
    exp = fast_exp
    WIN, CAP = int(window), float(softcap)
    if WIN < 0 or CAP < 0:
        raise ValueError(f"paged attention: window {window} and softcap {softcap} must be >= 0")
    KVD = kv_dtype(kv_cache)
    KV32 = KVD == "float32"  # the float32 kernel is built from the original pieces, text for text
    RS = row_stride(D, KVD)

    def lo_key(p: Any) -> Any:
        return first_key(p, WIN)  # a Python 0 without a window: the terms below fold away

    tiled = tiled_attention_body(heads=H, kv_heads=KVH, head_dim=D, max_context=MAXC, config=PREFILL_TILES, lanes=L,
                                 window=WIN, softcap=CAP, exp=exp, key_row=_key_row, past_of=_past, kv_dtype=KVD)

    @T.macro
    def rows_attend(Q, KF, VF, KS, VS, POS, PT, COS, SIN, OUT, batch, seq):
        for bks in T.parallel(batch * KVH * seq):
            b = bks // (KVH * seq)
            kh = bks // seq % KVH
            s = bks % seq
            p = T.Cast("int64", POS[b]) + s
            qr = T.decl_buffer((G * D,), "float32", scope="local")
            sc = T.decl_buffer((G * KT,), "float32", scope="local")
            racc = T.decl_buffer((G * D,), "float32", scope="local")
            st = T.decl_buffer((3 * G,), "float32", scope="local")  # running max | sum | rescale
            for g in T.serial(G):
                rope_store(qr, g * D, 1, Q, b, s, (kh * G + g) * D, COS, SIN, p, HALF, T.float32(scale))
            softmax_init(st, racc, G, D)
            for kt in T.serial((p - lo_key(p)) // KT + 1):
                if not KV32:
                    tile_scores_kv(sc, qr, KF, KS, _kb, (PT, b, kh, PS, KVH, RS), lo_key(p) + kt * KT,
                                   T.min(KT, p + 1 - lo_key(p) - kt * KT), G, D, KT, L, KVD)
                else:
                    tile_scores(sc, qr, KF, VF, _kb, (PT, b, kh, PS, KVH, D), lo_key(p) + kt * KT,
                                T.min(KT, p + 1 - lo_key(p) - kt * KT), G, D, KT, L, 0, 0)
                if CAP > 0:
                    tile_softcap(sc, G, KT, CAP)
                tile_softmax(sc, st, T.min(KT, p + 1 - lo_key(p) - kt * KT), G, KT, exp)
                if not KV32:
                    tile_pv_kv(racc, sc, st, VF, VS, _kb, (PT, b, kh, PS, KVH, RS), lo_key(p) + kt * KT,
                               T.min(KT, p + 1 - lo_key(p) - kt * KT), G, D, KT, L, KVD)
                else:
                    tile_pv(racc, sc, st, VF, _kb, (PT, b, kh, PS, KVH, D), lo_key(p) + kt * KT,
                            T.min(KT, p + 1 - lo_key(p) - kt * KT), G, D, KT, L)
            for g in T.serial(G):
                for d in T.vectorized(D):
                    OUT[b, s, (kh * G + g) * D + d] = racc[g * D + d] / st[G + g]

    @T.macro
    def attend(Q, K, V, KF, VF, KS, VS, POS, PT, COS, SIN, OUT, batch, seq):
        # 1) rotate k, append k and v at each token's (page, slot)
        for bks in T.parallel(batch * KVH * seq):
            b = bks // (KVH * seq)
            kh = bks // seq % KVH
            s = bks % seq
            p = T.Cast("int64", POS[b]) + s
            base = ((T.Cast("int64", PT[b, p // PS]) * PS + p % PS) * KVH + kh) * RS
            if not KV32:
                append_row(KF, KS, VF, VS, base, K, V, b, s, kh * D, COS, SIN, p, D, KVD)
            else:
                rope_store(KF, base, 1, K, b, s, kh * D, COS, SIN, p, HALF, T.float32(1))
                copy_row(VF, base, V, b, s, kh * D, D)
        # 2) attention: prompt chunks tiled over queries; decode steps one task per (sequence, kv head)
        if seq > 1:
            tiled(Q, KF, VF, KS, VS, COS, SIN, OUT, batch, seq, (PT, POS, T.int64(PS), T.int64(KVH), T.int64(RS)))
        else:
            rows_attend(Q, KF, VF, KS, VS, POS, PT, COS, SIN, OUT, batch, seq)

    @T.macro
    def body(Q, K, V, KP, VP, POS, PT, COS, SIN, OUT, batch, seq, pages):
        KF = T.decl_buffer((pages * T.int64(PS * KVH * RS),), KVD, data=KP.data)
        VF = T.decl_buffer((pages * T.int64(PS * KVH * RS),), KVD, data=VP.data)
        if KVD == "int8":  # the rows' float32 scales, through a float32 view of the pools
            KS = T.decl_buffer((pages * T.int64(PS * KVH * RS // 4),), "float32", data=KP.data)
            VS = T.decl_buffer((pages * T.int64(PS * KVH * RS // 4),), "float32", data=VP.data)
            attend(Q, K, V, KF, VF, KS, VS, POS, PT, COS, SIN, OUT, batch, seq)
        else:
            attend(Q, K, V, KF, VF, KF, VF, POS, PT, COS, SIN, OUT, batch, seq)

    from perfx_compiler.kernels import POOL_SCRATCH_ATTR

    func = paged_attention_func(H, KVH, D, MAXC, PS, dtype, index_dtype, body, kv_cache=KVD)
    return func.with_attr(POOL_SCRATCH_ATTR, list(ROWS_SCRATCH))
