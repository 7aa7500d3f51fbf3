"""Fused RoPE + paged-KV append + causal GQA attention for a batch of sequences, for GPUs.

Same contract as ``kernels/paged_attention.py`` (the CPU kernel): sequence ``b`` has ``positions[b]``
tokens cached in the pages ``page_table[b]`` lists; its ``seq`` new tokens are rotated, written to
(page, slot) = (page_table[b, p // PS], p % PS) of the [pages, PS, KVH, D] pools in place, and
query ``s`` attends over cache positions ``0 .. positions[b] + s``. Two launches (the append must be
complete before any block reads the pools):

1. append: one block per (kv head, sequence), ``D/2`` threads; thread ``t`` rotates the pair
   (t, t + D/2) of each new k row and copies v[t], v[t + D/2].
2. attention: one block per (head, sequence), ``T`` threads (the power of two >= D, at most
   ``max_threads``), the sequence's queries in turn (decode: one). Keys come in tiles of ``T``:
   thread ``t`` scores key ``tile*T + t`` against the rotated query in shared memory; the tile's
   max and the sum of its weights are tree reductions across the block's threads in shared memory
   (log2 T steps); then thread ``d < D`` adds ``sum_j p_j * V[j, d]`` to its output dimension,
   all under an online softmax (running max and sum, rescaled per tile). Shared memory is
   ``D + 2T`` floats, whatever the context length (WebGPU's 16 KiB holds it).

The kernel carries ``tirx.is_scheduled`` so no template touches it.
"""

from __future__ import annotations

import math

from tvm.script import tirx as T

NEG = -3.0e38  # finite "minus infinity": exp(NEG - m) is 0, never NaN


def paged_threads(head_dim: int, max_threads: int = 256) -> int:
    """Threads of an attention block: the power of two >= head_dim (one thread per output dimension)."""
    t = 1
    while t < head_dim:
        t *= 2
    if t > max_threads:
        raise ValueError(f"head_dim {head_dim} needs {t} threads a block, more than the target's {max_threads}")
    return t


