"""Fused attention with RoPE and an in-place KV-cache append, for GPUs (thread-bound TIR).

Same contract as ``kernels/attention.py`` (the CPU kernel): for ``seq`` new tokens starting at
``past_len`` it rotates q and k (rotate-half RoPE from tables), writes k/v into the caches at their
positions and computes causal GQA attention over cache positions ``0 .. past + i``. Two launches:

1. append: one block per (kv head, token) (a 2-D grid), ``D/2`` threads; thread ``t`` rotates the pair
   (t, t + D/2) of k and copies v[t], v[t + D/2] into the caches.
2. attention: one block per (head, query) (2-D grid), ``T = D`` threads (one per output dimension), keys in
   tiles of ``T`` with an online softmax (flash-decoding style, running max and sum):
   thread ``t`` scores key ``tile*T + t`` against the rotated query held in shared memory, the
   tile's max and sum come from a shared-memory array every thread reads (broadcast reads, no
   bank conflicts), then thread ``t`` accumulates ``p_j * V[j, t]`` over the tile for its output
   dimension. Shared memory is ``3*T`` floats whatever the context length, so it fits WebGPU's
   16 KiB and Adreno's local memory, and the softmax needs no ``max_context``-sized buffer.

The launches are separate device kernels (the append must be complete before any block reads
the cache). The kernel carries ``tirx.is_scheduled`` so no template touches it.

Variants (Gemma 2/3, Mistral), built only when asked for, so plain kernels are unchanged:

* ``window`` W > 0: sliding-window attention, the query at position p sees keys ``p - W < j <= p``
  (HF / llama.cpp: masked when ``p - j >= W``). Key tiles wholly before the window are skipped and
  keys outside it are neither scored nor read from V.
* ``softcap`` C > 0: logit soft-capping, the score ``s = (q . k) * scale`` becomes ``C * tanh(s / C)``
  before the mask and the softmax.
"""

from __future__ import annotations

import math
from typing import Any

import tvm
from tvm.script import tirx as T


