"""The quantized GEMV over several rows of x with each weight unpacked once for all of them (the
``unpack_once`` knob of ``gemv_int4_cpu`` and ``gemv_int8_cpu``: static M = 2..8 and paged_decode's
symbolic batch). The int4 interleaved codes by default; the int8 template passes its own code reader
(``OnceCodes``: int8 bytes, or the bit planes of ``formats/bitplanes.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from perfx_compiler.kernels._lanes import lanes_sum


@dataclass(frozen=True)
class OnceCodes:
    """How :func:`gemv_once` reads codes: buffer dtype and row width, ``value(Q, row, g, u, lane)`` (the
    float32 code of column g * G + u * L + lane), and whether a zero-point array Z goes with them
    (else w = code * scale, or code * scale + min with ``offset``)."""

    dtype: str
    width: int
    value: Any
    zero_array: bool


def int4_codes(K: int, L: int) -> OnceCodes:  # noqa: N803
    """The int4 interleaved layout (``formats/int4.py``) with its uint8 zero points."""
    from tvm.script import tirx as T

    NB, VPG8 = K // (8 * L), 8

    def value(Q: Any, row: Any, g_u: Any, lane: Any) -> Any:  # noqa: N803
        return T.Cast("float32", T.Cast("int32", T.bitwise_and(
            T.shift_right(Q[row, T.min(g_u // VPG8, NB - 1) * L + lane], T.Cast("uint32", (g_u % VPG8) * 4)),
            T.uint32(15))))

    return OnceCodes("uint32", K // 8, value, True)


def gemv_once(N: int, K: int, G: int, L: int, tasks: int, R: int, MB: int, offset: bool = False,
              batch: bool = False, sb: int = 0, codes: OnceCodes | None = None, nibbles: bool = False,
              sym: bool = False, d_low: bool = False) -> Any:
    """Int4 GEMV over several rows of x (static M in 2..8, or paged_decode's symbolic batch), each
    weight unpacked once per MB rows: per L-code vector the nibbles are shifted, masked, converted
    and scaled (``w = q * s + c``, c = -z * s or the Q4_1 min) once into R registers, then FMAed
    into MB x R vector accumulators, one per (row, weight row). The per-row kernel (``_gemv``)
    repeats the unpack for every row, so M rows cost M times its ALU work on a memory-bound loop.
    A symbolic batch runs in chunks of MB rows, the last one through a body unrolled for its row
    count (MB bodies in all). ``sb``: superblock scales (``_scales.Scales``). ``codes``: the code
    reader (:class:`OnceCodes`; int4 by default, whose ``value`` takes the vector index g * VPG + u);
    ``nibbles``: Q2_K's scale bytes, ``d_low``: Q3_K's, ``sym``: int4 zero point 8 without an array
    (``_scales.Scales``)."""
    from tvm.script import tirx as T

    from schedules._scales import Scales

    F = Scales(N, K, G, offset, sb, nibbles, sym=sym and codes is None, d_low=d_low)
    NG, SW, ST, ZT, ZW = F.NG, F.SW, F.ST, F.ZT, F.ZW
    VPG = G // L
    NV = K // L
    PER = N // tasks
    C = codes or int4_codes(K, L)
    ZA, QT, QW = C.zero_array and not offset, C.dtype, C.width

    def code(Q: Any, row: Any, g: Any, u: Any, lane: Any) -> Any:  # noqa: N803
        return C.value(Q, row, g * VPG + u, lane) if codes is None else C.value(Q, row, g, u, lane)

    @T.macro
    def prepare_x(X, xr, xs, xr0, xs0, bm, m):
        # x zero-padded to whole groups: the ragged last group runs the same unrolled loop, its
        # clamped weight reads multiplied by zeros; with a batch, its lane sums per group too (the
        # zero point's term of a single-row chunk, see block1)
        for c in T.serial(NG * VPG):
            for lane in T.vectorized(L):
                xr[xr0 + c * L + lane] = T.if_then_else(c < NV, X[bm // m, bm % m, T.min(c, NV - 1) * L + lane], T.float32(0))
        if batch:
            for g in T.serial(NG):
                for lane in T.vectorized(L):
                    xs[xs0 + g * L + lane] = T.float32(0)
            for c in T.serial(NV):
                for lane in T.vectorized(L):
                    xs[xs0 + (c * L // G) * L + lane] = xs[xs0 + (c * L // G) * L + lane] + xr[xr0 + c * L + lane]

    @T.macro
    def block1(Q, S, Z, Sd, Zd, Y, xr, xs, acc, accg, t, nj, c, m):
        # a chunk of one row (batch 1, or the last of an odd batch): nobody shares the unpacked
        # weights, so the per-row kernel's order, scale and zero applied per group to the sums of
        # q * x (fewer ops than dequantizing every weight)
        for r in T.unroll(R):
            for lane in T.vectorized(L):
                acc[r * L + lane] = T.float32(0)
        for g in T.serial(NG):
            for r in T.unroll(R):
                for lane in T.vectorized(L):
                    accg[r * L + lane] = T.float32(0)
            for u in T.unroll(VPG):
                for r in T.unroll(R):
                    for lane in T.vectorized(L):
                        accg[r * L + lane] = accg[r * L + lane] + code(Q, t * PER + nj * R + r, g, u, lane) * xr[
                            c * MB * NG * G + (g * VPG + u) * L + lane]
            for r in T.unroll(R):
                for lane in T.vectorized(L):
                    if offset:
                        acc[r * L + lane] = acc[r * L + lane] + (
                            F.scale(S, Sd, t * PER + nj * R + r, g) * accg[r * L + lane]
                            + F.min(S, Z, Zd, t * PER + nj * R + r, g) * xs[c * MB * NG * L + g * L + lane])
                    elif ZA:
                        acc[r * L + lane] = acc[r * L + lane] + T.Cast("float32", S[t * PER + nj * R + r, g]) * (
                            accg[r * L + lane]
                            - F.zero(Z, t * PER + nj * R + r, g) * xs[c * MB * NG * L + g * L + lane])
                    else:
                        acc[r * L + lane] = acc[r * L + lane] + F.scale(
                            S, Sd, t * PER + nj * R + r, g) * accg[r * L + lane]
        for r in T.unroll(R):
            Y[(c * MB) // m, (c * MB) % m, t * PER + nj * R + r] = lanes_sum(acc, r * L, L)

    @T.macro
    def block(Q, S, Z, Sd, Zd, Y, xr, acc, w, sc, t, nj, c, m, rows):
        # rows (a Python int <= MB): the rows of x in this chunk, all unrolled
        for i in T.unroll(rows):
            for r in T.unroll(R):
                for lane in T.vectorized(L):
                    acc[(i * R + r) * L + lane] = T.float32(0)
        for g in T.serial(NG):
            for r in T.unroll(R):
                sc[r * 2] = F.scale(S, Sd, t * PER + nj * R + r, g)
                if offset:
                    sc[r * 2 + 1] = F.min(S, Z, Zd, t * PER + nj * R + r, g)
                elif ZA:
                    sc[r * 2 + 1] = -F.zero(Z, t * PER + nj * R + r, g) * sc[r * 2]
            for u in T.unroll(VPG):
                # the unpack, once per weight: R vectors of dequantized weights
                for r in T.unroll(R):
                    for lane in T.vectorized(L):
                        if offset or ZA:
                            w[r * L + lane] = code(Q, t * PER + nj * R + r, g, u, lane) * sc[r * 2] + sc[r * 2 + 1]
                        else:
                            w[r * L + lane] = code(Q, t * PER + nj * R + r, g, u, lane) * sc[r * 2]
                # reused by every row: one x load per row shared by the R weight rows
                for i in T.unroll(rows):
                    for r in T.unroll(R):
                        for lane in T.vectorized(L):
                            acc[(i * R + r) * L + lane] = acc[(i * R + r) * L + lane] + w[r * L + lane] * xr[
                                (c * MB + i) * NG * G + (g * VPG + u) * L + lane]
        for i in T.unroll(rows):
            for r in T.unroll(R):
                Y[(c * MB + i) // m, (c * MB + i) % m, t * PER + nj * R + r] = lanes_sum(acc, (i * R + r) * L, L)

    def dispatch(rows: int, fewer: Any) -> Any:
        # a chunk of up to ``rows`` rows: the body for exactly ``rows``, else ``fewer``'s (macros
        # cannot call themselves, so the chain is built here)
        @T.macro
        def chunk(Q, S, Z, Sd, Zd, Y, xr, xs, acc, acc1, accg, w, sc, t, nj, c, m, left):
            if left >= rows:
                block(Q, S, Z, Sd, Zd, Y, xr, acc, w, sc, t, nj, c, m, rows)
            else:
                fewer(Q, S, Z, Sd, Zd, Y, xr, xs, acc, acc1, accg, w, sc, t, nj, c, m, left)

        return chunk

    @T.macro
    def one(Q, S, Z, Sd, Zd, Y, xr, xs, acc, acc1, accg, w, sc, t, nj, c, m, left):
        block1(Q, S, Z, Sd, Zd, Y, xr, xs, acc1, accg, t, nj, c, m)

    chunk = one
    for rows in range(2, MB + 1):
        chunk = dispatch(rows, chunk)

    @T.macro
    def body(S, Z, Sd, Zd, X, Q, Y, b, m):
        xr = T.decl_buffer((b * m * NG * G,), "float32")
        xs = T.decl_buffer((b * m * NG * L if batch else 1,), "float32")
        for bm in T.serial(b * m):
            prepare_x(X, xr, xs, bm * NG * G, bm * NG * L, bm, m)
        # accumulators once per task (inside a parallel loop each allocation is a workspace call)
        for t in T.parallel(tasks):
            acc = T.decl_buffer((MB * R * L,), "float32", scope="local")
            accg = T.decl_buffer((R * L,), "float32", scope="local")
            # a single-row chunk's own accumulators, not a slice of the MB-row block's
            acc1 = T.decl_buffer((R * L,), "float32", scope="local")
            w = T.decl_buffer((R * L,), "float32", scope="local")
            sc = T.decl_buffer((R * 2,), "float32", scope="local")
            for nj, c in T.grid(PER // R, (b * m + MB - 1) // MB):
                if batch:
                    # the last chunk of a symbolic batch: a body unrolled for its exact row count
                    chunk(Q, S, Z, Sd, Zd, Y, xr, xs, acc, acc1, accg, w, sc, t, nj, c, m, b * m - c * MB)
                else:
                    block(Q, S, Z, Sd, Zd, Y, xr, acc, w, sc, t, nj, c, m, MB)

    views = F.views()

    @T.prim_func(private=True)
    def q4_gemv_once(x_h: T.handle, q_h: T.handle, s_h: T.handle, z_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        b = T.int64()
        m = T.int64()
        X = T.match_buffer(x_h, (b, m, T.int64(K)), "float32")
        Q = T.match_buffer(q_h, (T.int64(N), T.int64(QW)), QT)
        S = T.match_buffer(s_h, (T.int64(N), T.int64(SW)), ST)
        Z = T.match_buffer(z_h, (T.int64(N), T.int64(ZW)), ZT)
        Y = T.match_buffer(y_h, (b, m, T.int64(N)), "float32")
        views(body, S, Z, X, Q, Y, b, m)  # Sd / Zd: the superblock d / dmin (Scales.views)

    return F.signature(q4_gemv_once)