def paged_attention_kernel_gpu(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_context: int,
    page_size: int,
    dtype: str = "float32",
    index_dtype: str = "int64",
    threads: int | None = None,
):
    """The GPU PrimFunc for one configuration (shape constants baked in). ``index_dtype``: element
    type of ``positions`` and ``page_table`` (int32 on WebGPU, where the compiler narrows every index)."""
    H, KVH, D, MAXC, PS = num_heads, num_kv_heads, head_dim, max_context, page_size
    NPP = -(-MAXC // PS)  # pages per sequence
    G = H // KVH
    HALF = D // 2
    TS = threads or paged_threads(D)
    LOG = TS.bit_length() - 1
    scale = 1.0 / math.sqrt(D)
    if H % KVH or D % 2 or TS < D or TS & (TS - 1):
        raise ValueError(f"paged attention (GPU): bad shape H={H} KVH={KVH} D={D} threads={TS}")

    @T.prim_func(private=True)
    def paged_attention_gpu(
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
        # 1) rotate k, append k and v at each new token's (page, slot): grid (kv head, sequence)
        for kh in T.thread_binding(T.int64(KVH), thread="blockIdx.x"):
            for b in T.thread_binding(batch, thread="blockIdx.y"):
                for tx in T.thread_binding(T.int64(HALF), thread="threadIdx.x"):
                    for s in T.serial(seq):
                        p: T.let[T.int64] = T.Cast("int64", POS[b]) + s
                        page: T.let[T.int64] = T.Cast("int64", PT[b, p // PS])
                        x1: T.let[T.float32] = K[b, s, kh * D + tx]
                        x2: T.let[T.float32] = K[b, s, kh * D + tx + HALF]
                        c: T.let[T.float32] = COS[p, tx]
                        sn: T.let[T.float32] = SIN[p, tx]
                        KP[page, p % PS, kh, tx] = x1 * c - x2 * sn
                        KP[page, p % PS, kh, tx + HALF] = x2 * c + x1 * sn
                        VP[page, p % PS, kh, tx] = V[b, s, kh * D + tx]
                        VP[page, p % PS, kh, tx + HALF] = V[b, s, kh * D + tx + HALF]
        # 2) attention: grid (head, sequence), TS threads, the sequence's queries in turn
        for h in T.thread_binding(T.int64(H), thread="blockIdx.x"):
            for b in T.thread_binding(batch, thread="blockIdx.y"):
                for tx in T.thread_binding(T.int64(TS), thread="threadIdx.x"):
                    qs = T.decl_buffer((D,), "float32", scope="shared")  # rotated, scaled query
                    red = T.decl_buffer((TS,), "float32", scope="shared")  # tree reductions
                    wt = T.decl_buffer((TS,), "float32", scope="shared")  # the tile's weights
                    st = T.decl_buffer((5,), "float32", scope="local")  # max, sum, acc, score, tile max
                    kh: T.let[T.int64] = h // G
                    for s in T.serial(seq):
                        p: T.let[T.int64] = T.Cast("int64", POS[b]) + s
                        if tx < T.int64(HALF):
                            x1: T.let[T.float32] = Q[b, s, h * D + tx]
                            x2: T.let[T.float32] = Q[b, s, h * D + tx + HALF]
                            c: T.let[T.float32] = COS[p, tx]
                            sn: T.let[T.float32] = SIN[p, tx]
                            qs[tx] = (x1 * c - x2 * sn) * T.float32(scale)
                            qs[tx + HALF] = (x2 * c + x1 * sn) * T.float32(scale)
                        T.tvm_storage_sync("shared")
                        st[0] = T.float32(NEG)
                        st[1] = T.float32(0)
                        st[2] = T.float32(0)
                        for kt in T.serial(p // T.int64(TS) + T.int64(1)):
                            j: T.let[T.int64] = kt * T.int64(TS) + tx
                            st[3] = T.float32(NEG)
                            if j <= p:
                                kb: T.let[T.int64] = T.Cast("int64", PT[b, j // PS])
                                st[3] = T.float32(0)
                                for d in T.serial(D):
                                    st[3] = st[3] + qs[d] * KP[kb, j % PS, kh, d]
                            red[tx] = st[3]
                            T.tvm_storage_sync("shared")
                            for lv in T.serial(LOG):  # tree max: red[0] = the tile's max score
                                if tx < T.shift_right(T.int64(TS // 2), lv):
                                    red[tx] = T.max(red[tx], red[tx + T.shift_right(T.int64(TS // 2), lv)])
                                T.tvm_storage_sync("shared")
                            st[4] = T.max(st[0], red[0])
                            T.tvm_storage_sync("shared")  # every thread has red[0] before it is rewritten
                            wt[tx] = T.if_then_else(j <= p, T.exp(st[3] - st[4]), T.float32(0))
                            red[tx] = wt[tx]
                            T.tvm_storage_sync("shared")
                            for lv in T.serial(LOG):  # tree sum: red[0] = the tile's weight sum
                                if tx < T.shift_right(T.int64(TS // 2), lv):
                                    red[tx] = red[tx] + red[tx + T.shift_right(T.int64(TS // 2), lv)]
                                T.tvm_storage_sync("shared")
                            alpha: T.let[T.float32] = T.exp(st[0] - st[4])
                            st[1] = st[1] * alpha + red[0]
                            st[2] = st[2] * alpha
                            if tx < T.int64(D):
                                for jj in T.serial(T.min(T.int64(TS), p + T.int64(1) - kt * T.int64(TS))):
                                    vb: T.let[T.int64] = T.Cast("int64", PT[b, (kt * T.int64(TS) + jj) // PS])
                                    st[2] = st[2] + wt[jj] * VP[vb, (kt * T.int64(TS) + jj) % PS, kh, tx]
                            st[0] = st[4]
                            T.tvm_storage_sync("shared")  # red / wt are rewritten by the next tile
                        if tx < T.int64(D):
                            OUT[b, s, h * D + tx] = st[2] / st[1]

    return paged_attention_gpu
