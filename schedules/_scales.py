"""How the CPU kernels of ``gemv_int4_cpu`` / ``gemv_int8_cpu`` / ``_gemv_once`` read a weight's scale
and zero / min tables (classic float16 tables, or GGUF superblock scales), and the GEMVs' per-superblock
factor table."""

from __future__ import annotations

from typing import Any


class Scales:
    """How a kernel reads a weight's scale and zero / min tables: float16 [N, NG] (uint8 zeros or
    float16 mins), or with ``sb`` (superblock scales, ``formats/superblocks.py``) int8 [N, SW],
    SW = NG + 2 K/sb, whose row tail holds the superblocks' float16 d (dmin), read through a
    float16 view (``Ad``: ``decl_buffer((N * SW // 2,), "float16", data=A.data)``, :meth:`views`) of the
    same buffer, as ``schedules/_vnni_dequant._Layout.factor`` does. Without ``sb`` the expressions are
    the classic kernels' own (their generated code does not change)."""

    def __init__(self, N: int, K: int, G: int, offset: bool, sb: int = 0, nibbles: bool = False,  # noqa: N803
                 sym: bool = False, d_low: bool = False) -> None:
        self.sym = bool(sym and not offset)  # int4 zero point 8 everywhere: no zero array
        self.NG = -(-K // G)
        self.G, self.sb, self.offset, self.nibbles = G, sb, bool(offset), bool(nibbles and sb and offset)
        # d_low (GGUF Q3_K, formats/vnni_lowbit.pack_scales_d_low): 4 sc in each value's high 6 bits,
        # the superblock's float16 d in the low 2 bits of its first 8 values, read through a uint64 view;
        # no d tail
        self.d_low = bool(d_low and sb and not offset)
        self.SW = self.NG + 2 * (K // sb) if sb and not self.d_low else self.NG
        # nibbles (GGUF Q2_K, formats/vnni_lowbit.pack_q2_scales): scale bytes sc | m << 4, the min
        # array only the superblocks' dmin
        self.ZW = 2 * (K // sb) if self.nibbles else self.SW
        self.ST = "int8" if sb else "float16"
        self.ZT = "int8" if sb else ("float16" if offset else "uint8")
        self.VIEW = N * self.SW // 2  # float16 elements of a view
        self.ZVIEW = N * self.ZW // 2

    def scale(self, A: Any, Ad: Any, row: Any, g: Any) -> Any:  # noqa: N803
        """Group g's scale as float32: the float16 value, or sc * d."""
        from tvm.script import tirx as T

        if not self.sb:
            return T.Cast("float32", A[row, g])
        if self.d_low:
            return self.d_low_value(A, row, g) * self.superblock_d(Ad, row, g // (self.sb // self.G))
        d = Ad[row * (self.SW // 2) + self.NG // 2 + g // (self.sb // self.G)]
        sc = A[row, g] & T.int8(15) if self.nibbles else A[row, g]
        return T.Cast("float32", sc) * T.Cast("float32", d)

    def d_low_value(self, A: Any, row: Any, g: Any) -> Any:  # noqa: N803
        """(``d_low``) group g's 4 sc as float32: its scale byte with d's 2 bits cleared."""
        from tvm.script import tirx as T

        from perfx_compiler.formats.vnni_lowbit import scale_times_4

        return T.Cast("float32", scale_times_4(A[row, g]))

    def superblock_d(self, Aw: Any, row: Any, sbi: Any) -> Any:  # noqa: N803
        """(``d_low``) superblock ``sbi``'s d / 4 as float32, folded from the low bits of its first 8
        values, read as one uint64 of the scale buffer's word view ``Aw`` (:meth:`views`)."""
        from perfx_compiler.formats.vnni_lowbit import d_of_word

        return d_of_word(Aw[(row * self.SW + sbi * (self.sb // self.G)) // 8])

    def min(self, S: Any, Z: Any, Zd: Any, row: Any, g: Any) -> Any:  # noqa: N803
        """Group g's additive min (offset variants) as float32: the float16 min, or -(m * dmin) (m the
        high nibble of the scale byte ``S[row, g]`` with ``nibbles``)."""
        from tvm.script import tirx as T

        if not self.sb:
            return T.Cast("float32", Z[row, g])
        if self.nibbles:
            m = T.shift_right(S[row, g], T.int8(4)) & T.int8(15)
            return -(T.Cast("float32", m) * T.Cast("float32", Zd[row * (self.ZW // 2) + g // (self.sb // self.G)]))
        return -self.scale(Z, Zd, row, g)

    # The GEMVs' superblock factor table: the R rows' sc * d (and m * dmin) of the next superblock as
    # vectors into a local table [R * GPS], read back by one broadcast a group. A group of 16 or 32 weights
    # is one or two code vectors, so a scalar int8 load, conversion and product a group and row cost as
    # much as the codes (docs/decisions/gguf-superblocks.md: decode x1.19-1.27).

    @property
    def GPS(self) -> int:  # noqa: N802
        """Groups per superblock (0 without superblock scales: no table)."""
        return self.sb // self.G if self.sb else 0

    def fill_table(self, R: int) -> Any:  # noqa: N803
        """Macro ``fill(S, Z, Sd, Zd, fac, fmin, row0, sbi)``: superblock ``sbi``'s factors of rows row0 .. row0 + R - 1."""
        from tvm.script import tirx as T

        GPS, OFF, D_LOW = self.GPS, self.offset, self.d_low
        F = self

        @T.macro
        def fill(S, Z, Sd, Zd, fac, fmin, row0, sbi):
            for r in T.unroll(R):
                if D_LOW:  # d once a superblock and row, not per lane
                    d = F.superblock_d(Sd, row0 + r, sbi)
                    for gi in T.vectorized(GPS):
                        fac[r * GPS + gi] = F.d_low_value(S, row0 + r, sbi * GPS + gi) * d
                else:
                    for gi in T.vectorized(GPS):
                        fac[r * GPS + gi] = F.scale(S, Sd, row0 + r, sbi * GPS + gi)
                if OFF:
                    for gi in T.vectorized(GPS):
                        fmin[r * GPS + gi] = F.min(S, Z, Zd, row0 + r, sbi * GPS + gi)

        return fill

    def group_loop(self, R: int, NG: int, GU: int = 1) -> Any:  # noqa: N803
        """Macro ``loop(S, Z, Sd, Zd, row0, spare, one, *args)``: the GEMVs' walk over a row block's NG
        groups, calling ``one(*args, fac, fmin, g)`` for each, GU groups unrolled. With superblock
        scales it goes superblock by superblock, filling the R rows' factor table (``fac`` / ``fmin``,
        :meth:`fill_table`) first; without, ``spare`` stands for both (never read)."""
        from tvm.script import tirx as T

        GPS, BY_SB = self.GPS, self.GPS > 0
        fill = self.fill_table(R)
        if GPS and GPS % GU:
            raise ValueError(f"internal: {GU} groups a step do not divide a superblock's {GPS}")

        @T.macro
        def loop(S, Z, Sd, Zd, row0, spare, one, *args):
            if BY_SB:
                fac = T.decl_buffer((R * GPS,), "float32", scope="local")
                fmin = T.decl_buffer((R * GPS,), "float32", scope="local")
                for sbi in T.serial(NG // GPS):
                    fill(S, Z, Sd, Zd, fac, fmin, row0, sbi)
                    for go in T.serial(GPS // GU):
                        for gi in T.unroll(GU):
                            one(*args, fac, fmin, sbi * GPS + go * GU + gi)
            else:
                for go in T.serial(NG // GU):
                    for gi in T.unroll(GU):
                        one(*args, spare, spare, go * GU + gi)

        return loop

    def table_scale(self, S: Any, Sd: Any, fac: Any, row0: Any, r: Any, g: Any) -> Any:  # noqa: N803
        """Group g's scale of row row0 + r: from the table (superblocks), else ``scale``."""
        return fac[r * self.GPS + g % self.GPS] if self.GPS else self.scale(S, Sd, row0 + r, g)

    def table_min(self, S: Any, Z: Any, Zd: Any, fmin: Any, row0: Any, r: Any, g: Any) -> Any:  # noqa: N803
        """Group g's min of row row0 + r: from the table (superblocks), else ``min``."""
        return fmin[r * self.GPS + g % self.GPS] if self.GPS else self.min(S, Z, Zd, row0 + r, g)

    def zero(self, Z: Any, row: Any, g: Any) -> Any:  # noqa: N803
        """Group g's int4 zero point as float32: 8 for symmetric formats (no array), else Z's uint8."""
        from tvm.script import tirx as T

        return T.float32(8) if self.sym else T.Cast("float32", Z[row, g])

    def signature(self, func: Any) -> Any:
        """A kernel as built, or without its zero parameter for symmetric formats (bound to the scales,
        never read: ``_vnni_kernels._without_zero``)."""
        from schedules._vnni_kernels import _without_zero

        return _without_zero(func, scales="S") if self.sym else func

    def views(self) -> Any:
        """The macro ``views(body, S, Z, *rest)`` every kernel's PrimFunc ends with: it calls
        ``body(S, Z, Sd, Zd, *rest)``, Sd / Zd the float16 views of the scale / min buffers (the
        superblock d / dmin) with ``sb`` (``d_low``: Sd a uint64 view of S), else S / Z themselves: no
        view is declared that the kernel does not read (the classic kernels' TIR as it was; no Zd without
        a min)."""
        from tvm.script import tirx as T

        SB, OFF, VIEW, ZVIEW, D_LOW = bool(self.sb), self.offset, self.VIEW, self.ZVIEW, self.d_low
        WORDS = self.VIEW // 4  # (d_low: uint64 words, SW a multiple of 16)

        @T.macro
        def views(body, S, Z, *rest):
            if D_LOW:
                Sw = T.decl_buffer((WORDS,), "uint64", data=S.data)
                body(S, Z, Sw, Z, *rest)
            elif SB and OFF:
                Sd = T.decl_buffer((VIEW,), "float16", data=S.data)
                Zd = T.decl_buffer((ZVIEW,), "float16", data=Z.data)
                body(S, Z, Sd, Zd, *rest)
            elif SB:
                Sd = T.decl_buffer((VIEW,), "float16", data=S.data)
                body(S, Z, Sd, Z, *rest)
            else:
                body(S, Z, S, Z, *rest)

        return views
