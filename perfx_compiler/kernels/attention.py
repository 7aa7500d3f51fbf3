"""Fused attention with RoPE and an in-place KV-cache append (one TIR kernel), for CPUs.

One kernel does, for a chunk of ``seq`` new tokens starting at ``past_len``: RoPE on q and k
(rotate-half, table lookup), k/v written into the caches at their positions (in place: the
compiler calls it with ``call_tir_inplace``), then causal GQA attention of each query over cache
positions ``0 .. past_len + i`` with an online softmax over tiles of keys. Three bodies:

* ``rows`` (the untuned default and the tuner's reference): one task per (kv head, query); the
  task's rows are the query heads sharing that kv head, so each key/value row is loaded once.
* ``tiled`` (prefill): one task per (kv head, head group, tile of ``q_tile`` queries). The rotated
  queries are stored transposed, so scores, masks and the softmax run vectorised over the
  task's rows; key tiles past the tile's last query are skipped (causal), and only the diagonal
  tiles are masked.
* ``split`` (decode, ``seq == 1``): the cache is cut into ``splits`` chunks per kv head, one task
  each; the task whose chunk holds the new position appends its kv head's k/v row first (inside
  the parallel loop: the launching thread does no serial append before the fork). With one split
  the task writes its heads' output; with more, the partial (max, sum, output) of each chunk are
  merged afterwards on the launching thread (log-sum-exp). With ``prefetch`` > 0 each task requests its
  cached k/v rows that many keys ahead of the score loop (a decode step's weight stream has evicted them).

Variants (Gemma 2/3, Mistral): ``window`` (sliding window: the query at p sees keys p - window < j <= p;
the rows and split bodies start their key loops at the window's first key, the tiled body at the tile
holding its first row's first key and masks per row) and ``softcap`` (scores capped to
softcap * tanh(s / softcap) before the mask). Both 0 build the plain kernel, text for text.

Per-task buffers are declared inside the parallel loop but outside every per-query/per-key loop:
each is one allocation per task. ``schedules/attention_cpu.py`` chooses the body and its knobs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tvm.script import tirx as T

from perfx_compiler.kernels._attention_common import (
    NEG,
    ROWS_SCRATCH,
    copy_row,
    fast_exp,
    first_key,
    lanes_for,
    prefetch_kv_row,
    rope_store,
    softmax_init,
    tile_pv,
    tile_scores,
    tile_softcap,
    tile_softmax,
)
from perfx_compiler.kernels._attention_tiled import _zigzag, tiled_attention_body
from perfx_compiler.kernels._kv_cache import append_row, kv_dtype, row_stride, tile_pv_kv, tile_scores_kv
from perfx_compiler.kernels.memo import memoized_kernel

ATTR = "perfx.attention"  # JSON facts on the untuned kernels, read by the template


def _kb(ctx: Any, j: Any) -> Any:
    """Flat offset of key j's row in a [KVH, MAXC, D] cache: ctx = (kh * MAXC, D)."""
    return (ctx[0] + j) * ctx[1]


@dataclass(frozen=True)
class _Plan:
    """One attention kernel's shape constants and options (the macros below close over them)."""

    H: int  # query heads
    KVH: int  # kv heads
    D: int  # head dim
    MAXC: int  # cache positions
    G: int  # query heads per kv head
    HALF: int  # D // 2 (RoPE's rotate-half)
    L: int  # vector lanes
    KT: int  # keys per tile
    KVD: str  # the caches' element type
    KV32: bool  # a float32 cache: the kernel is built from the original pieces, text for text
    RS: int  # cache elements per (kv head, position) row
    WIN: int  # sliding window (0: none)
    CAP: float  # score softcap (0: none)
    scale: float  # 1 / sqrt(D)