def cached_attention_kernel_gpu(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_context: int,
    dtype: str = "float32",
    index_dtype: str = "int64",
    window: int = 0,
    softcap: float = 0.0,
) -> Any:
    """Build the GPU PrimFunc for one attention configuration (shape constants baked in).

    ``index_dtype`` is the element type of ``past_len``: int32 on targets without 64-bit integers
    (WebGPU), where the compiler also narrows every index expression to int32. ``window``: sliding
    window in tokens (0 = plain causal); ``softcap``: logit soft-cap (0 = none); see the module doc."""
    H, KVH, D, MAXC = num_heads, num_kv_heads, head_dim, max_context
    G = H // KVH
    HALF = D // 2
    TS = D  # threads per attention block = key tile = head_dim
    scale = 1.0 / math.sqrt(D)
    if D % 2 or D > 1024:
        raise ValueError(f"head_dim {D} must be even and at most 1024 for the GPU attention kernel")
    W, CAP = int(window), float(softcap)
    if W < 0 or CAP < 0:
        raise ValueError(f"attention window {window} and softcap {softcap} must be >= 0")

    # The variants enter through these expressions (and the parse-time ``if CAP``): with W = 0 they
    # are exactly the plain kernel's, so its IR (and tuning records, digests) do not change.
    def visible(j: Any, length: Any) -> Any:
        """Key j is attended by the query whose keys are 0 .. length - 1: causal, inside the window."""
        if W == 0:
            return j < length
        return tvm.tirx.And(j < length, length - j <= T.int64(W))

    def first_tile(length: Any) -> Any:
        """The first key tile holding a visible key: tiles wholly before the window are skipped."""
        if W == 0:
            return T.int64(0)
        return T.max(length - T.int64(W), T.int64(0)) // T.int64(TS)

    @T.prim_func(private=True)
    def cached_attention_gpu(
        q_h: T.handle,
        k_h: T.handle,
        v_h: T.handle,
        kc_h: T.handle,
        vc_h: T.handle,
        past_h: T.handle,
        cos_h: T.handle,
        sin_h: T.handle,
        out_h: T.handle,
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
        # 1) rotate k, append k and v to the caches. A 2-D grid (kv head, token): no division by the
        # symbolic seq, whose int64 div/mod chains cost registers (sm_90a spilled with bx // seq)
        for kh in T.thread_binding(T.int64(KVH), thread="blockIdx.x"):
            for s in T.thread_binding(seq, thread="blockIdx.y"):
                for tx in T.thread_binding(T.int64(HALF), thread="threadIdx.x"):
                    pos: T.let[T.int64] = T.Cast("int64", PAST[0]) + s
                    x1: T.let[T.float32] = K[0, s, kh * D + tx]
                    x2: T.let[T.float32] = K[0, s, kh * D + tx + HALF]
                    c: T.let[T.float32] = COS[pos, tx]
                    sn: T.let[T.float32] = SIN[pos, tx]
                    KC[0, kh, pos, tx] = x1 * c - x2 * sn
                    KC[0, kh, pos, tx + HALF] = x2 * c + x1 * sn
                    VC[0, kh, pos, tx] = V[0, s, kh * D + tx]
                    VC[0, kh, pos, tx + HALF] = V[0, s, kh * D + tx + HALF]
        # 2) attention for every (head, query): grid (head, query), D threads
        for h in T.thread_binding(T.int64(H), thread="blockIdx.x"):
            for s in T.thread_binding(seq, thread="blockIdx.y"):
                for tx in T.thread_binding(T.int64(TS), thread="threadIdx.x"):
                    qs = T.decl_buffer((D,), dtype, scope="shared")
                    tile = T.decl_buffer((TS,), dtype, scope="shared")
                    st = T.decl_buffer((4,), dtype, scope="local")  # running max, running sum, acc, score
                    kh: T.let[T.int64] = h // G
                    pos: T.let[T.int64] = T.Cast("int64", PAST[0]) + s
                    length: T.let[T.int64] = pos + T.int64(1)
                    if tx < T.int64(HALF):
                        x1: T.let[T.float32] = Q[0, s, h * D + tx]
                        x2: T.let[T.float32] = Q[0, s, h * D + tx + HALF]
                        c: T.let[T.float32] = COS[pos, tx]
                        sn: T.let[T.float32] = SIN[pos, tx]
                        qs[tx] = (x1 * c - x2 * sn) * T.float32(scale)
                        qs[tx + HALF] = (x2 * c + x1 * sn) * T.float32(scale)
                    T.tvm_storage_sync("shared")
                    st[0] = T.float32(-3.0e38)
                    st[1] = T.float32(0)
                    st[2] = T.float32(0)
                    # (a loop from a non-zero start is safe here: no inner loop's bounds depend on kt,
                    # see paged_attention_gpu.keys)
                    for kt in T.serial(first_tile(length), (length + T.int64(TS - 1)) // T.int64(TS)):
                        j: T.let[T.int64] = kt * T.int64(TS) + tx
                        st[3] = T.float32(-3.0e38)
                        if visible(j, length):
                            st[3] = T.float32(0)
                            for d in T.serial(D):
                                st[3] = st[3] + qs[d] * KC[0, kh, j, d]
                            if CAP > 0:  # soft-capping bounds the score to (-C, C)
                                st[3] = T.float32(CAP) * T.tanh(st[3] * T.float32(1.0 / CAP))
                        tile[tx] = st[3]
                        T.tvm_storage_sync("shared")
                        m_tile = T.decl_buffer((1,), dtype, scope="local")
                        m_tile[0] = st[0]
                        for jj in T.serial(TS):
                            m_tile[0] = T.max(m_tile[0], tile[jj])
                        alpha: T.let[T.float32] = T.exp(st[0] - m_tile[0])
                        T.tvm_storage_sync("shared")
                        tile[tx] = T.if_then_else(visible(j, length), T.exp(st[3] - m_tile[0]), T.float32(0))
                        T.tvm_storage_sync("shared")
                        st[1] = st[1] * alpha
                        st[2] = st[2] * alpha
                        for jj in T.serial(TS):
                            if visible(kt * T.int64(TS) + jj, length):
                                p: T.let[T.float32] = tile[jj]
                                st[1] = st[1] + p
                                st[2] = st[2] + p * VC[0, kh, kt * T.int64(TS) + jj, tx]
                        st[0] = m_tile[0]
                        T.tvm_storage_sync("shared")
                    OUT[0, s, h * D + tx] = st[2] / st[1]

    return cached_attention_gpu
