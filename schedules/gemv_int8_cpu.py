"""CPU kernels for int8 group-quantized linears (functions tagged ``perfx.quant`` with bits = 8:
the ``q8`` scheme and GGUF Q8_0 passthrough) and the int8 embedding gather.

* GEMV (static rows <= 8, decode): parallel over output rows N, R rows at a time (R independent
  FMA chains sharing each x load). Per group of G columns the codes are sign-extended, converted
  and multiplied into a per-group vector accumulator; the group's scale is applied once per
  group: ``y += s_g * sum_g(q x)``.
* Batched GEMV (paged_decode: x [batch, 1, K], batch symbolic): the same kernel, rows bound at run time.
* Dequantize (prefill, rows symbolic): int8 -> fp32 W [N, K], then the float GEMM template.
* Embedding gather: rows of the int8 table dequantized on the fly.
"""

from __future__ import annotations

from typing import Any

from perfx_compiler.kernels._lanes import lanes_sum
from perfx_compiler.schedule_template import ScheduleConfigError, ScheduleTemplate, Workload
from schedules.gemv_int4_cpu import GemvInt4CPU


def _gemv(N: int, K: int, G: int, L: int, tasks: int, R: int, batch: bool = False) -> Any:
    """Int8 GEMV over the rows of x [b, m, K]: one parallel launch per row, or with ``batch``
    (paged_decode's symbolic batch) one launch with the rows innermost, so each task's R-row
    weight block is read from memory once per call and from L1 per row."""
    from tvm.script import tirx as T

    NG = K // G
    VPG = G // L
    PER = N // tasks

    @T.macro
    def row_block(X, Q, S, Y, acc, accg, t, nj, bm, m):
        # R weight rows against one row of x: R independent FMA chains sharing each x load
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
                            "float32", Q[t * PER + nj * R + r, g * G + u * L + lane]
                        ) * X[bm // m, bm % m, g * G + u * L + lane]
            for r in T.unroll(R):
                for lane in T.vectorized(L):
                    acc[r * L + lane] = acc[r * L + lane] + T.Cast(
                        "float32", S[t * PER + nj * R + r, g]
                    ) * accg[r * L + lane]
        for r in T.unroll(R):
            Y[bm // m, bm % m, t * PER + nj * R + r] = lanes_sum(acc, r * L, L)

    if batch:

        @T.prim_func(private=True)
        def q8_gemv_batch(x_h: T.handle, q_h: T.handle, s_h: T.handle, y_h: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            b = T.int64()
            m = T.int64()
            X = T.match_buffer(x_h, (b, m, T.int64(K)), "float32")
            Q = T.match_buffer(q_h, (T.int64(N), T.int64(K)), "int8")
            S = T.match_buffer(s_h, (T.int64(N), T.int64(NG)), "float16")
            Y = T.match_buffer(y_h, (b, m, T.int64(N)), "float32")
            for t in T.parallel(tasks):
                acc = T.decl_buffer((R * L,), "float32", scope="local")
                accg = T.decl_buffer((R * L,), "float32", scope="local")
                for nj, bm in T.grid(PER // R, b * m):
                    row_block(X, Q, S, Y, acc, accg, t, nj, bm, m)

        return q8_gemv_batch

    @T.prim_func(private=True)
    def q8_gemv(x_h: T.handle, q_h: T.handle, s_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        b = T.int64()
        m = T.int64()
        X = T.match_buffer(x_h, (b, m, T.int64(K)), "float32")
        Q = T.match_buffer(q_h, (T.int64(N), T.int64(K)), "int8")
        S = T.match_buffer(s_h, (T.int64(N), T.int64(NG)), "float16")
        Y = T.match_buffer(y_h, (b, m, T.int64(N)), "float32")
        for bm in T.serial(b * m):
            for t in T.parallel(tasks):
                acc = T.decl_buffer((R * L,), "float32", scope="local")
                accg = T.decl_buffer((R * L,), "float32", scope="local")
                for nj in T.serial(PER // R):
                    row_block(X, Q, S, Y, acc, accg, t, nj, bm, m)

    return q8_gemv


def _dequant(N: int, K: int, G: int, L: int, tasks: int) -> Any:
    from tvm.script import tirx as T

    NG = K // G
    NV = K // L
    PER = N // tasks

    @T.prim_func(private=True)
    def q8_dequant(q_h: T.handle, s_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        Q = T.match_buffer(q_h, (T.int64(N), T.int64(K)), "int8")
        S = T.match_buffer(s_h, (T.int64(N), T.int64(NG)), "float16")
        Out = T.match_buffer(o_h, (T.int64(N), T.int64(K)), "float32")
        for t in T.parallel(tasks):
            for nj in T.serial(PER):
                for v in T.serial(NV):
                    for lane in T.vectorized(L):
                        Out[t * PER + nj, v * L + lane] = T.Cast("float32", Q[t * PER + nj, v * L + lane]) * T.Cast(
                            "float32", S[t * PER + nj, v * L // G]
                        )

    return q8_dequant


def _dequant_panels(N: int, K: int, G: int, L: int, nb: int) -> Any:
    """W written as [N / nb, K, nb] panels (the packed GEMM's layout, see weight_layout): an
    L x L tile widened with contiguous loads, stored transposed through ``transpose_tile``."""
    from tvm.script import tirx as T

    from schedules._vnni_kernels import transpose_tile

    NG = K // G
    if nb % L or L & (L - 1) or K % L:
        raise ScheduleConfigError(f"panel width {nb} / K={K} is not a multiple of the {L}-lane tile")

    @T.prim_func(private=True)
    def q8_dequant_panels(q_h: T.handle, s_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        Q = T.match_buffer(q_h, (T.int64(N), T.int64(K)), "int8")
        S = T.match_buffer(s_h, (T.int64(N), T.int64(NG)), "float16")
        Out = T.match_buffer(o_h, (T.int64(N // nb), T.int64(K), T.int64(nb)), "float32")
        for p in T.parallel(N // nb):
            for v in T.serial(K // L):
                for jb in T.serial(nb // L):
                    tile = T.decl_buffer((L * L,), "float32", scope="local")
                    for j in T.unroll(L):
                        for lane in T.vectorized(L):
                            tile[j * L + lane] = T.Cast("float32", Q[p * nb + jb * L + j, v * L + lane]) * T.Cast(
                                "float32", S[p * nb + jb * L + j, (v * L + lane) // G])
                    for c in T.unroll(L):
                        Out[p, v * L + c, T.Ramp(jb * L, 1, L)] = T.Shuffle(
                            transpose_tile([tile[T.Ramp(r * L, 1, L)] for r in range(L)]), [c * L + r for r in range(L)])

    return q8_dequant_panels


def _take(N: int, K: int, G: int, L: int) -> Any:
    from tvm.script import tirx as T

    NG = K // G
    NV = K // L

    @T.prim_func(private=True)
    def q8_take(q_h: T.handle, s_h: T.handle, i_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        b = T.int64()
        m = T.int64()
        Q = T.match_buffer(q_h, (T.int64(N), T.int64(K)), "int8")
        S = T.match_buffer(s_h, (T.int64(N), T.int64(NG)), "float16")
        ID = T.match_buffer(i_h, (b, m), "int64")
        Out = T.match_buffer(o_h, (b, m, T.int64(K)), "float32")
        for bm in T.serial(b * m):
            for v in T.serial(NV):
                for lane in T.vectorized(L):
                    Out[bm // m, bm % m, v * L + lane] = T.Cast("float32", Q[ID[bm // m, bm % m], v * L + lane]) * T.Cast(
                        "float32", S[ID[bm // m, bm % m], v * L // G]
                    )

    return q8_take


class GemvInt8CPU(GemvInt4CPU):
    """gemv_int4_cpu's template over the int8 kernels of this file."""

    name = "gemv_int8_cpu"
    knobs = ("tasks",)
    version = ScheduleTemplate.version  # its own records: a version bump of gemv_int4_cpu leaves them
    bits = 8
    weight_arrays = 2  # codes, scales

    def _format_info(self, info: dict[str, Any]) -> dict[str, Any]:
        return {}

    def _fits(self, N: int, K: int, G: int, L: int) -> bool:
        return K % G == 0 and G % L == 0

    def _kernels(self, workload: Workload) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        return _gemv, _dequant, _dequant_panels, _take, {}

    def _gemv_once(self) -> Any:
        return None  # int8 codes: the per-row kernel for every row count (no unpack-once variant yet)


TEMPLATE = GemvInt8CPU()
