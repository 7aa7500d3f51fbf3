"""GGUF superblock weights (K-quants) read through OpenCL images on Adreno's texture path: the image
layout, its packing from the GPU arrays, and the GEMV, multi-row GEMM and embedding gather on it.

A superblock (256 weights of one row) keeps the file's bits, one run of RGBA32UI texels a superblock
in the row's image (``kernels/gemv_texture.py``'s rows, layers and limits):

* its code texels: each code plane's words of the superblock (``bitplanes.pack_word_planes``, low
  bits first; Q4_K's 4-bit codes are one plane), ``2 * bits`` texels;
* one head texel: the group values (sc, then m with a min) as fields of their own width, plane by
  plane (6-bit values: the low 4 bits of every group, then the top 2), widest first so no field
  crosses a word; then, when the values leave a word free (Q4_K, Q5_K, Q3_K), the superblock's d word
  as ``formats/gpu_factors.py`` stores it (d's float32 bits, or d | dmin << 16 as float16 bits).
* Q6_K and Q2_K fill the head with their values (16 bytes); their d words go to a second image, four
  superblocks a texel.

Bytes against the file: Q4_K, Q5_K, Q2_K 1.0; Q6_K 1.0095 (d as 32 bits, as on the buffer path);
Q3_K 1.018. IQ4_XS (a 64-bit head) has no image layout and keeps its buffers.

Every kernel walks a row a superblock at a time: the superblock's texels are read once (the code
texels in an unrolled loop first: gemv_texture.py's note on TVM 0.27's OpenCL codegen) and every
field is then taken from registers at indices fixed at compile time. Sums as the buffer kernels:
``sum_g (sc_g d) sum_j x_j q_j - (m_g dmin) sum_j x_j``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from tvm.script import tirx as T

from perfx_compiler.formats.bitplanes import PLANES
from perfx_compiler.kernels.gemv_texture import TEXEL, ImageLayout, TextureLimitError, image_layout, pack_image

SB = 256  # weights a superblock
HEAD_BITS = TEXEL * 32
ROWS = 4  # rows of x per thread in the multi-row kernel (as gemm_texture.py's)
CODE_BITS = {"Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "Q3_K": 3, "Q2_K": 2}  # the types with an image layout


def superblock_type(info: dict[str, Any]) -> str | None:
    """The K-quant of a GPU ``perfx.quant`` info (None: not one with an image layout). Q4_K runs the int4
    kernels (bits 4, a min); the others the int8 ones, told apart by their codes' bits."""
    if int(info.get("sb") or 0) != SB or not info.get("gpu_factors") or info.get("words") or info.get("lut"):
        return None
    if int(info.get("bits", 0)) == 4:
        return "Q4_K" if info.get("offset") else None
    int8_types = {bits: t for t, bits in CODE_BITS.items() if t != "Q4_K"}
    return int8_types.get(int(info.get("code_bits") or 0))


def _widths(bits: int) -> tuple[int, ...]:
    return (8,) if bits == 8 else PLANES[bits]


