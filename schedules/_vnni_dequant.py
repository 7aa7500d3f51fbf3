"""The VNNI layouts' other readers (``formats/vnni.py``: int4 row pairs, int8 + 128, unsigned
int8 with a min, 2- / 6-bit row quads, 3- / 5-bit row octets, superblock scales), used by the ``gemv_qvnni_cpu`` template beside the GEMV of
``_vnni_kernels``: ``dequant`` (prefill: W in float32, row-major or as the packed GEMM's panels)
and ``take`` (the embedding gather).
"""

from __future__ import annotations

from typing import Any

from perfx_compiler.formats.vnni import code_row_bytes
from perfx_compiler.formats.vnni_lowbit import d_of_bytes, group_nibble, min_width, q6_byte, scalar_code, scale_times_4
from perfx_compiler.kernels.memo import memoized_kernel
from schedules._vnni_kernels import ROWS_PER_UNIT, _without_zero, plan, transpose_tile


class _Layout:
    """The array shapes of one VNNI weight (see formats/vnni.py) and its float weight expression."""

    def __init__(self, bits: int, N: int, K: int, G: int, sym: bool, offset: bool, sb: int,  # noqa: N803
                 lut: str = "") -> None:
        p = plan(K, G)
        self.lut = lut
        self.bits, self.sym, self.offset, self.sb, self.G = bits, sym, offset, sb, G
        self.KP, self.NGP = p["KP"], p["NGP"]
        rpu = ROWS_PER_UNIT[bits]
        self.N2 = -(-N // rpu) * rpu
        self.QW = self.N2 // rpu
        self.QKW = code_row_bytes(bits, self.KP)  # bytes of a code row
        self.ST = "int8" if sb else "float16"
        self.ZT = self.ST if offset else "uint8"
        self.SW = self.NGP + (2 * (K // sb) if sb and bits != 3 else 0)  # (3-bit: d in the values' low bits)
        self.ZW = min_width(bits, K, sb, self.SW)  # (Q2_K: dmin alone; the mins are the scale bytes' high nibbles)
        # int8 codes without a min, table indices (IQ4) and symmetric int4 (zero point 8) take no zero/min array
        self.has_z = (bits == 4 and not lut and not sym) or offset

    def factor(self, A: Any, Ad: Any, row: Any, g: Any) -> Any:  # noqa: N803
        """Group g's scale (or min factor) as float32: the float16 value, or sc * d (superblocks)."""
        from tvm.script import tirx as T

        if not self.sb:
            return T.Cast("float32", A[row, g])
        if self.bits == 3:
            return T.Cast("float32", scale_times_4(A[row, g])) * d_of_bytes(lambda r, c: A[r, c], row, g)
        d = Ad[row * (self.SW // 2) + self.NGP // 2 + g // (self.sb // self.G)]
        return T.Cast("float32", group_nibble(A[row, g], False) if self.bits == 2 else A[row, g]) * T.Cast("float32", d)

    def min_factor(self, Sc: Any, Z: Any, Zd: Any, row: Any, g: Any) -> Any:  # noqa: N803
        """The min term (w = code * scale + min): the float16 min, or -(m * dmin) (Q2_K: m the high
        nibble of the scale byte, dmin the min array's only content)."""
        from tvm.script import tirx as T

        if self.sb and self.bits == 2:
            dmin = Zd[row * (self.ZW // 2) + g // (self.sb // self.G)]
            return -(T.Cast("float32", group_nibble(Sc[row, g], True)) * T.Cast("float32", dmin))
        return -self.factor(Z, Zd, row, g) if self.sb else self.factor(Z, Zd, row, g)

    def weight(self, Q: Any, Sc: Any, Z: Any, Sd: Any, Zd: Any, row: Any, col: Any, g: Any) -> Any:  # noqa: N803
        """Float weight (row, col) of group g."""
        from tvm.script import tirx as T

        s = self.factor(Sc, Sd, row, g)
        if self.offset:
            mn = self.min_factor(Sc, Z, Zd, row, g)
        if self.bits == 6:  # the row's nibble in its pair's part of the step, 2 high bits in the step's third part
            lo = T.bitwise_and(T.shift_right(Q[row // 4, q6_byte((row % 4) // 2, col)], T.Cast("uint8", (row % 2) * 4)),
                               T.uint8(15))
            hb = T.bitwise_and(T.shift_right(Q[row // 4, q6_byte(2, col)], T.Cast("uint8", (row % 4) * 2)), T.uint8(3))
            return (T.Cast("float32", T.bitwise_or(lo, T.shift_left(hb, T.uint8(4)))) - T.float32(32)) * s
        if self.bits in (2, 3, 5):  # the row's low bits in its quad / pair row, (3, 5) its top bit in the octet's last row
            code = T.Cast("float32", scalar_code(self.bits, lambda u, at: Q[u, at], row, col))
            return code * s + mn if self.offset else (code - T.float32({3: 4, 5: 16}[self.bits])) * s
        if self.bits == 8:
            if self.offset:  # unsigned codes as they are, then the min
                return T.Cast("float32", Q[row, col]) * s + mn
            return (T.Cast("float32", Q[row, col]) - T.float32(128)) * s
        nib = T.bitwise_and(T.shift_right(Q[row // 2, col], T.Cast("uint8", (row % 2) * 4)), T.uint8(15))
        if self.lut:  # the table's value + 128 by a select chain (16 lanes: a few compares and blends)
            from perfx_compiler.formats.vnni import table_value

            return (T.Cast("float32", table_value(nib, self.lut)) - T.float32(128)) * s
        code = T.Cast("float32", nib)
        if self.offset:
            return code * s + mn
        if self.sym:
            return (code - T.float32(8)) * s
        return (code - T.Cast("float32", Z[row, g])) * s


@memoized_kernel
def dequant(bits: int, N: int, K: int, G: int, sym: bool, offset: bool, tasks: int, nb: int = 0,  # noqa: N803
            sb: int = 0, lut: str = "") -> Any:
    """W [N, K] in float32 from the VNNI layout (prefill: the float GEMM follows), or with
    ``nb`` as [N / nb, K, nb] panels, the packed GEMM's layout (see weight_layout)."""
    from tvm.script import tirx as T

    L = _Layout(bits, N, K, G, sym, offset, sb, lut)
    QKW, QW, N2, SW, ST, ZT, ZW = L.QKW, L.QW, L.N2, L.SW, L.ST, L.ZT, L.ZW
    NV = K // 16
    PER = -(-N // tasks)

    if nb and (N % nb or nb % 16):
        raise ValueError(f"panel width {nb} must be a multiple of 16 dividing N={N}")
    OUT = (N // nb, K, nb) if nb else (N, K)

    # Panels: a 16 x 16 tile (16 rows, 16 columns) is widened with row-contiguous loads as in
    # the row kernel, then stored transposed (16 columns of 16 rows each, contiguous in Out):
    # transpose_tile's shuffles, then column c picked from them (constant after unrolling).
    @T.macro
    def panels(Q, Sc, Z, Sd, Zd, Out):
        for pn in T.parallel(N // nb):
            for kb in T.serial(K // 16):
                for jb in T.serial(nb // 16):
                    tile = T.decl_buffer((256,), "float32", scope="local")
                    for j in T.unroll(16):
                        for lane in T.vectorized(16):
                            tile[j * 16 + lane] = L.weight(Q, Sc, Z, Sd, Zd, pn * nb + jb * 16 + j, kb * 16 + lane,
                                                           (kb * 16) // G)
                    for c in T.unroll(16):
                        Out[pn, kb * 16 + c, T.Ramp(jb * 16, 1, 16)] = T.Shuffle(
                            transpose_tile([tile[T.Ramp(r * 16, 1, 16)] for r in range(16)]), [c * 16 + r for r in range(16)])

    @T.macro
    def rows(Q, Sc, Z, Sd, Zd, Out):
        for t in T.parallel(tasks):
            for j in T.serial(PER):
                if t * PER + j < N:
                    for v in T.serial(NV):
                        for lane in T.vectorized(16):
                            Out[t * PER + j, v * 16 + lane] = L.weight(
                                Q, Sc, Z, Sd, Zd, t * PER + j, v * 16 + lane, (v * 16) // G)

    body = panels if nb else rows

    @T.prim_func(private=True)
    def qv_dequant(q_h: T.handle, s_h: T.handle, z_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        Q = T.match_buffer(q_h, (T.int64(QW), T.int64(QKW)), "uint8")
        Sc = T.match_buffer(s_h, (T.int64(N2), T.int64(SW)), ST)
        Z = T.match_buffer(z_h, (T.int64(N2), T.int64(ZW)), ZT)
        Out = T.match_buffer(o_h, [T.int64(d) for d in OUT], "float32")
        Sd = T.decl_buffer((N2 * SW // 2,), "float16", data=Sc.data)  # superblock d (sb only)
        Zd = T.decl_buffer((N2 * ZW // 2,), "float16", data=Z.data)
        body(Q, Sc, Z, Sd, Zd, Out)

    return qv_dequant if L.has_z else _without_zero(qv_dequant)


@memoized_kernel
def take(bits: int, N: int, K: int, G: int, sym: bool, offset: bool, sb: int = 0,  # noqa: N803
         lut: str = "") -> Any:
    """Embedding gather out[b, m, :] = W[ids[b, m], :] from the VNNI layout."""
    from tvm.script import tirx as T

    L = _Layout(bits, N, K, G, sym, offset, sb, lut)
    QKW, QW, N2, SW, ST, ZT, ZW = L.QKW, L.QW, L.N2, L.SW, L.ST, L.ZT, L.ZW
    NV = K // 16

    @T.macro
    def body(Q, Sc, Z, Sd, Zd, ID, Out, b, m):
        for bm in T.serial(b * m):
            for v in T.serial(NV):
                for lane in T.vectorized(16):
                    Out[bm // m, bm % m, v * 16 + lane] = L.weight(
                        Q, Sc, Z, Sd, Zd, ID[bm // m, bm % m], v * 16 + lane, (v * 16) // G)

    @T.prim_func(private=True)
    def qv_take(q_h: T.handle, s_h: T.handle, z_h: T.handle, i_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        b = T.int64()
        m = T.int64()
        Q = T.match_buffer(q_h, (T.int64(QW), T.int64(QKW)), "uint8")
        Sc = T.match_buffer(s_h, (T.int64(N2), T.int64(SW)), ST)
        Z = T.match_buffer(z_h, (T.int64(N2), T.int64(ZW)), ZT)
        ID = T.match_buffer(i_h, (b, m), "int64")
        Out = T.match_buffer(o_h, (b, m, T.int64(K)), "float32")
        Sd = T.decl_buffer((N2 * SW // 2,), "float16", data=Sc.data)
        Zd = T.decl_buffer((N2 * ZW // 2,), "float16", data=Z.data)
        body(Q, Sc, Z, Sd, Zd, ID, Out, b, m)

    return qv_take if L.has_z else _without_zero(qv_take)
