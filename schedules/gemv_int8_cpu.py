"""CPU kernels for int8 group-quantized linears (functions tagged ``perfx.quant`` with bits = 8:
the ``q8`` scheme and GGUF Q8_0 passthrough) and the int8 embedding gather.

* GEMV (static rows <= 8, decode): parallel over output rows N, R rows at a time (R independent
  FMA chains sharing each x load). Per group of G columns the codes are sign-extended, converted
  and multiplied into a per-group vector accumulator; the group's scale is applied once per
  group: ``y += s_g * sum_g(q x)``.
* Batched GEMV (paged_decode: x [batch, 1, K], batch symbolic): the same kernel, rows bound at run time.
* Dequantize (prefill, rows symbolic): int8 -> fp32 W [N, K], then the float GEMM template.
* Embedding gather: rows of the int8 table dequantized on the fly.

GGUF superblock types kept as they are (``formats/superblocks.py``; info ``offset`` / ``sb``, never
on the classic format): unsigned codes with a min (Q5_K, Q5_1: one more weight array, the GEMV adds
``min_g * sum_g(x)``, the group's x summed beside the codes) and superblock scales (Q6_K, Q3_K,
IQ4_XS, Q5_K: int8 sc times the row's float16 d read through a float16 view of the scale buffer,
``_scales.Scales``). Every kernel above reads them.

Q2_K (``code_bits`` 2) keeps the file's scale bytes ``sc | m << 4`` and a min array of dmin alone
(``Scales``' nibbles, ``formats/vnni_lowbit.pack_q2_scales``); Q3_K (``code_bits`` 3) holds d in its
group values' low bits (``Scales``' d_low, ``formats/vnni_lowbit.pack_scales_d_low``).

Codes in bit planes (info ``code_bits`` 6 / 5 / 3 / 2: Q6_K, Q5_K, Q5_1, Q5_0, Q3_K, Q2_K; ``formats/bitplanes.py``): each
kernel reads an L-lane vector of codes as one load, shift and mask per plane (``Codes``), the signed
ones' zero point taken off before the conversion.

Each kernel has one builder: its PrimFunc takes the min array ``Z``; signed codes (no min) take the
same function without it (``_vnni_kernels._without_zero``: ``Z`` bound to the scales, never read).
"""

from __future__ import annotations

from typing import Any

from perfx_compiler.formats.bitplanes import PLANES, WIDTH, plane_code, row_bytes
from perfx_compiler.formats.vnni import lookup_isa, table_value_lanes
from perfx_compiler.kernels._lanes import lanes_sum
from perfx_compiler.schedule_template import ScheduleConfigError, Workload
from schedules._gemv_once import OnceCodes, gemv_once
from schedules._scales import Scales
from schedules._vnni_kernels import _without_zero
from schedules.gemv_int4_cpu import GemvInt4CPU


class Codes:
    """How a kernel reads a weight's codes: int8 [N, K] (signed), uint8 [N, K] (with a min), or with
    ``bits`` < 8 the uint8 bit planes [N, row_bytes] of ``formats/bitplanes.py``, signed codes (no
    min) stored + 2^(bits-1)."""

    def __init__(self, K: int, L: int, offset: bool, bits: int = 8, lookup: str = "") -> None:  # noqa: N803
        if bits != 8 and WIDTH % L:
            raise ScheduleConfigError(f"{bits}-bit plane codes take vectors of at most {WIDTH} lanes dividing it, not {L}")
        self.K, self.bits = K, bits
        self.lookup = lookup if L == 16 else ""  # a 16-byte table instruction serves 16-lane loops
        self.zero = 0 if offset or bits in (4, 8) else 1 << (bits - 1)  # (4 bits: IQ4 table indices)
        self.W = K if bits == 8 else row_bytes(K, bits)
        self.QT = "uint8" if offset or bits != 8 else "int8"

    def groups_per_step(self, G: int, NG: int) -> int:  # noqa: N803
        """Groups a GEMV step unrolls: bit planes take a whole run of their widest-spanning plane (its
        fields' shifts then fold to constants) when the row has whole runs of it, else 1."""
        if self.bits == 8:
            return 1
        span = WIDTH * 8 // min(PLANES[self.bits])
        return span // G if span % G == 0 and NG % (span // G) == 0 else 1

    def value(self, Q: Any, row: Any, col: Any, lane: Any) -> Any:  # noqa: N803
        """float32 code of column col + lane of ``row`` (col a multiple of the kernel's lanes)."""
        from tvm.script import tirx as T

        if self.bits == 8:
            return T.Cast("float32", Q[row, col + lane])
        code = plane_code(lambda r, i: Q[r, i], row, col, lane, self.K, self.bits)
        if self.bits == 4:  # an IQ4 table index: the table's value (+ 128), pshufb / tbl or a select chain
            value = table_value_lanes(T.Cast("uint8", code), lane, "iq4nl", self.lookup)
            return T.Cast("float32", T.Cast("int32", value) - 128)
        return T.Cast("float32", code - self.zero if self.zero else code)


