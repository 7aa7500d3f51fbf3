"""The int4 GEMV over several rows of x with each weight unpacked once for all of them
(``gemv_int4_cpu``'s ``unpack_once`` knob: static M = 2..8 and paged_decode's symbolic batch)."""

from __future__ import annotations

from typing import Any

from perfx_compiler.kernels._lanes import lanes_sum


def gemv_once(N: int, K: int, G: int, L: int, tasks: int, R: int, MB: int, offset: bool = False,
               batch: bool = False, sb: int = 0) -> Any:
    """Int4 GEMV over several rows of x (static M in 2..8, or paged_decode's symbolic batch), each
    weight unpacked once per MB rows: per L-code vector the nibbles are shifted, masked, converted
    and scaled (``w = q * s + c``, c = -z * s or the Q4_1 min) once into R registers, then FMAed
    into MB x R vector accumulators, one per (row, weight row). The per-row kernel (``_gemv``)
    repeats the unpack for every row, so M rows cost M times its ALU work on a memory-bound loop.
    A symbolic batch runs in chunks of MB rows, the last one through a body unrolled for its row
    count (MB bodies in all). ``sb``: superblock scales (``gemv_int4_cpu.Scales``, min variant)."""
    from tvm.script import tirx as T

    from schedules.gemv_int4_cpu import Scales

    F = Scales(N, K, G, offset, sb)
    NG, SW, ST, ZT = F.NG, F.SW, F.ST, F.ZT
    VPG = G // L
    NV = K // L
    NB = K // (8 * L)
    PER = N // tasks

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
                        accg[r * L + lane] = accg[r * L + lane] + T.Cast(
                            "float32",
                            T.Cast(
                                "int32",
                                T.bitwise_and(
                                    T.shift_right(
                                        Q[t * PER + nj * R + r, T.min((g * VPG + u) // 8, NB - 1) * L + lane],
                                        T.Cast("uint32", ((g * VPG + u) % 8) * 4),
                                    ),
                                    T.uint32(15),
                                ),
                            ),
                        ) * xr[c * MB * NG * G + (g * VPG + u) * L + lane]
            for r in T.unroll(R):
                for lane in T.vectorized(L):
                    if offset:
                        acc[r * L + lane] = acc[r * L + lane] + (
                            F.scale(S, Sd, t * PER + nj * R + r, g) * accg[r * L + lane]
                            + F.min(Z, Zd, t * PER + nj * R + r, g) * xs[c * MB * NG * L + g * L + lane])
                    else:
                        acc[r * L + lane] = acc[r * L + lane] + T.Cast("float32", S[t * PER + nj * R + r, g]) * (
                            accg[r * L + lane]
                            - T.Cast("float32", Z[t * PER + nj * R + r, g]) * xs[c * MB * NG * L + g * L + lane])
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
                    sc[r * 2 + 1] = F.min(Z, Zd, t * PER + nj * R + r, g)
                else:
                    sc[r * 2 + 1] = -T.Cast("float32", Z[t * PER + nj * R + r, g]) * sc[r * 2]
            for u in T.unroll(VPG):
                # the unpack, once per weight: R vectors of dequantized weights
                for r in T.unroll(R):
                    for lane in T.vectorized(L):
                        w[r * L + lane] = T.Cast(
                            "float32",
                            T.Cast(
                                "int32",
                                T.bitwise_and(
                                    T.shift_right(
                                        Q[t * PER + nj * R + r, T.min((g * VPG + u) // 8, NB - 1) * L + lane],
                                        T.Cast("uint32", ((g * VPG + u) % 8) * 4),
                                    ),
                                    T.uint32(15),
                                ),
                            ),
                        ) * sc[r * 2] + sc[r * 2 + 1]
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
        Q = T.match_buffer(q_h, (T.int64(N), T.int64(K // 8)), "uint32")
        S = T.match_buffer(s_h, (T.int64(N), T.int64(SW)), ST)
        Z = T.match_buffer(z_h, (T.int64(N), T.int64(SW)), ZT)
        Y = T.match_buffer(y_h, (b, m, T.int64(N)), "float32")
        views(body, S, Z, X, Q, Y, b, m)  # Sd / Zd: the superblock d / dmin (Scales.views)

    return q4_gemv_once
