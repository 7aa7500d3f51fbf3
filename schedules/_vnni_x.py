"""The activation side of the VNNI kernels (``_vnni_kernels.gemv``, ``gemm_qvnni_cpu``): x quantized to
int8 per weight group (``quantize_group``, shared by the GEMV and the GEMM), made by a fused prologue
(add_rms_norm / swiglu) group by group, and the GEMV's per-chunk scale vectors."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any


def _take(ns: SimpleNamespace, names: str) -> tuple[Any, ...]:
    """The values of ``names`` (space-separated) in ``ns``: a builder's constants as its own locals, which its
    TVMScript macros then read exactly as they read the enclosing function's."""
    return tuple(getattr(ns, n) for n in names.split())


@functools.cache
def quantize_group_macro(lane_groups: bool = False) -> Any:
    """The TVMScript macro ``quantize_group`` shared by the VNNI GEMV and GEMM (built on first use:
    this module imports without TVM). The 16-lane max and code sum are folded in registers
    (``_lanes``: 4 shuffle steps; max and integer sums are exact in any order). ``lane_groups`` (G = 16,
    the 6-bit GEMV): the codes go into the layout's lane-group order (formats.vnni_lowbit.q6_lane_order), column
    4s + j of group g to byte 64 s + 4 (g % 16) + j of its 256-column chunk."""
    from tvm.script import tirx as T

    from perfx_compiler.kernels import _lanes

    @T.macro
    def lanes_max(mx):  # noqa: ANN001
        mx[0] = _lanes.fold_lanes(mx.vload([0], "float32x16"), 16, T.max)

    @T.macro
    def lanes_sum(sm):  # noqa: ANN001
        sm[0] = _lanes.lanes_sum(sm, 0, 16, "int32")

    @T.macro
    def quantize_group(X, XQ, DX, dx_at, bm, g, mx, sm, inv, G, GV, K, KP, MM, x0):  # noqa: ANN001, N803
        """int8 codes of row ``bm``'s group ``g`` of x into XQ (x beyond K counts as 0, codes up to KP
        are written), its scale amax/127 into DX[dx_at], and the sum of its codes left in sm[0] (for the
        weights' offset term). mx/sm (16 lanes) and inv (1) are the caller's scratch. The group's columns
        are read from X[..., x0:]: x0 = g * G, or 0 when X holds only this group (a fused prologue's stage)."""
        for ln in T.vectorized(16):
            mx[ln] = T.float32(0)
            sm[ln] = 0
        for c in T.serial(GV):
            if g * G + c * 16 < K:
                for ln in T.vectorized(16):
                    mx[ln] = T.max(mx[ln], T.fabs(X[bm // MM, bm % MM, x0 + c * 16 + ln]))
        lanes_max(mx)
        DX[dx_at] = mx[0] / T.float32(127)
        inv[0] = T.Select(mx[0] > T.float32(0), T.float32(127) / mx[0], T.float32(0))
        for c in T.serial(GV):
            if g * G + c * 16 < KP:
                if lane_groups:  # (whole chunks: K == KP)
                    for s in T.unroll(4):
                        for j in T.vectorized(4):
                            XQ[bm * KP + (g // 16) * 256 + s * 64 + (g % 16) * 4 + j] = T.Cast(
                                "int8", T.round(X[bm // MM, bm % MM, x0 + s * 4 + j] * inv[0]))
                            sm[s * 4 + j] = sm[s * 4 + j] + T.Cast(
                                "int32", XQ[bm * KP + (g // 16) * 256 + s * 64 + (g % 16) * 4 + j])
                elif g * G + c * 16 < K:
                    for ln in T.vectorized(16):
                        XQ[bm * KP + g * G + c * 16 + ln] = T.Cast(
                            "int8", T.round(X[bm // MM, bm % MM, x0 + c * 16 + ln] * inv[0]))
                        sm[ln] = sm[ln] + T.Cast("int32", XQ[bm * KP + g * G + c * 16 + ln])
                else:
                    for ln in T.vectorized(16):
                        XQ[bm * KP + g * G + c * 16 + ln] = T.int8(0)
        lanes_sum(sm)

    return quantize_group


def _x_macros(g: SimpleNamespace, e: SimpleNamespace) -> Any:
    """Macros ``make_x`` (x's int8 groups, quantized or made by the fused prologue) and ``chunk_scales``."""
    from tvm.script import tirx as T

    BT, F, G, GV, K, KP, M, MM, NCH, NGE, eps, prologue = _take(g, "BT F G GV K KP M MM NCH NGE eps prologue")
    codes, silu_mul = _take(e, "codes silu_mul")
    quantize_group = quantize_group_macro(g.LG)

    @T.macro
    def quantize_x(X, XQ, gdx, gds):
        # x's groups quantized in order on this thread: codes into XQ, scales into gdx, scale x code
        # sum into gds
        mx = T.decl_buffer((16,), "float32", scope="local")
        sm = T.decl_buffer((16,), "int32", scope="local")
        inv = T.decl_buffer((1,), "float32", scope="local")
        for bm in T.serial(M):
            for g in T.serial(NGE):
                quantize_group(X, XQ, gdx, bm * NGE + g, bm, g, mx, sm, inv, G, GV, K, KP, MM, g * G)
                gds[bm * NGE + g] = gdx[bm * NGE + g] * T.Cast("float32", sm[0])

    @T.macro
    def quantize_fused(PA, PB, PW, SUM, XQ, gdx, gds, writer):
        # x made from the prologue's inputs one group at a time into a stack stage, then quantized;
        # add_rms_norm first sums a + b over the row (the writer stores it: the next residual) for the
        # norm, in the order rms_norm_kernel uses (16 lanes, then a serial fold)
        mx = T.decl_buffer((16,), "float32", scope="local")
        sm = T.decl_buffer((16,), "int32", scope="local")
        inv = T.decl_buffer((1,), "float32", scope="local")
        xg = T.decl_buffer((1, 1, G), "float32", scope="local")
        tot = T.decl_buffer((1,), "float32", scope="local")
        if prologue == "add_rms_norm":
            acc = T.decl_buffer((16,), "float32", scope="local")
            for ln in T.vectorized(16):
                acc[ln] = T.float32(0)
            for c in T.serial(K // 16):
                if writer:
                    for ln in T.vectorized(16):
                        SUM[0, 0, c * 16 + ln] = PA[0, 0, c * 16 + ln] + PB[0, 0, c * 16 + ln]
                for ln in T.vectorized(16):
                    acc[ln] = acc[ln] + (PA[0, 0, c * 16 + ln] + PB[0, 0, c * 16 + ln]) * (
                        PA[0, 0, c * 16 + ln] + PB[0, 0, c * 16 + ln])
            tot[0] = T.float32(0)
            for ln in T.serial(16):
                tot[0] = tot[0] + acc[ln]
            tot[0] = T.sqrt(tot[0] * T.float32(1.0 / K) + T.float32(eps))
        for g in T.serial(NGE):
            for i in T.vectorized(G):
                if prologue == "add_rms_norm":
                    xg[0, 0, i] = T.if_then_else(
                        g * G + i < K,
                        (PA[0, 0, T.min(g * G + i, K - 1)] + PB[0, 0, T.min(g * G + i, K - 1)]) / tot[0]
                        * PW[T.min(g * G + i, K - 1)], T.float32(0))
                else:
                    xg[0, 0, i] = T.if_then_else(
                        g * G + i < K,
                        silu_mul(PA[0, 0, T.min(g * G + i, K - 1)], PA[0, 0, T.min(g * G + i, K - 1) + K]), T.float32(0))
            quantize_group(xg, XQ, gdx, g, 0, g, mx, sm, inv, G, GV, K, KP, 1, 0)
            gds[g] = gdx[g] * T.Cast("float32", sm[0])

    @T.macro
    def chunk_scales(gdx, gds, DXC, DSC):
        # per 16-group chunk of each row of x: its groups' scales (DXC) and scale x code sums (DSC,
        # the groups an overlapping tail chunk already counted zeroed)
        for bm in T.serial(M):
            for c in T.serial(NCH):
                for ln in T.serial(16):
                    DXC[(bm * NCH + c) * 16 + ln] = T.if_then_else(
                        T.Select(c < F, c * 16 + ln, BT + ln) < NGE,
                        gdx[bm * NGE + T.min(T.Select(c < F, c * 16 + ln, BT + ln), NGE - 1)], T.float32(0))
                    DSC[(bm * NCH + c) * 16 + ln] = T.if_then_else(
                        T.Select(c < F, c * 16 + ln, BT + ln) < NGE
                        and (c < F or BT + ln >= F * 16),
                        gds[bm * NGE + T.min(T.Select(c < F, c * 16 + ln, BT + ln), NGE - 1)], T.float32(0))

    @T.macro
    def make_x(X, PB, PW, SUM, XQ, gdx, gds, writer):
        # x's int8 groups: quantized from X, or made by the fused prologue from its inputs (X, PB, PW)
        if prologue != "":
            quantize_fused(X, PB, PW, SUM, XQ, gdx, gds, writer)
        else:
            quantize_x(X, XQ, gdx, gds)

    return make_x, chunk_scales