def _signature(func: Any, offset: bool) -> Any:
    """A kernel as built (codes, scales, mins, ...) for the min variant, else without its min
    parameter: signed int8 codes have no min array."""
    return func if offset else _without_zero(func, scales="S")


def _gemv(N: int, K: int, G: int, L: int, tasks: int, R: int, batch: bool = False, offset: bool = False,
          sb: int = 0, code_bits: int = 8, lookup: str = "") -> Any:
    """Int8 GEMV over the rows of x [b, m, K]: one parallel launch per row, or with ``batch``
    (paged_decode's symbolic batch) one launch with the rows innermost, so each task's R-row
    weight block is read from memory once per call and from L1 per row. ``offset``: unsigned codes
    and a min (``y += s_g * sum_g(q x) + min_g * sum_g(x)``); ``sb``: superblock scales."""
    from tvm.script import tirx as T

    F = Scales(N, K, G, offset, sb, nibbles=code_bits == 2, d_low=code_bits == 3)
    SW, ST, ZT, ZW = F.SW, F.ST, F.ZT, F.ZW
    C = Codes(K, L, offset, code_bits, lookup)
    QT, QW = C.QT, C.W
    views = F.views()
    NG = K // G
    VPG = G // L
    PER = N // tasks

    GU = C.groups_per_step(G, NG)
    GU = GU if not F.GPS or F.GPS % GU == 0 else 1
    # superblock by superblock (factors from a table, _scales.Scales.fill_table), GU groups at a time:
    # bit-plane codes unroll a plane run's groups so each field's shift is a constant
    groups = F.group_loop(R, NG, GU)

    @T.macro
    def one_group(X, Q, S, Z, Sd, Zd, acc, accg, accx, t, nj, bm, m, fac, fmin, g):
        for r in T.unroll(R):
            for lane in T.vectorized(L):
                accg[r * L + lane] = T.float32(0)
        if offset:
            for lane in T.vectorized(L):
                accx[lane] = T.float32(0)
        for u in T.unroll(VPG):
            for r in T.unroll(R):
                for lane in T.vectorized(L):
                    accg[r * L + lane] = accg[r * L + lane] + C.value(
                        Q, t * PER + nj * R + r, g * G + u * L, lane) * X[bm // m, bm % m, g * G + u * L + lane]
            if offset:  # the group's sum of x, for the min term
                for lane in T.vectorized(L):
                    accx[lane] = accx[lane] + X[bm // m, bm % m, g * G + u * L + lane]
        if offset:
            for r in T.unroll(R):
                for lane in T.vectorized(L):
                    acc[r * L + lane] = acc[r * L + lane] + (
                        F.table_scale(S, Sd, fac, t * PER + nj * R, r, g) * accg[r * L + lane]
                        + F.table_min(S, Z, Zd, fmin, t * PER + nj * R, r, g) * accx[lane])
        else:
            for r in T.unroll(R):
                for lane in T.vectorized(L):
                    acc[r * L + lane] = acc[r * L + lane] + F.table_scale(S, Sd, fac, t * PER + nj * R, r, g) * accg[
                        r * L + lane]

    @T.macro
    def row_block(X, Q, S, Z, Sd, Zd, Y, acc, accg, accx, t, nj, bm, m):
        # R weight rows against one row of x: R independent FMA chains sharing each x load
        for r in T.unroll(R):
            for lane in T.vectorized(L):
                acc[r * L + lane] = T.float32(0)
        groups(S, Z, Sd, Zd, t * PER + nj * R, acc, one_group, X, Q, S, Z, Sd, Zd, acc, accg, accx, t, nj, bm, m)
        for r in T.unroll(R):
            Y[bm // m, bm % m, t * PER + nj * R + r] = lanes_sum(acc, r * L, L)

    @T.macro
    def batch_body(S, Z, Sd, Zd, X, Q, Y, b, m):
        for t in T.parallel(tasks):
            acc = T.decl_buffer((R * L,), "float32", scope="local")
            accg = T.decl_buffer((R * L,), "float32", scope="local")
            if offset:
                accx = T.decl_buffer((L,), "float32", scope="local")
                for nj, bm in T.grid(PER // R, b * m):
                    row_block(X, Q, S, Z, Sd, Zd, Y, acc, accg, accx, t, nj, bm, m)
            else:
                for nj, bm in T.grid(PER // R, b * m):
                    row_block(X, Q, S, Z, Sd, Zd, Y, acc, accg, acc, t, nj, bm, m)

    @T.macro
    def rows_body(S, Z, Sd, Zd, X, Q, Y, b, m):
        for bm in T.serial(b * m):
            for t in T.parallel(tasks):
                acc = T.decl_buffer((R * L,), "float32", scope="local")
                accg = T.decl_buffer((R * L,), "float32", scope="local")
                if offset:
                    accx = T.decl_buffer((L,), "float32", scope="local")
                    for nj in T.serial(PER // R):
                        row_block(X, Q, S, Z, Sd, Zd, Y, acc, accg, accx, t, nj, bm, m)
                else:
                    for nj in T.serial(PER // R):
                        row_block(X, Q, S, Z, Sd, Zd, Y, acc, accg, acc, t, nj, bm, m)

    body = batch_body if batch else rows_body

    @T.prim_func(private=True)
    def q8_gemv(x_h: T.handle, q_h: T.handle, s_h: T.handle, z_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        b = T.int64()
        m = T.int64()
        X = T.match_buffer(x_h, (b, m, T.int64(K)), "float32")
        Q = T.match_buffer(q_h, (T.int64(N), T.int64(QW)), QT)
        S = T.match_buffer(s_h, (T.int64(N), T.int64(SW)), ST)
        Z = T.match_buffer(z_h, (T.int64(N), T.int64(ZW)), ZT)
        Y = T.match_buffer(y_h, (b, m, T.int64(N)), "float32")
        views(body, S, Z, X, Q, Y, b, m)

    return _signature(q8_gemv, offset)


def _dequant(N: int, K: int, G: int, L: int, tasks: int, offset: bool = False, sb: int = 0,
             code_bits: int = 8, lookup: str = "") -> Any:
    from tvm.script import tirx as T

    F = Scales(N, K, G, offset, sb, nibbles=code_bits == 2, d_low=code_bits == 3)
    SW, ST, ZT, ZW = F.SW, F.ST, F.ZT, F.ZW
    C = Codes(K, L, offset, code_bits, lookup)
    QT, QW = C.QT, C.W
    views = F.views()
    NV = K // L
    PER = N // tasks

    @T.macro
    def body(S, Z, Sd, Zd, Q, Out):
        for t in T.parallel(tasks):
            for nj in T.serial(PER):
                for v in T.serial(NV):
                    if offset:
                        for lane in T.vectorized(L):
                            Out[t * PER + nj, v * L + lane] = C.value(Q, t * PER + nj, v * L, lane) * F.scale(
                                S, Sd, t * PER + nj, v * L // G) + F.min(S, Z, Zd, t * PER + nj, v * L // G)
                    else:
                        for lane in T.vectorized(L):
                            Out[t * PER + nj, v * L + lane] = C.value(Q, t * PER + nj, v * L, lane) * F.scale(
                                S, Sd, t * PER + nj, v * L // G
                            )

    @T.prim_func(private=True)
    def q8_dequant(q_h: T.handle, s_h: T.handle, z_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        Q = T.match_buffer(q_h, (T.int64(N), T.int64(QW)), QT)
        S = T.match_buffer(s_h, (T.int64(N), T.int64(SW)), ST)
        Z = T.match_buffer(z_h, (T.int64(N), T.int64(ZW)), ZT)
        Out = T.match_buffer(o_h, (T.int64(N), T.int64(K)), "float32")
        views(body, S, Z, Q, Out)

    return _signature(q8_dequant, offset)


def _dequant_panels(N: int, K: int, G: int, L: int, nb: int, offset: bool = False, sb: int = 0,
                    code_bits: int = 8, lookup: str = "") -> Any:
    """W written as [N / nb, K, nb] panels (the packed GEMM's layout, see weight_layout): an
    L x L tile widened with contiguous loads, stored transposed through ``transpose_tile``."""
    from tvm.script import tirx as T

    from schedules._vnni_kernels import transpose_tile

    F = Scales(N, K, G, offset, sb, nibbles=code_bits == 2, d_low=code_bits == 3)
    SW, ST, ZT, ZW = F.SW, F.ST, F.ZT, F.ZW
    C = Codes(K, L, offset, code_bits, lookup)
    QT, QW = C.QT, C.W
    views = F.views()
    if nb % L or L & (L - 1) or K % L:
        raise ScheduleConfigError(f"panel width {nb} / K={K} is not a multiple of the {L}-lane tile")

    def w(Q: Any, S: Any, Z: Any, Sd: Any, Zd: Any, row: Any, col: Any, lane: Any) -> Any:  # noqa: N803
        """W[row, col + lane] (col a multiple of L)."""
        if offset:
            return C.value(Q, row, col, lane) * F.scale(S, Sd, row, col // G) + F.min(S, Z, Zd, row, col // G)
        return C.value(Q, row, col, lane) * F.scale(S, Sd, row, col // G)

    @T.macro
    def body(S, Z, Sd, Zd, Q, Out):
        for p in T.parallel(N // nb):
            for v in T.serial(K // L):
                for jb in T.serial(nb // L):
                    tile = T.decl_buffer((L * L,), "float32", scope="local")
                    for j in T.unroll(L):
                        for lane in T.vectorized(L):
                            tile[j * L + lane] = w(Q, S, Z, Sd, Zd, p * nb + jb * L + j, v * L, lane)
                    for c in T.unroll(L):
                        Out[p, v * L + c, T.Ramp(jb * L, 1, L)] = T.Shuffle(
                            transpose_tile([tile[T.Ramp(r * L, 1, L)] for r in range(L)]), [c * L + r for r in range(L)])

    @T.prim_func(private=True)
    def q8_dequant_panels(q_h: T.handle, s_h: T.handle, z_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        Q = T.match_buffer(q_h, (T.int64(N), T.int64(QW)), QT)
        S = T.match_buffer(s_h, (T.int64(N), T.int64(SW)), ST)
        Z = T.match_buffer(z_h, (T.int64(N), T.int64(ZW)), ZT)
        Out = T.match_buffer(o_h, (T.int64(N // nb), T.int64(K), T.int64(nb)), "float32")
        views(body, S, Z, Q, Out)

    return _signature(q8_dequant_panels, offset)


def _take(N: int, K: int, G: int, L: int, offset: bool = False, sb: int = 0, code_bits: int = 8,
          lookup: str = "") -> Any:
    from tvm.script import tirx as T

    F = Scales(N, K, G, offset, sb, nibbles=code_bits == 2, d_low=code_bits == 3)
    SW, ST, ZT, ZW = F.SW, F.ST, F.ZT, F.ZW
    C = Codes(K, L, offset, code_bits, lookup)
    QT, QW = C.QT, C.W
    views = F.views()
    NV = K // L

    @T.macro
    def body(S, Z, Sd, Zd, Q, ID, Out, b, m):
        for bm in T.serial(b * m):
            for v in T.serial(NV):
                if offset:
                    for lane in T.vectorized(L):
                        Out[bm // m, bm % m, v * L + lane] = C.value(Q, ID[bm // m, bm % m], v * L, lane) * F.scale(
                            S, Sd, ID[bm // m, bm % m], v * L // G) + F.min(S, Z, Zd, ID[bm // m, bm % m], v * L // G)
                else:
                    for lane in T.vectorized(L):
                        Out[bm // m, bm % m, v * L + lane] = C.value(Q, ID[bm // m, bm % m], v * L, lane) * F.scale(
                            S, Sd, ID[bm // m, bm % m], v * L // G
                        )

    @T.prim_func(private=True)
    def q8_take(q_h: T.handle, s_h: T.handle, z_h: T.handle, i_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        b = T.int64()
        m = T.int64()
        Q = T.match_buffer(q_h, (T.int64(N), T.int64(QW)), QT)
        S = T.match_buffer(s_h, (T.int64(N), T.int64(SW)), ST)
        Z = T.match_buffer(z_h, (T.int64(N), T.int64(ZW)), ZT)
        ID = T.match_buffer(i_h, (b, m), "int64")
        Out = T.match_buffer(o_h, (b, m, T.int64(K)), "float32")
        views(body, S, Z, Q, ID, Out, b, m)

    return _signature(q8_take, offset)


def _gemv_once(N: int, K: int, G: int, L: int, tasks: int, R: int, MB: int, batch: bool = False,
               offset: bool = False, sb: int = 0, code_bits: int = 8, lookup: str = "") -> Any:
    """``schedules/_gemv_once.py``'s multi-row GEMV (each weight unpacked once for all rows) over this
    file's codes (int8 bytes or bit planes, ``Codes``)."""
    C = Codes(K, L, offset, code_bits, lookup)
    codes = OnceCodes(C.QT, C.W, lambda Q, row, g, u, lane: C.value(Q, row, g * G + u * L, lane), False)
    return _signature(gemv_once(N, K, G, L, tasks, R, MB, offset=offset, batch=batch, sb=sb, codes=codes,
                                nibbles=code_bits == 2, d_low=code_bits == 3), offset)


class GemvInt8CPU(GemvInt4CPU):
    """gemv_int4_cpu's template over the int8 kernels of this file."""

    name = "gemv_int8_cpu"
    knobs = ("tasks", "unpack_once", "chunk")
    version = 2  # v2: 'unpack_once' (its own records: a version bump of gemv_int4_cpu leaves them)
    bits = 8
    weight_arrays = 2  # codes, scales

    def _format_info(self, info: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in ("offset", "sb", "code_bits"):  # only when set: the classic format's workload keys stay
            if info.get(key):
                out[key] = True if key == "offset" else int(info[key])
        return out

    def _weight_arrays(self, info: dict[str, Any]) -> int:
        return 3 if info.get("offset") else 2  # codes, scales (, mins)

    def _fits(self, N: int, K: int, G: int, L: int) -> bool:
        return K % G == 0 and G % L == 0

    def _takes_superblocks(self, info: dict[str, Any]) -> bool:
        """int8: signed codes, or unsigned codes with a min; byte codes (no words)."""
        sb, G, K = int(info["sb"]), int(info["group"]), int(info["K"])
        return not info.get("words") and sb % G == 0 and K % sb == 0

    def _kernels(self, workload: Workload, target: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        fmt = self._format_info(workload.info)
        if fmt.get("code_bits") == 4:  # IQ4 table indices: the target's byte-table lookup
            fmt["lookup"] = lookup_isa(target)
        return _gemv, _dequant, _dequant_panels, _take, fmt

    def _gemv_once(self) -> Any:
        return _gemv_once


TEMPLATE = GemvInt8CPU()
