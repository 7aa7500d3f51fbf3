"""The tiled prefill attention body, for any cache layout (contiguous rows or pages).

One task per (sequence, kv head, head group, tile of ``q_tile`` queries). The task's rows are
``heads_per_task`` query heads times ``q_tile`` queries; their rotated queries are stored transposed, so
scores, masks and the online softmax run vectorised over rows. Key tiles past the tile's last query are
skipped (causal) and only rows that cannot see a key are masked. Scores take ``key_block`` keys per
register block (each load of the transposed queries serves them all); p @ V takes a few rows per block
(each value row loaded once per block).

The cache layout enters through two Python callables evaluated while the macro is parsed:
``key_row(ctx, b, kh, j)``, the flat offset of key ``j``'s row of kv head ``kh`` of sequence ``b`` in the
flat K (and V) cache, and ``past_of(ctx, b)``, the number of tokens cached before this chunk.

Narrow caches (``kv_dtype`` float16 / int8, ``_kv_cache.py``): each cached element is widened to float32
as it is loaded; an int8 key's scale multiplies its score once after the dot product, an int8 value's
scale its softmax weight once before p @ V (after the row sums). The float32 body is built from the
original expressions, text for text.
"""

from __future__ import annotations

from typing import Any

from tvm.script import tirx as T

from perfx_compiler.kernels._attention_common import NEG, first_key, rope_store, soft_cap
from perfx_compiler.kernels._kv_cache import row_scale


