"""Fused attention with RoPE and an in-place KV-cache append (one TIR kernel).

One kernel does, for a chunk of ``seq`` new tokens starting at ``past_len``:
RoPE on q and k (rotate-half, table lookup), k/v written into the caches at
their positions, then causal GQA attention of each query over cache positions
``0 .. past_len + i`` with a two-pass softmax. The caches are updated in place:
the compiler calls it with ``call_tir_inplace`` so no per-token copy exists.
"""

from __future__ import annotations

import math

from tvm.script import tirx as T


def cached_attention_kernel(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_context: int,
    dtype: str = "float32",
    index_dtype: str = "int64",
):
    """Build the PrimFunc for one attention configuration (shape constants baked in).

    ``index_dtype`` is the element type of ``past_len`` (the graph's integer inputs)."""
    H, KVH, D, MAXC = num_heads, num_kv_heads, head_dim, max_context
    G = H // KVH
    HALF = D // 2
    LANES = next(w for w in (16, 8, 4, 2, 1) if D % w == 0)  # f32 lanes of one AVX-512 register
    scale = 1.0 / math.sqrt(D)

    @T.prim_func(private=True)
    def cached_attention(
        q_h: T.handle, k_h: T.handle, v_h: T.handle, kc_h: T.handle, vc_h: T.handle,
        past_h: T.handle, cos_h: T.handle, sin_h: T.handle, out_h: T.handle,
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        seq = T.int64()
        Q = T.match_buffer(q_h, (T.int64(1), seq, T.int64(H * D)), dtype)
        K = T.match_buffer(k_h, (T.int64(1), seq, T.int64(KVH * D)), dtype)
        V = T.match_buffer(v_h, (T.int64(1), seq, T.int64(KVH * D)), dtype)
        KC = T.match_buffer(kc_h, (T.int64(1), T.int64(KVH), T.int64(MAXC), T.int64(D)), dtype)
        VC = T.match_buffer(vc_h, (T.int64(1), T.int64(KVH), T.int64(MAXC), T.int64(D)), dtype)
        PAST = T.match_buffer(past_h, (T.int64(1),), index_dtype)
        COS = T.match_buffer(cos_h, (T.int64(MAXC), T.int64(HALF)), dtype)
        SIN = T.match_buffer(sin_h, (T.int64(MAXC), T.int64(HALF)), dtype)
        OUT = T.match_buffer(out_h, (T.int64(1), seq, T.int64(H * D)), dtype)
        past: T.int64 = T.Cast("int64", PAST[0])
        # 1) rotate k, append k and v to the caches
        for kvs in T.parallel(KVH * seq):
            kh = kvs // seq
            s = kvs % seq
            for d in T.serial(HALF):
                x1 = K[0, s, kh * D + d]
                x2 = K[0, s, kh * D + d + HALF]
                c = COS[past + s, d]
                sn = SIN[past + s, d]
                KC[0, kh, past + s, d] = x1 * c - x2 * sn
                KC[0, kh, past + s, d + HALF] = x2 * c + x1 * sn
            for d in T.serial(D):
                VC[0, kh, past + s, d] = V[0, s, kh * D + d]
        # 2) attention for every (head, query)
        for hs in T.parallel(H * seq):
            h = hs // seq
            s = hs % seq
            kh = h // G
            qr = T.decl_buffer((D,), dtype, scope="local")
            score = T.decl_buffer((MAXC,), dtype, scope="local")
            acc = T.decl_buffer((D,), dtype, scope="local")
            stat = T.decl_buffer((2,), dtype, scope="local")
            part = T.decl_buffer((LANES,), dtype, scope="local")
            for d in T.serial(HALF):
                x1 = Q[0, s, h * D + d]
                x2 = Q[0, s, h * D + d + HALF]
                c = COS[past + s, d]
                sn = SIN[past + s, d]
                qr[d] = (x1 * c - x2 * sn) * T.float32(scale)
                qr[d + HALF] = (x2 * c + x1 * sn) * T.float32(scale)
            stat[0] = T.float32(-3.0e38)
            for j in T.serial(past + s + 1):
                # q.k with LANES-wide partial sums: a vector FMA per chunk, one horizontal sum per key
                for lane in T.vectorized(LANES):
                    part[lane] = T.float32(0)
                for c in T.serial(D // LANES):
                    for lane in T.vectorized(LANES):
                        part[lane] = part[lane] + qr[c * LANES + lane] * KC[0, kh, j, c * LANES + lane]
                score[j] = T.float32(0)
                for lane in T.serial(LANES):
                    score[j] = score[j] + part[lane]
                stat[0] = T.max(stat[0], score[j])
            stat[1] = T.float32(0)
            for d in T.serial(D):
                acc[d] = T.float32(0)
            for j in T.serial(past + s + 1):
                p = T.exp(score[j] - stat[0])
                stat[1] = stat[1] + p
                for c in T.serial(D // LANES):
                    for lane in T.vectorized(LANES):
                        acc[c * LANES + lane] = acc[c * LANES + lane] + p * VC[0, kh, j, c * LANES + lane]
            for d in T.serial(D):
                OUT[0, s, h * D + d] = acc[d] / stat[1]

    return cached_attention
