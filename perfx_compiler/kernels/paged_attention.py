"""Fused RoPE + paged-KV append + causal GQA attention for a batch of sequences.

The batched sibling of ``attention.py``: sequence ``b`` has ``positions[b]``
tokens cached in the pages listed in ``page_table[b]``; its ``seq`` new tokens
are rotated, written to (page, slot) = (page_table[b, p // PS], p % PS) in the
pools in place, and each query attends over cache positions ``0 .. p``.
Pools are [pages, PS, KVH, D] so one token's heads are contiguous.
"""

from __future__ import annotations

import math

from tvm.script import tirx as T


def paged_attention_kernel(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_context: int,
    page_size: int,
    dtype: str = "float32",
    index_dtype: str = "int64",
):
    """``index_dtype``: element type of ``positions`` and ``page_table`` (the graph's integer inputs)."""
    H, KVH, D, MAXC, PS = num_heads, num_kv_heads, head_dim, max_context, page_size
    NPP = -(-MAXC // PS)  # pages per sequence
    G = H // KVH
    HALF = D // 2
    scale = 1.0 / math.sqrt(D)

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
        KP = T.match_buffer(kp_h, (pages, T.int64(PS), T.int64(KVH), T.int64(D)), dtype)
        VP = T.match_buffer(vp_h, (pages, T.int64(PS), T.int64(KVH), T.int64(D)), dtype)
        POS = T.match_buffer(pos_h, (batch,), index_dtype)
        PT = T.match_buffer(pt_h, (batch, T.int64(NPP)), index_dtype)
        COS = T.match_buffer(cos_h, (T.int64(MAXC), T.int64(HALF)), dtype)
        SIN = T.match_buffer(sin_h, (T.int64(MAXC), T.int64(HALF)), dtype)
        OUT = T.match_buffer(out_h, (batch, seq, T.int64(H * D)), dtype)
        # 1) rotate k, append k and v at each token's (page, slot)
        for bks in T.parallel(batch * KVH * seq):
            b = bks // (KVH * seq)
            kh = bks // seq % KVH
            s = bks % seq
            p = T.Cast("int64", POS[b]) + s
            page = T.Cast("int64", PT[b, p // PS])
            slot = p % PS
            for d in T.serial(HALF):
                x1 = K[b, s, kh * D + d]
                x2 = K[b, s, kh * D + d + HALF]
                KP[page, slot, kh, d] = x1 * COS[p, d] - x2 * SIN[p, d]
                KP[page, slot, kh, d + HALF] = x2 * COS[p, d] + x1 * SIN[p, d]
            for d in T.serial(D):
                VP[page, slot, kh, d] = V[b, s, kh * D + d]
        # 2) attention for every (sequence, head, query)
        for bhs in T.parallel(batch * H * seq):
            b = bhs // (H * seq)
            h = bhs // seq % H
            s = bhs % seq
            kh = h // G
            p = T.Cast("int64", POS[b]) + s
            qr = T.decl_buffer((D,), dtype, scope="local")
            score = T.decl_buffer((MAXC,), dtype, scope="local")
            acc = T.decl_buffer((D,), dtype, scope="local")
            stat = T.decl_buffer((2,), dtype, scope="local")
            for d in T.serial(HALF):
                x1 = Q[b, s, h * D + d]
                x2 = Q[b, s, h * D + d + HALF]
                qr[d] = (x1 * COS[p, d] - x2 * SIN[p, d]) * T.float32(scale)
                qr[d + HALF] = (x2 * COS[p, d] + x1 * SIN[p, d]) * T.float32(scale)
            stat[0] = T.float32(-3.0e38)
            for j in T.serial(p + 1):
                score[j] = T.float32(0)
                for d in T.serial(D):
                    score[j] = score[j] + qr[d] * KP[T.Cast("int64", PT[b, j // PS]), j % PS, kh, d]
                stat[0] = T.max(stat[0], score[j])
            stat[1] = T.float32(0)
            for d in T.serial(D):
                acc[d] = T.float32(0)
            for j in T.serial(p + 1):
                w = T.exp(score[j] - stat[0])
                stat[1] = stat[1] + w
                for d in T.serial(D):
                    acc[d] = acc[d] + w * VP[T.Cast("int64", PT[b, j // PS]), j % PS, kh, d]
            for d in T.serial(D):
                OUT[b, s, h * D + d] = acc[d] / stat[1]

    return paged_attention