def _append_and_rows_body(p: _Plan) -> tuple[Any, Any]:
    """(append_kv, rows_body): the chunk's k/v rows into the caches, and the rows body (one task per
    (kv head, query), rows = the query heads sharing that kv head)."""
    KVH, D, MAXC, G, HALF, L, KT = p.KVH, p.D, p.MAXC, p.G, p.HALF, p.L, p.KT
    KVD, KV32, RS, WIN, CAP, scale = p.KVD, p.KV32, p.RS, p.WIN, p.CAP, p.scale
    exp = fast_exp

    def lo_key(pos: Any) -> Any:
        return first_key(pos, WIN)

    @T.macro
    def append_kv(Q, K, V, KF, VF, KS, VS, COS, SIN, past, seq):
        if seq == 1:
            # decode: one row per KV head, far less work than a parallel launch's fork/join costs
            for kh in T.serial(KVH):
                if past < MAXC:
                    if not KV32:
                        append_row(KF, KS, VF, VS, (kh * MAXC + past) * RS, K, V, 0, 0, kh * D, COS, SIN, past, D, KVD)
                    else:
                        rope_store(KF, (kh * MAXC + past) * D, 1, K, 0, 0, kh * D, COS, SIN, past, HALF, T.float32(1))
                        copy_row(VF, (kh * MAXC + past) * D, V, 0, 0, kh * D, D)
        else:
            for t in T.parallel(KVH * seq):
                kh = t // seq
                s = t % seq
                if past + s < MAXC:  # a chunk past the cache's end writes nothing (memory-safe for any input)
                    if not KV32:
                        append_row(KF, KS, VF, VS, (kh * MAXC + past + s) * RS, K, V, 0, s, kh * D, COS, SIN, past + s,
                                   D, KVD)
                    else:
                        rope_store(KF, (kh * MAXC + past + s) * D, 1, K, 0, s, kh * D, COS, SIN, past + s, HALF,
                                   T.float32(1))
                        copy_row(VF, (kh * MAXC + past + s) * D, V, 0, s, kh * D, D)

    @T.macro
    def rows_body(Q, KF, VF, KS, VS, COS, SIN, OUT, past, seq):
        for t in T.parallel(KVH * seq):
            kh = t % KVH
            s = _zigzag(t // KVH, seq)
            pos = T.min(past + s, MAXC - 1)
            qr = T.decl_buffer((G * D,), "float32", scope="local")
            sc = T.decl_buffer((G * KT,), "float32", scope="local")
            racc = T.decl_buffer((G * D,), "float32", scope="local")
            st = T.decl_buffer((3 * G,), "float32", scope="local")  # running max | sum | rescale
            for g in T.serial(G):
                rope_store(qr, g * D, 1, Q, 0, s, (kh * G + g) * D, COS, SIN, pos, HALF, T.float32(scale))
            softmax_init(st, racc, G, D)
            # keys lo_key(pos) .. pos in tiles (lo_key is 0 without a window: the terms fold away)
            for kt in T.serial((pos - lo_key(pos)) // KT + 1):
                if not KV32:
                    tile_scores_kv(sc, qr, KF, KS, _kb, (kh * MAXC, RS), lo_key(pos) + kt * KT,
                                   T.min(KT, pos + 1 - lo_key(pos) - kt * KT), G, D, KT, L, KVD)
                else:
                    tile_scores(sc, qr, KF, VF, _kb, (kh * MAXC, D), lo_key(pos) + kt * KT,
                                T.min(KT, pos + 1 - lo_key(pos) - kt * KT), G, D, KT, L, 0, 0)
                if CAP > 0:
                    tile_softcap(sc, G, KT, CAP)
                tile_softmax(sc, st, T.min(KT, pos + 1 - lo_key(pos) - kt * KT), G, KT, exp)
                if not KV32:
                    tile_pv_kv(racc, sc, st, VF, VS, _kb, (kh * MAXC, RS), lo_key(pos) + kt * KT,
                               T.min(KT, pos + 1 - lo_key(pos) - kt * KT), G, D, KT, L, KVD)
                else:
                    tile_pv(racc, sc, st, VF, _kb, (kh * MAXC, D), lo_key(pos) + kt * KT,
                            T.min(KT, pos + 1 - lo_key(pos) - kt * KT), G, D, KT, L)
            for g in T.serial(G):
                for d in T.vectorized(D):
                    OUT[0, s, (kh * G + g) * D + d] = racc[g * D + d] / st[G + g]

    return append_kv, rows_body


def _split_step_body(p: _Plan, cfg: dict[str, Any], append_kv: Any, rows_body: Any) -> Any:
    """The step of the split body: at seq == 1 the cache cut into ``splits`` chunks per kv head, one
    task each, merged by log-sum-exp; other lengths append and take the rows body."""
    H, KVH, D, MAXC, G, HALF, L, KT = p.H, p.KVH, p.D, p.MAXC, p.G, p.HALF, p.L, p.KT
    KVD, KV32, RS, WIN, CAP, scale = p.KVD, p.KV32, p.RS, p.WIN, p.CAP, p.scale
    exp = fast_exp

    def lo_key(pos: Any) -> Any:
        return first_key(pos, WIN)

    SPL = int(cfg.get("splits", 2))
    # keys ahead whose cached rows are prefetched (0: none; the narrow caches' rows are not prefetched)
    PF = int(cfg.get("prefetch", 0)) if KV32 else 0
    if SPL < 1 or PF < 0:
        raise ValueError(f"attention: splits {SPL} must be >= 1")
    W = D + 2  # one partial: output row, max, sum

    @T.macro
    def split_task(Q, K, V, KF, VF, KS, VS, COS, SIN, OUT, ws, past, ch, t):
        # Task t: chunk t % SPL of kv head t // SPL. The chunk holding `past` first appends the new
        # k/v row of its kv head (no other task reads that row), so the step's new rows are written
        # where they are read, not on the launching thread before the fork.
        kh = t // SPL
        lo = lo_key(past) + t % SPL * ch  # the chunks cover lo_key(past) .. past
        hi = T.min(past + 1, lo + ch)
        if lo <= past and past < lo + ch:
            if not KV32:
                append_row(KF, KS, VF, VS, (kh * MAXC + past) * RS, K, V, 0, 0, kh * D, COS, SIN, past, D, KVD)
            else:
                rope_store(KF, (kh * MAXC + past) * D, 1, K, 0, 0, kh * D, COS, SIN, past, HALF, T.float32(1))
                copy_row(VF, (kh * MAXC + past) * D, V, 0, 0, kh * D, D)
        qr = T.decl_buffer((G * D,), "float32", scope="local")
        sc = T.decl_buffer((G * KT,), "float32", scope="local")
        racc = T.decl_buffer((G * D,), "float32", scope="local")
        st = T.decl_buffer((3 * G,), "float32", scope="local")
        for g in T.serial(G):
            rope_store(qr, g * D, 1, Q, 0, 0, (kh * G + g) * D, COS, SIN, past, HALF, T.float32(scale))
        softmax_init(st, racc, G, D)
        if PF > 0:  # the first PF rows; the score loop requests each later row PF keys ahead
            for j in T.serial(T.min(PF, T.max(hi - lo, 0))):
                prefetch_kv_row(KF, VF, _kb((kh * MAXC, D), lo + j), D)
        for kt in T.serial((T.max(hi - lo, 0) + KT - 1) // KT):
            if not KV32:
                tile_scores_kv(sc, qr, KF, KS, _kb, (kh * MAXC, RS), lo + kt * KT, T.min(KT, hi - lo - kt * KT),
                               G, D, KT, L, KVD)
            else:
                tile_scores(sc, qr, KF, VF, _kb, (kh * MAXC, D), lo + kt * KT, T.min(KT, hi - lo - kt * KT),
                            G, D, KT, L, PF, hi)
            if CAP > 0:
                tile_softcap(sc, G, KT, CAP)
            tile_softmax(sc, st, T.min(KT, hi - lo - kt * KT), G, KT, exp)
            if not KV32:
                tile_pv_kv(racc, sc, st, VF, VS, _kb, (kh * MAXC, RS), lo + kt * KT,
                           T.min(KT, hi - lo - kt * KT), G, D, KT, L, KVD)
            else:
                tile_pv(racc, sc, st, VF, _kb, (kh * MAXC, D), lo + kt * KT,
                        T.min(KT, hi - lo - kt * KT), G, D, KT, L)
        if SPL == 1:  # one chunk per kv head: the task's heads are final, no partials to merge
            for g in T.serial(G):
                for d in T.vectorized(D):
                    OUT[0, 0, (kh * G + g) * D + d] = racc[g * D + d] / st[G + g]
        else:
            for g in T.serial(G):
                for d in T.vectorized(D):
                    ws[(t * G + g) * W + d] = racc[g * D + d]
                ws[(t * G + g) * W + D] = st[g]
                ws[(t * G + g) * W + D + 1] = st[G + g]

    @T.macro
    def merge_chunks(ws, OUT):
        # weights exp(m_c - M) (an empty chunk has m = NEG, l = 0: weight 0)
        for h in T.serial(H):
            cm = T.decl_buffer((2,), "float32", scope="local")
            ao = T.decl_buffer((D,), "float32", scope="local")
            cm[0] = T.float32(NEG)
            for sp in T.serial(SPL):
                cm[0] = T.max(cm[0], ws[((h // G * SPL + sp) * G + h % G) * W + D])
            cm[1] = T.float32(0)
            for d in T.vectorized(D):
                ao[d] = T.float32(0)
            for sp in T.serial(SPL):
                cw = T.exp(ws[((h // G * SPL + sp) * G + h % G) * W + D] - cm[0])
                cm[1] = cm[1] + cw * ws[((h // G * SPL + sp) * G + h % G) * W + D + 1]
                for d in T.vectorized(D):
                    ao[d] = ao[d] + cw * ws[((h // G * SPL + sp) * G + h % G) * W + d]
            for d in T.vectorized(D):
                OUT[0, 0, h * D + d] = ao[d] / cm[1]

    @T.macro
    def step_body(Q, K, V, KF, VF, KS, VS, COS, SIN, OUT, past, seq):
        if seq == 1 and past < MAXC:
            # chunk: ceil(ctx / SPL) in whole tiles, ctx = the keys the query sees (past + 1 without a window)
            ch = ((past - lo_key(past) + SPL) // SPL + KT - 1) // KT * KT
            if SPL == 1:
                for t in T.parallel(KVH):  # no partials: OUT stands in for the unused ws
                    split_task(Q, K, V, KF, VF, KS, VS, COS, SIN, OUT, OUT, past, ch, t)
            else:
                ws = T.decl_buffer((KVH * SPL * G * W,), "float32")
                for t in T.parallel(KVH * SPL):
                    split_task(Q, K, V, KF, VF, KS, VS, COS, SIN, OUT, ws, past, ch, t)
                merge_chunks(ws, OUT)
        else:
            append_kv(Q, K, V, KF, VF, KS, VS, COS, SIN, past, seq)
            rows_body(Q, KF, VF, KS, VS, COS, SIN, OUT, past, seq)

    return step_body


@memoized_kernel
def cached_attention_kernel(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_context: int,
    dtype: str = "float32",
    index_dtype: str = "int64",
    config: dict[str, Any] | None = None,
    window: int = 0,
    softcap: float = 0.0,
    kv_cache: str = "float32",
) -> Any:
    """Build the PrimFunc for one attention configuration (shape constants baked in).

    ``window`` > 0: sliding-window attention, the query at position p sees keys p - window < j <= p
    (0: plain causal); key loops start at the window's first key, so the work is proportional to
    the window. ``softcap`` > 0: each score s becomes softcap * tanh(s / softcap) before the mask and
    softmax (0: none). With both 0 the kernel is the plain one, text for text.

    ``index_dtype`` is the element type of ``past_len`` (the graph's integer inputs).
    ``config``: ``{"body": "rows" | "tiled", "k_tile", "q_tile", "heads_per_task", "key_block", "lanes"}`` for
    any ``seq``, or ``{"body": "split", "k_tile", "splits", "lanes"}`` (seq == 1 takes the split
    body, other lengths the rows body). None: the rows body with defaults.

    ``kv_cache``: the caches' element type, "float32" | "float16" | "int8" (kernels/_kv_cache.py: int8 rows
    are D int8 + a float32 scale, the cache [1, KVH, MAXC, D + 4]); the narrow ones widen each element to
    float32 as it is loaded (no decode prefetch)."""
    cfg = dict(config or {})
    H, KVH, D, MAXC = num_heads, num_kv_heads, head_dim, max_context
    G = H // KVH
    HALF = D // 2
    L = int(cfg.get("lanes", lanes_for(D)))
    KT = int(cfg.get("k_tile", 32))
    body = cfg.get("body", "rows")
    scale = 1.0 / math.sqrt(D)
    if H % KVH or D % 2 or D % L or KT < 1:
        raise ValueError(f"attention: bad shape/config H={H} KVH={KVH} D={D} {cfg}")
    exp = fast_exp
    KVD = kv_dtype(kv_cache)
    KV32 = KVD == "float32"  # the float32 kernel is built from the original pieces, text for text
    RS = row_stride(D, KVD)  # cache elements per (kv head, position) row
    WIN, CAP = int(window), float(softcap)
    if WIN < 0 or CAP < 0:
        raise ValueError(f"attention: window {window} and softcap {softcap} must be >= 0")

    plan = _Plan(H, KVH, D, MAXC, G, HALF, L, KT, KVD, KV32, RS, WIN, CAP, scale)
    append_kv, rows_body = _append_and_rows_body(plan)

    if body == "tiled":
        if G % int(cfg.get("heads_per_task", G)) or int(cfg.get("q_tile", 8)) < 1:
            raise ValueError(f"attention: heads_per_task {cfg.get('heads_per_task')} must divide {G}")
        tiled = tiled_attention_body(heads=H, kv_heads=KVH, head_dim=D, max_context=MAXC, config={**cfg, "k_tile": KT},
                                     lanes=L, window=WIN, softcap=CAP, exp=exp, kv_dtype=KVD,
                                     key_row=lambda ctx, b, kh, j: (kh * MAXC + j) * RS, past_of=lambda ctx, b: ctx[0])

        @T.macro
        def main_body(Q, KF, VF, KS, VS, COS, SIN, OUT, past, seq):
            tiled(Q, KF, VF, KS, VS, COS, SIN, OUT, T.int64(1), seq, (past,))

    elif body == "split":
        step_body = _split_step_body(plan, cfg, append_kv, rows_body)
    elif body == "rows":
        main_body = rows_body
    else:
        raise ValueError(f"attention: unknown body {body!r}")
    if body != "split":

        @T.macro
        def step_body(Q, K, V, KF, VF, KS, VS, COS, SIN, OUT, past, seq):
            append_kv(Q, K, V, KF, VF, KS, VS, COS, SIN, past, seq)
            main_body(Q, KF, VF, KS, VS, COS, SIN, OUT, past, seq)

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
        KC = T.match_buffer(kc_h, (T.int64(1), T.int64(KVH), T.int64(MAXC), T.int64(RS)), KVD)
        VC = T.match_buffer(vc_h, (T.int64(1), T.int64(KVH), T.int64(MAXC), T.int64(RS)), KVD)
        PAST = T.match_buffer(past_h, (T.int64(1),), index_dtype)
        COS = T.match_buffer(cos_h, (T.int64(MAXC), T.int64(HALF)), dtype)
        SIN = T.match_buffer(sin_h, (T.int64(MAXC), T.int64(HALF)), dtype)
        OUT = T.match_buffer(out_h, (T.int64(1), seq, T.int64(H * D)), dtype)
        KF = T.decl_buffer((T.int64(KVH * MAXC * RS),), KVD, data=KC.data)
        VF = T.decl_buffer((T.int64(KVH * MAXC * RS),), KVD, data=VC.data)
        past: T.int64 = T.Cast("int64", PAST[0])  # the runtime keeps past + seq <= MAXC; reads clamp anyway
        if KVD == "int8":  # the rows' float32 scales, read and written through a float32 view of the cache
            KS = T.decl_buffer((T.int64(KVH * MAXC * RS // 4),), "float32", data=KC.data)
            VS = T.decl_buffer((T.int64(KVH * MAXC * RS // 4),), "float32", data=VC.data)
            step_body(Q, K, V, KF, VF, KS, VS, COS, SIN, OUT, past, seq)
        else:
            step_body(Q, K, V, KF, VF, KF, VF, COS, SIN, OUT, past, seq)

    if body == "tiled":
        return cached_attention
    from perfx_compiler.kernels import POOL_SCRATCH_ATTR

    return cached_attention.with_attr(POOL_SCRATCH_ATTR, list(ROWS_SCRATCH))


def untuned_attention_kernel(
    kind: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_context: int,
    dtype: str = "float32",
    index_dtype: str = "int64",
    window: int = 0,
    softcap: float = 0.0,
    kv_cache: str = "float32",
) -> Any:
    """The kernel the import phase emits: the default (rows) body, not marked scheduled and
    tagged ``perfx.attention`` so ``schedules/attention_cpu.py`` rebuilds it for a tuned
    configuration. ``kind``: "prefill" (any length) or "decode" (the decode function's call).
    ``window``/``softcap``: see :func:`cached_attention_kernel`; recorded in the tag when set, so the
    template rebuilds the same variant (a plain kernel's tag, and so its tuning records, are unchanged)."""
    import json

    func = cached_attention_kernel(num_heads, num_kv_heads, head_dim, max_context, dtype, index_dtype,
                                   window=window, softcap=softcap, kv_cache=kv_cache)
    info = {"kind": kind, "heads": num_heads, "kv_heads": num_kv_heads, "head_dim": head_dim,
            "max_context": max_context, "dtype": str(dtype), "index_dtype": str(index_dtype)}
    if window:
        info["window"] = int(window)
    if softcap:
        info["softcap"] = float(softcap)
    if kv_dtype(kv_cache) != "float32":  # a float32 cache's tag (and tuning records) are unchanged
        info["kv_cache"] = kv_dtype(kv_cache)
    from perfx_compiler.kernels import POOL_SCRATCH_ATTR

    # without the scratch attribute: the workload key (a structural hash) stays what the records were tuned for
    func = func.without_attr("tirx.is_scheduled").without_attr(POOL_SCRATCH_ATTR)
    func = func.with_attr(ATTR, json.dumps(info, sort_keys=True))
    if kind == "decode":  # the tuner times decode over a half-full cache, not a random few tokens
        func = func.with_attr("perfx.tune_inputs", json.dumps({"PAST": max_context // 2}))
    return func


def attention_prefill_kernel(*args: Any, **features: Any) -> Any:
    """:func:`untuned_attention_kernel` for the prefill functions (symbolic length); ``features``:
    ``window``, ``softcap``."""
    return untuned_attention_kernel("prefill", *args, **features)


def attention_decode_kernel(*args: Any, **features: Any) -> Any:
    """:func:`untuned_attention_kernel` for the decode function (one token per call); ``features``:
    ``window``, ``softcap``."""
    return untuned_attention_kernel("decode", *args, **features)
