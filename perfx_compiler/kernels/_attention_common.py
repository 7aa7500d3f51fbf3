"""TIR pieces shared by the attention kernels (contiguous, paged; the GPU kernel may import them).

Every kernel does the same four things: rotate q and k with rotate-half RoPE from cos/sin tables,
append the rotated k and v to a cache, score q against cached keys, and keep an online softmax
(running max ``m``, running sum ``l``, unnormalised output ``acc``) over tiles of keys. What
differs is where a cached key lives (contiguous [KVH, MAXC, D] rows or (page, slot) rows) and how
the work is split over threads; those stay in each kernel file. The pieces here are TVMScript
macros, expanded inline where they are called; a key's place in the cache is given by a Python
callable ``key_base(j)`` returning the flat offset of key ``j``'s row in a flat view of the cache.

Softmax exponentials use :func:`fast_exp` (a polynomial, FMAs only): LLVM lowers ``exp`` on a
vector to one libm call per lane.
"""

from __future__ import annotations

from typing import Any

from tvm.script import tirx as T

from perfx_compiler.kernels._lanes import add, fold_lanes, vector_type

NEG = -3.0e38  # "minus infinity" of the running max: finite, so exp(NEG - m) is 0, never NaN
# The rows and split bodies' scratch buffers, kept in TVM's workspace pool rather than on the stack
# (kernels.POOL_SCRATCH_ATTR: as allocas LLVM scalarizes them; the decode body ran 5x slower).
ROWS_SCRATCH = ("qr", "sc", "racc", "st", "ws", "cm", "ao")


def fast_exp(x: Any) -> Any:
    """Vectorizable exp for softmax weights (x <= 0): the polynomial exp (relative error ~1e-7),
    flushed to 0 below e^-60. Without the flush, weights near e^-87 are denormal and every
    product with them costs ~100x a normal FMA (a 512-token prefill ran 3x slower)."""
    from tvm import tirx

    from perfx_compiler.kernels.fastmath import fast_exp as _fast_exp

    return tirx.Select(x < tirx.const(-60.0, "float32"), tirx.const(0.0, "float32"), _fast_exp(x))


def soft_cap(x: Any, cap: float) -> Any:
    """``cap * tanh(x / cap)`` (Gemma 2's attention-logit soft-capping) with the polynomial tanh,
    so it vectorizes."""
    from tvm import tirx

    from perfx_compiler.kernels.fastmath import fast_tanh

    f32 = "float32"
    return fast_tanh(x * tirx.const(1.0 / cap, f32)) * tirx.const(cap, f32)


def first_key(pos: Any, window: int) -> Any:
    """First cache position the query at ``pos`` attends to: 0 (causal), or ``pos - window + 1``
    with a sliding window (keys ``pos - window < j <= pos``). A Python 0 when ``window`` is 0, so
    expressions built from it fold back to the plain causal kernel's text."""
    return T.max(pos - (window - 1), 0) if window > 0 else 0


def lanes_for(n: int, max_lanes: int = 16) -> int:
    """Widest f32 vector (<= max_lanes) that divides n (a head_dim, or a tile of keys)."""
    return next(w for w in (16, 8, 4, 2, 1) if w <= max_lanes and n % w == 0)