@dataclass(frozen=True)
class SuperblockImages:
    """The image layout of one K-quant weight [n, k] (module docstring)."""

    qtype: str
    n: int
    k: int
    group: int
    offset: bool

    @staticmethod
    def of(info: dict[str, Any]) -> SuperblockImages:
        qtype = superblock_type(info)
        if qtype is None:
            raise TextureLimitError(f"no superblock image layout for {info}")
        return SuperblockImages(qtype, int(info["N"]), int(info["K"]), int(info["group"]), bool(info.get("offset")))

    @property
    def code_bits(self) -> int:
        return CODE_BITS[self.qtype]

    @property
    def code_bias(self) -> int:
        """Stored codes are unsigned; without a min they are the signed codes + this."""
        return 0 if self.offset else 1 << (self.code_bits - 1)

    @property
    def value_bits(self) -> int:
        from perfx_compiler.formats.gpu_factors import VALUE_BITS

        return VALUE_BITS[self.qtype]

    @property
    def value_bias(self) -> int:
        from perfx_compiler.formats.gpu_factors import SIGNED_VALUES

        return 1 << (self.value_bits - 1) if self.qtype in SIGNED_VALUES else 0

    @property
    def groups(self) -> int:
        return SB // self.group

    @property
    def superblocks(self) -> int:
        return self.k // SB

    @property
    def code_texels(self) -> int:
        return 2 * self.code_bits  # SB * bits / 128

    @property
    def texels(self) -> int:
        """Texels a superblock takes in the row's image: its codes and its head."""
        return self.code_texels + 1

    def fields(self) -> list[tuple[int, int, int, int]]:
        """(array 0: sc | 1: m, low bit of the value, width, bit of group 0) of the head's fields."""
        out, at = [], 0
        planes = [(a, low, w) for a in range(1 + self.offset)
                  for low, w in zip(np.cumsum((0,) + _widths(self.value_bits)[:-1]), _widths(self.value_bits), strict=True)]
        for a, low, w in sorted(planes, key=lambda p: -p[2]):  # widest first: no field crosses a word
            out.append((a, int(low), w, at))
            at += self.groups * w
        return out

    @property
    def d_in_head(self) -> bool:
        return (1 + self.offset) * self.groups * self.value_bits <= HEAD_BITS - 32

    def layouts(self, limits: dict[str, int]) -> list[ImageLayout]:
        if self.k % SB:
            raise TextureLimitError(f"superblock images need K % {SB} == 0 (K={self.k})")
        out = [image_layout(self.n, self.superblocks * self.texels, "RGBA32UI", limits)]
        if not self.d_in_head:
            out.append(image_layout(self.n, -(-self.superblocks // TEXEL), "RGBA32UI", limits))
        return out

    # -- packing (numpy) ------------------------------------------------------------------------
    def pack(self, arrays: list[np.ndarray], layouts: list[ImageLayout]) -> list[np.ndarray]:
        """The images from the weight's GPU arrays (``formats.superblocks.subscaled_packed(gpu=True)``:
        the code planes, then ``formats/gpu_factors.py``'s arrays)."""
        widths = _widths(self.code_bits)
        planes = [np.asarray(a, np.uint32) for a in arrays[: len(widths)]]
        sc, m, dword = self._factors(arrays[len(planes):])
        n, nsb = self.n, self.superblocks
        runs = [p.reshape(n, nsb, 2 * w * TEXEL) for p, w in zip(planes, widths, strict=True)]
        head = np.zeros((n, nsb, TEXEL), np.uint32)
        values = [sc, m]
        for a, low, w, at in self.fields():
            v = (values[a].astype(np.int32) + self.value_bias).astype(np.uint32).reshape(n, nsb, self.groups)
            field = (v >> np.uint32(low)) & np.uint32((1 << w) - 1)
            for g in range(self.groups):
                bit = at + g * w
                head[:, :, bit // 32] |= field[:, :, g] << np.uint32(bit % 32)
        if self.d_in_head:
            head[:, :, TEXEL - 1] = dword
        row = np.concatenate([*runs, head], axis=2).reshape(n, -1)
        out = [pack_image(row, layouts[0])]
        if not self.d_in_head:
            padded = np.zeros((n, layouts[1].width * TEXEL), np.uint32)
            padded[:, :nsb] = dword
            out.append(pack_image(padded, layouts[1]))
        return out

    def _factors(self, arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """(sc, m or None, the d words) from gpu_factors' arrays: group values without their bias."""
        from perfx_compiler.formats.bitplanes import unpack_word_planes
        from perfx_compiler.formats.gpu_factors import GpuFactors

        f = GpuFactors.of(self.qtype, self.n, self.k, self.group, SB, self.offset)
        nv, ng = len(_widths(self.value_bits)), self.k // self.group

        def values(planes: list[np.ndarray]) -> np.ndarray:
            if self.value_bits == 8:
                v = np.ascontiguousarray(planes[0]).view(np.uint8)[:, :ng]
            else:
                v = unpack_word_planes(planes, planes[0].shape[1] * 32 // _widths(self.value_bits)[0], self.value_bits)[:, :ng]
            return v.astype(np.int32) - (self.value_bias if f.signed else 0)

        sc = values(arrays[:nv])
        m = values(arrays[nv: 2 * nv]) if self.offset else None
        return sc, m, np.asarray(arrays[-1], np.uint32)

    # -- decoding (TIR, indices fixed at compile time once the loops are unrolled) ---------------------
    def code(self, cw: Any, col: Any) -> Any:
        """float32 code (less its bias) of column ``col`` of the superblock whose code words are ``cw``."""
        out, base, low = None, 0, 0
        for w in _widths(self.code_bits):
            bit = col * w
            f = (cw[base + bit // 32] >> T.Cast("uint32", bit % 32)) & T.uint32((1 << w) - 1)
            f = f << T.uint32(low) if low else f
            out = f if out is None else out | f
            base, low = base + 8 * w, low + w
        v = T.Cast("float32", T.Cast("int32", out))
        return v - T.float32(self.code_bias) if self.code_bias else v

    def value(self, hv: Any, a: int, g: Any) -> Any:
        """float32 group value (sc: ``a`` 0, m: 1) of group ``g`` from the head texel ``hv``."""
        out = None
        for arr, low, w, at in self.fields():
            if arr != a:
                continue
            bit = at + g * w
            f = (hv[bit // 32] >> T.Cast("uint32", bit % 32)) & T.uint32((1 << w) - 1)
            f = f << T.uint32(low) if low else f
            out = f if out is None else out | f
        v = T.Cast("float32", T.Cast("int32", out))
        return v - T.float32(self.value_bias) if self.value_bias else v

    def d(self, dword: Any) -> tuple[Any, Any]:
        """(d, dmin or None) as float32 from the superblock's d word."""
        from perfx_compiler.kernels.half_bits import te_half

        if not self.offset:
            return T.reinterpret("float32", dword), None
        return te_half(dword & T.uint32(0xFFFF)), te_half(dword >> T.uint32(16))


def _dword(spec: SuperblockImages, hv: Any, dv: Any, kb: Any) -> Any:
    return hv[TEXEL - 1] if spec.d_in_head else dv[kb % TEXEL]


def texture_superblock_gemv_kernel(info: dict[str, Any], layouts: list[ImageLayout], threads: int = 64) -> Any:
    """y[0, 0, n] = sum_k x[0, 0, k] W[n, k] with W a K-quant in the images of :class:`SuperblockImages`;
    one thread per output row."""
    sp = SuperblockImages.of(info)
    N, K, TH, G, NG = sp.n, sp.k, threads, sp.group, sp.groups
    A, D = layouts[0], layouts[-1]
    CT, TPS, HA, HD = sp.code_texels, sp.texels, A.height, D.height
    BLOCKS = -(-N // TH)

    @T.macro
    def body(X, Q, DI, Y):
        for bx in T.thread_binding(BLOCKS, thread="blockIdx.x"):
            for tx in T.thread_binding(TH, thread="threadIdx.x"):
                acc = T.decl_buffer((1,), "float32", scope="local")
                part = T.decl_buffer((2,), "float32", scope="local")
                cw = T.decl_buffer((CT * TEXEL,), "uint32", scope="local")
                hv = T.decl_buffer((TEXEL,), "uint32", scope="local")
                dv = T.decl_buffer((TEXEL,), "uint32", scope="local")
                if bx * TH + tx < N:
                    acc[0] = T.float32(0)
                    for kb in range(sp.superblocks):
                        for i in T.unroll(CT):
                            for c in T.vectorized(TEXEL):
                                cw[i * TEXEL + c] = Q[(bx * TH + tx) // HA, (bx * TH + tx) % HA, kb * TPS + i, c]
                        for c in T.vectorized(TEXEL):
                            hv[c] = Q[(bx * TH + tx) // HA, (bx * TH + tx) % HA, kb * TPS + CT, c]
                        if not sp.d_in_head:
                            for c in T.vectorized(TEXEL):
                                dv[c] = DI[(bx * TH + tx) // HD, (bx * TH + tx) % HD, kb // TEXEL, c]
                        for g in T.unroll(NG):
                            part[0] = T.float32(0)
                            part[1] = T.float32(0)
                            for j in T.unroll(G):
                                part[0] = part[0] + X[0, 0, kb * SB + g * G + j] * sp.code(cw, g * G + j)
                                if sp.offset:
                                    part[1] = part[1] + X[0, 0, kb * SB + g * G + j]
                            if sp.offset:
                                acc[0] = (acc[0] + part[0] * (sp.value(hv, 0, g) * sp.d(_dword(sp, hv, dv, kb))[0])
                                          - part[1] * (sp.value(hv, 1, g) * sp.d(_dword(sp, hv, dv, kb))[1]))
                            else:
                                acc[0] = acc[0] + part[0] * (sp.value(hv, 0, g) * sp.d(_dword(sp, hv, dv, kb))[0])
                    Y[0, 0, bx * TH + tx] = acc[0]

    if sp.d_in_head:

        @T.prim_func(private=True)
        def texture_sb_gemv(x_h: T.handle, q_h: T.handle, y_h: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
            X = T.match_buffer(x_h, (1, 1, K), "float32")
            Q = T.match_buffer(q_h, A.shape, "uint32", scope="global.texture")
            Y = T.match_buffer(y_h, (1, 1, N), "float32")
            body(X, Q, Q, Y)

        return texture_sb_gemv

    @T.prim_func(private=True)
    def texture_sb_d_gemv(x_h: T.handle, q_h: T.handle, d_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        X = T.match_buffer(x_h, (1, 1, K), "float32")
        Q = T.match_buffer(q_h, A.shape, "uint32", scope="global.texture")
        DI = T.match_buffer(d_h, D.shape, "uint32", scope="global.texture")
        Y = T.match_buffer(y_h, (1, 1, N), "float32")
        body(X, Q, DI, Y)

    return texture_sb_d_gemv


def texture_superblock_gemm_kernel(info: dict[str, Any], layouts: list[ImageLayout], threads: int = 64,
                                   rows: int = ROWS) -> Any:
    """y[b, s, n] = sum_k x[b, s, k] W[n, k] (``b``, ``s`` symbolic) with W a K-quant in images: one thread
    per output column and ``rows`` rows of x; each group is dequantized once for all of them."""
    sp = SuperblockImages.of(info)
    N, K, TH, G, NG, R = sp.n, sp.k, threads, sp.group, sp.groups, rows
    A, D = layouts[0], layouts[-1]
    CT, TPS, HA, HD = sp.code_texels, sp.texels, A.height, D.height
    BLOCKS = -(-N // TH)

    @T.macro
    def body(X, Q, DI, Y, b, s):
        for by in T.thread_binding((b * s + R - 1) // R, thread="blockIdx.y"):
            for bx in T.thread_binding(T.int64(BLOCKS), thread="blockIdx.x"):
                for tx in T.thread_binding(T.int64(TH), thread="threadIdx.x"):
                    acc = T.decl_buffer((R,), "float32", scope="local")
                    wv = T.decl_buffer((G,), "float32", scope="local")
                    cw = T.decl_buffer((CT * TEXEL,), "uint32", scope="local")
                    hv = T.decl_buffer((TEXEL,), "uint32", scope="local")
                    dv = T.decl_buffer((TEXEL,), "uint32", scope="local")
                    if bx * TH + tx < N:
                        for i in T.unroll(R):
                            acc[i] = T.float32(0)
                        for kb in range(sp.superblocks):
                            for t in T.unroll(CT):
                                for c in T.vectorized(TEXEL):
                                    cw[t * TEXEL + c] = Q[(bx * TH + tx) // HA, (bx * TH + tx) % HA, kb * TPS + t, c]
                            for c in T.vectorized(TEXEL):
                                hv[c] = Q[(bx * TH + tx) // HA, (bx * TH + tx) % HA, kb * TPS + CT, c]
                            if not sp.d_in_head:
                                for c in T.vectorized(TEXEL):
                                    dv[c] = DI[(bx * TH + tx) // HD, (bx * TH + tx) % HD, kb // TEXEL, c]
                            for g in T.unroll(NG):
                                for j in T.unroll(G):
                                    wv[j] = _weight(sp, cw, hv, dv, kb, g, j)
                                for i in T.unroll(R):
                                    if by * R + i < b * s:
                                        for j in range(G):
                                            acc[i] = acc[i] + X[(by * R + i) // s, (by * R + i) % s, kb * SB + g * G + j] * wv[j]
                        for i in T.unroll(R):
                            if by * R + i < b * s:
                                Y[(by * R + i) // s, (by * R + i) % s, bx * TH + tx] = acc[i]

    if sp.d_in_head:

        @T.prim_func(private=True)
        def texture_sb_gemm(x_h: T.handle, q_h: T.handle, y_h: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
            b = T.int64()
            s = T.int64()
            X = T.match_buffer(x_h, (b, s, K), "float32")
            Q = T.match_buffer(q_h, A.shape, "uint32", scope="global.texture")
            Y = T.match_buffer(y_h, (b, s, N), "float32")
            body(X, Q, Q, Y, b, s)

        return texture_sb_gemm

    @T.prim_func(private=True)
    def texture_sb_d_gemm(x_h: T.handle, q_h: T.handle, d_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        b = T.int64()
        s = T.int64()
        X = T.match_buffer(x_h, (b, s, K), "float32")
        Q = T.match_buffer(q_h, A.shape, "uint32", scope="global.texture")
        DI = T.match_buffer(d_h, D.shape, "uint32", scope="global.texture")
        Y = T.match_buffer(y_h, (b, s, N), "float32")
        body(X, Q, DI, Y, b, s)

    return texture_sb_d_gemm


def _weight(sp: SuperblockImages, cw: Any, hv: Any, dv: Any, kb: Any, g: Any, j: Any) -> Any:
    """float32 weight of column ``j`` of group ``g`` of superblock ``kb``: code * (sc d) [- m dmin]."""
    d, dmin = sp.d(_dword(sp, hv, dv, kb))
    w = sp.code(cw, g * sp.group + j) * (sp.value(hv, 0, g) * d)
    return w - sp.value(hv, 1, g) * dmin if sp.offset else w


def texture_superblock_take_kernel(info: dict[str, Any], layouts: list[ImageLayout], ids_dtype: str = "int64",
                                   threads: int = 64) -> Any:
    """``out[b, s, :] = W[ids[b, s], :]`` (float32) with W a K-quant in images; one thread per
    (token, superblock)."""
    sp = SuperblockImages.of(info)
    K, TH, G, NG = sp.k, threads, sp.group, sp.groups
    A, D = layouts[0], layouts[-1]
    CT, TPS, HA, HD = sp.code_texels, sp.texels, A.height, D.height
    NSB = sp.superblocks
    BLOCKS = -(-NSB // TH)

    @T.macro
    def body(Q, DI, ids, Out, s, by, kb):
        cw = T.decl_buffer((CT * TEXEL,), "uint32", scope="local")
        hv = T.decl_buffer((TEXEL,), "uint32", scope="local")
        dv = T.decl_buffer((TEXEL,), "uint32", scope="local")
        r = T.Cast("int64", ids[by // s, by % s])
        for t in T.unroll(CT):
            for c in T.vectorized(TEXEL):
                cw[t * TEXEL + c] = Q[r // HA, r % HA, kb * TPS + t, c]
        for c in T.vectorized(TEXEL):
            hv[c] = Q[r // HA, r % HA, kb * TPS + CT, c]
        if not sp.d_in_head:
            for c in T.vectorized(TEXEL):
                dv[c] = DI[r // HD, r % HD, kb // TEXEL, c]
        for g in T.unroll(NG):
            for j in T.unroll(G):
                Out[by // s, by % s, kb * SB + g * G + j] = _weight(sp, cw, hv, dv, kb, g, j)

    if sp.d_in_head:

        @T.prim_func(private=True)
        def texture_sb_take(q_h: T.handle, i_h: T.handle, o_h: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
            b = T.int64()
            s = T.int64()
            Q = T.match_buffer(q_h, A.shape, "uint32", scope="global.texture")
            ids = T.match_buffer(i_h, (b, s), ids_dtype)
            Out = T.match_buffer(o_h, (b, s, K), "float32")
            for by in T.thread_binding(b * s, thread="blockIdx.y"):
                for bx in T.thread_binding(T.int64(BLOCKS), thread="blockIdx.x"):
                    for tx in T.thread_binding(T.int64(TH), thread="threadIdx.x"):
                        if bx * TH + tx < NSB:
                            body(Q, Q, ids, Out, s, by, bx * TH + tx)

        return texture_sb_take

    @T.prim_func(private=True)
    def texture_sb_d_take(q_h: T.handle, d_h: T.handle, i_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        b = T.int64()
        s = T.int64()
        Q = T.match_buffer(q_h, A.shape, "uint32", scope="global.texture")
        DI = T.match_buffer(d_h, D.shape, "uint32", scope="global.texture")
        ids = T.match_buffer(i_h, (b, s), ids_dtype)
        Out = T.match_buffer(o_h, (b, s, K), "float32")
        for by in T.thread_binding(b * s, thread="blockIdx.y"):
            for bx in T.thread_binding(T.int64(BLOCKS), thread="blockIdx.x"):
                for tx in T.thread_binding(T.int64(TH), thread="threadIdx.x"):
                    if bx * TH + tx < NSB:
                        body(Q, DI, ids, Out, s, by, bx * TH + tx)

    return texture_sb_d_take