def _zigzag(i: Any, n: Any) -> Any:
    """0, n-1, 1, n-2, ...: causal rows get dearer with their index, and the thread pool hands
    each thread a contiguous range of tasks; in this order every range costs about the same."""
    return T.if_then_else(i % 2 == 0, i // 2, n - 1 - i // 2)


def tiled_attention_body(
    *, heads: int, kv_heads: int, head_dim: int, max_context: int, config: dict[str, Any], lanes: int,
    window: int, softcap: float, exp: Any, key_row: Any, past_of: Any, kv_dtype: str = "float32",
) -> Any:
    """The TVMScript macro ``body(Q, KF, VF, KS, VS, COS, SIN, OUT, batch, seq, ctx)`` (Q and OUT [batch,
    seq, heads * D]; KF / VF flat caches holding the chunk's rotated keys and values already; KS / VS the
    float32 views of int8 caches that hold the rows' scales, unused otherwise). ``config``: ``q_tile``,
    ``heads_per_task``, ``k_tile``, ``key_block``."""
    H, KVH, D, MAXC, L = heads, kv_heads, head_dim, max_context, lanes
    G = H // KVH
    HALF = D // 2
    KT = int(config.get("k_tile", 32))
    QT = int(config.get("q_tile", 8))
    HPT = int(config.get("heads_per_task", G))
    JB = int(config.get("key_block", 4))  # keys per register block of the score loop
    if G % HPT or QT < 1:
        raise ValueError(f"attention: heads_per_task {HPT} must divide {G}")
    if JB < 1 or KT % JB:
        raise ValueError(f"attention: key_block {JB} must divide k_tile {KT}")
    HG = G // HPT
    R = HPT * QT  # rows of a task: query r // HPT of the tile, head r % HPT of the group
    RP = -(-R // L) * L
    RV = RP // L
    RB = next(b for b in (4, 3, 2, 1) if R % b == 0 and b * D // L <= 16)  # rows per block of p @ V
    WIN, CAP = int(window), float(softcap)
    scale = 1.0 / (D**0.5)

    def lo_key(pos: Any) -> Any:
        return first_key(pos, WIN)

    def visible(j: Any, pos: Any) -> Any:
        """Key j is seen by the query at pos (causal, and inside the window when there is one)."""
        return T.And(j <= pos, pos - j < WIN) if WIN > 0 else j <= pos

    def capped(x: Any) -> Any:
        return soft_cap(x, CAP) if CAP > 0 else x

    def cached(buf: Any, off: Any) -> Any:
        """A cache element as float32 (float32 caches: the load itself)."""
        return buf[off] if kv_dtype == "float32" else T.Cast("float32", buf[off])

    def key_scaled(x: Any, KS: Any, off: Any) -> Any:  # noqa: N803
        """A score times its int8 key row's scale (other caches: the score itself)."""
        return x * row_scale(KS, off, D, kv_dtype) if kv_dtype == "int8" else x

    int8 = kv_dtype == "int8"  # (a bool for TVMScript's `if`)

    @T.macro
    def body(Q, KF, VF, KS, VS, COS, SIN, OUT, batch, seq, ctx):
        nq = (seq + QT - 1) // QT
        for task in T.parallel(batch * KVH * HG * nq):
            b = task // (KVH * HG * nq)
            t = task % (KVH * HG * nq)
            past = past_of(ctx, b)
            kh = t % (KVH * HG) // HG
            h0 = kh * G + t % HG * HPT
            q0 = _zigzag(t // (KVH * HG), nq) * QT
            last = T.min(past + T.min(q0 + QT, seq) - 1, MAXC - 1)  # position of the tile's last query
            qt_ = T.decl_buffer((D * RP,), "float32", scope="local")  # rotated q, transposed
            st_ = T.decl_buffer((KT * RP,), "float32", scope="local")  # scores, then weights
            acc = T.decl_buffer((R * D,), "float32", scope="local")
            ar = T.decl_buffer((RB * D,), "float32", scope="local")
            sacc = T.decl_buffer((JB * RP,), "float32", scope="local")
            mx = T.decl_buffer((RP,), "float32", scope="local")
            rs = T.decl_buffer((3 * RP,), "float32", scope="local")  # running max | sum | rescale
            lim = T.decl_buffer((RP,), "int64", scope="local")  # each row's query position
            for r in T.serial(RP):
                rope_store(qt_, r, RP, Q, b, T.min(q0 + r // HPT, seq - 1), (h0 + r % HPT) * D, COS, SIN,
                           T.min(past + T.min(q0 + r // HPT, seq - 1), MAXC - 1), HALF, T.float32(scale))
                lim[r] = T.min(past + T.min(q0 + r // HPT, seq - 1), MAXC - 1)
                rs[r] = T.float32(NEG)
                rs[RP + r] = T.float32(0)
            for i in T.vectorized(R * D):
                acc[i] = T.float32(0)
            # key tiles from the one holding the first row's first key (0 without a window) to ``last``
            for kt in T.serial(lo_key(T.min(past + q0, MAXC - 1)) // KT, last // KT + 1):
                # scores of the tile's keys (only keys <= last: causal skip), masked per row; key rows
                # past ``last`` are read clamped and masked
                for jb in T.serial((T.min(KT, last + 1 - kt * KT) + JB - 1) // JB):
                    for u in T.unroll(JB):
                        for rv in T.unroll(RV):
                            for lane in T.vectorized(L):
                                sacc[(u * RV + rv) * L + lane] = T.float32(0)
                    for d in T.serial(D):
                        for u in T.unroll(JB):
                            for rv in T.unroll(RV):
                                for lane in T.vectorized(L):
                                    sacc[(u * RV + rv) * L + lane] = sacc[(u * RV + rv) * L + lane] + qt_[
                                        d * RP + rv * L + lane
                                    ] * cached(KF, key_row(ctx, b, kh, T.min(kt * KT + jb * JB + u, last)) + d)
                    for u in T.unroll(JB):
                        for rv in T.unroll(RV):
                            for lane in T.vectorized(L):
                                st_[(jb * JB + u) * RP + rv * L + lane] = T.if_then_else(
                                    visible(kt * KT + jb * JB + u, lim[rv * L + lane]),
                                    capped(key_scaled(sacc[(u * RV + rv) * L + lane], KS,
                                                      key_row(ctx, b, kh, T.min(kt * KT + jb * JB + u, last)))),
                                    T.float32(NEG),
                                )
                # online softmax, vectorised over rows
                for rv in T.serial(RV):
                    for lane in T.vectorized(L):
                        mx[rv * L + lane] = rs[rv * L + lane]
                    for jj in T.serial(T.min(KT, last + 1 - kt * KT)):
                        for lane in T.vectorized(L):
                            mx[rv * L + lane] = T.max(mx[rv * L + lane], st_[jj * RP + rv * L + lane])
                    for lane in T.vectorized(L):
                        rs[2 * RP + rv * L + lane] = exp(rs[rv * L + lane] - mx[rv * L + lane])
                        rs[RP + rv * L + lane] = rs[RP + rv * L + lane] * rs[2 * RP + rv * L + lane]
                        rs[rv * L + lane] = mx[rv * L + lane]
                    for jj in T.serial(T.min(KT, last + 1 - kt * KT)):
                        for lane in T.vectorized(L):
                            st_[jj * RP + rv * L + lane] = T.if_then_else(
                                visible(kt * KT + jj, lim[rv * L + lane]),
                                exp(st_[jj * RP + rv * L + lane] - mx[rv * L + lane]),
                                T.float32(0),
                            )
                            rs[RP + rv * L + lane] = rs[RP + rv * L + lane] + st_[jj * RP + rv * L + lane]
                if int8:  # each weight times its value row's scale (the row sums above stay unscaled)
                    for jj in T.serial(T.min(KT, last + 1 - kt * KT)):
                        for i in T.vectorized(RP):
                            st_[jj * RP + i] = st_[jj * RP + i] * row_scale(VS, key_row(ctx, b, kh, kt * KT + jj), D,
                                                                            kv_dtype)
                # output rows, RB at a time: rescale, add p @ V (the block's rows stay in registers)
                for rb in T.serial(R // RB):
                    for u in T.unroll(RB):
                        for d in T.vectorized(D):
                            ar[u * D + d] = acc[(rb * RB + u) * D + d] * rs[2 * RP + rb * RB + u]
                    for jj in T.serial(T.min(KT, last + 1 - kt * KT)):
                        for c in T.unroll(D // L):
                            for u in T.unroll(RB):
                                for lane in T.vectorized(L):
                                    ar[u * D + c * L + lane] = ar[u * D + c * L + lane] + st_[
                                        jj * RP + rb * RB + u
                                    ] * cached(VF, key_row(ctx, b, kh, kt * KT + jj) + c * L + lane)
                    for u in T.unroll(RB):
                        for d in T.vectorized(D):
                            acc[(rb * RB + u) * D + d] = ar[u * D + d]
            for r in T.serial(R):
                if q0 + r // HPT < seq:
                    for d in T.vectorized(D):
                        OUT[b, q0 + r // HPT, (h0 + r % HPT) * D + d] = acc[r * D + d] / rs[RP + r]

    return body