def _folded_dot(q: Any, q_base: Any, k: Any, k_base: Any, D: int, L: int) -> Any:
    """q[q_base : q_base + D] . k[k_base : k_base + D] as one expression (L-lane products summed,
    then folded): the partial never leaves registers."""
    vt = vector_type("float32", L)
    vec = q.vload([q_base], vt) * k.vload([k_base], vt)
    for c in range(1, D // L):
        vec = vec + q.vload([q_base + c * L], vt) * k.vload([k_base + c * L], vt)
    return fold_lanes(vec, L, add)


def _tile_max(sc: Any, base: Any, n: Any, KT: int) -> Any:
    """max of sc[base : base + n] (n <= KT) as one expression: W-lane chunks (W the widest vector
    dividing the tile) with lanes >= n masked to NEG, maxed, then folded."""
    from tvm import tirx

    W = lanes_for(KT)
    n = tirx.Cast("int64", n)
    limit = tirx.Broadcast(n, W) if W > 1 else n
    neg = tirx.const(NEG, "float32")
    neg = tirx.Broadcast(neg, W) if W > 1 else neg
    vec = None
    for c in range(KT // W):
        first = tirx.const(c * W, "int64")
        lane_pos = tirx.Ramp(first, tirx.const(1, "int64"), W) if W > 1 else first
        chunk = tirx.Select(lane_pos < limit, sc.vload([base + c * W], vector_type("float32", W)), neg)
        vec = chunk if vec is None else tirx.max(vec, chunk)
    return fold_lanes(vec, W, tirx.max)


def _tile_sum(sc: Any, base: Any, KT: int) -> Any:
    """sum of sc[base : base + KT] as one expression (W-lane chunks added, then folded)."""
    W = lanes_for(KT)
    vt = vector_type("float32", W)
    vec = sc.vload([base], vt)
    for c in range(1, KT // W):
        vec = vec + sc.vload([base + c * W], vt)
    return fold_lanes(vec, W, add)


@T.macro
def rope_store(dst, dst_off, stride, src, b, s, col, COS, SIN, pos, half, scale):
    """dst[dst_off + d * stride] = scale * RoPE(src[b, s, col : col + 2 * half])[d]."""
    for d in T.vectorized(half):
        dst[dst_off + d * stride] = (src[b, s, col + d] * COS[pos, d] - src[b, s, col + d + half] * SIN[pos, d]) * scale
        dst[dst_off + (d + half) * stride] = (
            src[b, s, col + d + half] * COS[pos, d] + src[b, s, col + d] * SIN[pos, d]
        ) * scale


@T.macro
def copy_row(dst, dst_off, src, b, s, col, n):
    """dst[dst_off : dst_off + n] = src[b, s, col : col + n] (a v row into the cache)."""
    for d in T.vectorized(n):
        dst[dst_off + d] = src[b, s, col + d]


@T.macro
def softmax_init(st, acc, rows, D):
    """st = [running max | running sum | rescale factor] per row; acc = 0."""
    for r in T.serial(rows):
        st[r] = T.float32(NEG)
        st[rows + r] = T.float32(0)
    for i in T.vectorized(rows * D):
        acc[i] = T.float32(0)


def prefetch_line(addr: Any) -> Any:
    """llvm.prefetch (read, data cache, keep in all levels) of ``addr``."""
    return T.call_llvm_intrin("void", "llvm.prefetch.p0", addr, T.int32(0), T.int32(3), T.int32(1))


@T.macro
def prefetch_kv_row(KF, VF, off, D):
    """Prefetch one cached key row and its value row (``D`` float32 from flat offset ``off``), a cache
    line (16 floats) at a time."""
    for c in T.unroll((D + 15) // 16):
        T.evaluate(prefetch_line(T.address_of(KF[off + c * 16])))
        T.evaluate(prefetch_line(T.address_of(VF[off + c * 16])))


@T.macro
def tile_scores(sc, qr, KF, VF, key_base, ctx, j0, n, rows, D, KT, L, ahead, end):
    """sc[r * KT + jj] = q_r . k_{j0 + jj} for jj < n: each key row is loaded once for all rows
    (the query heads sharing this kv head); LANES-wide partial sums, one horizontal sum per score.
    ``key_base(ctx, j)``: flat offset of key j's row in KF. With ``ahead`` > 0 (a Python int) the
    key and value rows of key j + ahead are prefetched with key j (when < ``end``): in a decode step
    the weights streamed since the layer's last step have evicted its cache rows
    (docs/decisions/attention-cpu.md)."""
    for jj in T.serial(n):
        if ahead > 0:
            if j0 + jj + ahead < end:
                prefetch_kv_row(KF, VF, key_base(ctx, j0 + jj + ahead), D)
        for r in T.serial(rows):
            sc[r * KT + jj] = _folded_dot(qr, r * D, KF, key_base(ctx, j0 + jj), D, L)


@T.macro
def tile_softcap(sc, rows, KT, cap):
    """sc[r * KT + jj] = soft_cap(sc[r * KT + jj], cap) over whole tiles (vectorised): lanes past a
    short tile's end hold stale values, which tile_softmax masks anyway."""
    for r in T.serial(rows):
        for jj in T.vectorized(KT):
            sc[r * KT + jj] = soft_cap(sc[r * KT + jj], cap)


@T.macro
def tile_softmax(sc, st, n, rows, KT, exp):
    """Online-softmax update for one tile of n scores per row: new running max, the factor that
    rescales the old sum/output (st[2 * rows + r]), and sc overwritten by the tile's weights
    (0 past n). The tile's max and sum are vector expressions folded once (a serial chain of
    dependent max/add per key cost about as much as the scores)."""
    for r in T.serial(rows):
        st[2 * rows + r] = T.max(st[r], _tile_max(sc, r * KT, n, KT))
        mx = st[2 * rows + r]  # the new running max (a let-bound snapshot)
        for jj in T.vectorized(KT):
            sc[r * KT + jj] = T.if_then_else(T.Cast("int64", jj) < T.Cast("int64", n), exp(sc[r * KT + jj] - mx), T.float32(0))
        st[2 * rows + r] = exp(st[r] - mx)
        st[r] = mx
        st[rows + r] = st[rows + r] * st[2 * rows + r] + _tile_sum(sc, r * KT, KT)


@T.macro
def tile_pv(acc, sc, st, VF, key_base, ctx, j0, n, rows, D, KT, L):
    """acc_r = rescale_r * acc_r + sum_jj p[r, jj] * v_{j0 + jj} (each v row loaded once for all rows)."""
    for r in T.serial(rows):
        for i in T.vectorized(D):
            acc[r * D + i] = acc[r * D + i] * st[2 * rows + r]
    for jj in T.serial(n):
        for r in T.serial(rows):
            for c in T.serial(D // L):
                for lane in T.vectorized(L):
                    acc[r * D + c * L + lane] = acc[r * D + c * L + lane] + sc[r * KT + jj] * VF[
                        key_base(ctx, j0 + jj) + c * L + lane
                    ]
