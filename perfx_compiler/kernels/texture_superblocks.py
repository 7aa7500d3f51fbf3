"""GEMV, multi-row GEMM and embedding gather on GGUF superblock weights (K-quants, IQ4_XS) in the
OpenCL images of Adreno's texture path; the layout, its packing and the field decoding are
``formats/superblock_images.py``'s :class:`SuperblockImages` (``sp`` below), which the caller
(``passes/texture_weights.py``) passes in.

Every kernel walks a row a run of superblocks at a time: a superblock's texels are read once (the code
texels in an unrolled loop first: gemv_texture.py's note on TVM 0.27's OpenCL codegen) and every field
is then taken from registers at indices fixed at compile time. Sums as the buffer kernels:
``sum_g (sc_g d) sum_j x_j q_j - (m_g dmin) sum_j x_j``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tvm.script import tirx as T

from perfx_compiler.kernels.gemv_texture import TEXEL, ImageLayout

if TYPE_CHECKING:
    from perfx_compiler.formats.superblock_images import SuperblockImages

SB = 256  # weights a superblock
ROWS = 4  # rows of x per thread in the multi-row kernel (as gemm_texture.py's)


@T.macro
def _load_superblock(sp: Any, Q: Any, DI: Any, cw: Any, hv: Any, dv: Any, row: Any, u: Any, slot: Any) -> None:
    """Read superblock ``slot`` of run ``u`` of matrix row ``row``: its code texels (first, unrolled: the
    module note), its run's head texel and, without d in the head, the texel of d words holding its d."""
    for t in T.unroll(sp.code_texels):
        for c in T.vectorized(TEXEL):
            cw[t * TEXEL + c] = Q[row // Q.shape[1], row % Q.shape[1], u * sp.unit_texels + 1 + slot * sp.code_texels + t, c]
    for c in T.vectorized(TEXEL):
        hv[c] = Q[row // Q.shape[1], row % Q.shape[1], u * sp.unit_texels, c]
    if not sp.d_in_head:
        for c in T.vectorized(TEXEL):
            dv[c] = DI[row // DI.shape[1], row % DI.shape[1], (u * sp.shared + slot) // TEXEL, c]


def texture_superblock_gemv_kernel(sp: SuperblockImages, layouts: list[ImageLayout], threads: int = 64) -> Any:
    """y[0, 0, n] = sum_k x[0, 0, k] W[n, k] with W a superblock type in the images of ``sp``; one thread
    per output row."""
    N, K, TH, G, NG, P = sp.n, sp.k, threads, sp.group, sp.groups, sp.shared
    A, D = layouts[0], layouts[-1]
    BLOCKS = -(-N // TH)

    @T.macro
    def body(X, Q, DI, Y):
        for bx in T.thread_binding(BLOCKS, thread="blockIdx.x"):
            for tx in T.thread_binding(TH, thread="threadIdx.x"):
                acc = T.decl_buffer((1,), "float32", scope="local")
                part = T.decl_buffer((2,), "float32", scope="local")
                cw = T.decl_buffer((sp.code_texels * TEXEL,), "uint32", scope="local")
                hv = T.decl_buffer((TEXEL,), "uint32", scope="local")
                dv = T.decl_buffer((TEXEL,), "uint32", scope="local")
                if bx * TH + tx < N:
                    acc[0] = T.float32(0)
                    for u in range(sp.units):
                        for slot in T.unroll(P):
                            if u * P + slot < sp.superblocks:
                                _load_superblock(sp, Q, DI, cw, hv, dv, bx * TH + tx, u, slot)
                                for g in T.unroll(NG):
                                    part[0] = T.float32(0)
                                    part[1] = T.float32(0)
                                    for j in T.unroll(G):
                                        part[0] = part[0] + X[0, 0, (u * P + slot) * SB + g * G + j] * sp.code(cw, g * G + j)
                                        if sp.offset:
                                            part[1] = part[1] + X[0, 0, (u * P + slot) * SB + g * G + j]
                                    if sp.offset:
                                        acc[0] = (acc[0] + part[0] * sp.factors(hv, dv, u * P + slot, slot, g)[0]
                                                  - part[1] * sp.factors(hv, dv, u * P + slot, slot, g)[1])
                                    else:
                                        acc[0] = acc[0] + part[0] * sp.factors(hv, dv, u * P + slot, slot, g)[0]
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


def texture_superblock_gemm_kernel(sp: SuperblockImages, layouts: list[ImageLayout], threads: int = 64,
                                   rows: int = ROWS) -> Any:
    """y[b, s, n] = sum_k x[b, s, k] W[n, k] (``b``, ``s`` symbolic) with W a superblock type in the images of
    ``sp``: one thread per output column and ``rows`` rows of x; each group is dequantized once for all of them."""
    N, K, TH, G, NG, R, P = sp.n, sp.k, threads, sp.group, sp.groups, rows, sp.shared
    A, D = layouts[0], layouts[-1]
    BLOCKS = -(-N // TH)

    @T.macro
    def body(X, Q, DI, Y, b, s):
        for by in T.thread_binding((b * s + R - 1) // R, thread="blockIdx.y"):
            for bx in T.thread_binding(T.int64(BLOCKS), thread="blockIdx.x"):
                for tx in T.thread_binding(T.int64(TH), thread="threadIdx.x"):
                    acc = T.decl_buffer((R,), "float32", scope="local")
                    wv = T.decl_buffer((G,), "float32", scope="local")
                    cw = T.decl_buffer((sp.code_texels * TEXEL,), "uint32", scope="local")
                    hv = T.decl_buffer((TEXEL,), "uint32", scope="local")
                    dv = T.decl_buffer((TEXEL,), "uint32", scope="local")
                    if bx * TH + tx < N:
                        for i in T.unroll(R):
                            acc[i] = T.float32(0)
                        for u in range(sp.units):
                            for slot in T.unroll(P):
                                if u * P + slot < sp.superblocks:
                                    _load_superblock(sp, Q, DI, cw, hv, dv, bx * TH + tx, u, slot)
                                    for g in T.unroll(NG):
                                        for j in T.unroll(G):
                                            wv[j] = sp.weight(cw, hv, dv, u * P + slot, slot, g, j)
                                        for i in T.unroll(R):
                                            if by * R + i < b * s:
                                                for j in range(G):
                                                    acc[i] = acc[i] + X[(by * R + i) // s, (by * R + i) % s,
                                                                        (u * P + slot) * SB + g * G + j] * wv[j]
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


def texture_superblock_take_kernel(sp: SuperblockImages, layouts: list[ImageLayout], ids_dtype: str = "int64",
                                   threads: int = 64) -> Any:
    """``out[b, s, :] = W[ids[b, s], :]`` (float32) with W a superblock type in the images of ``sp``; one
    thread per (token, run of superblocks)."""
    K, TH, G, NG, P = sp.k, threads, sp.group, sp.groups, sp.shared
    A, D = layouts[0], layouts[-1]
    BLOCKS = -(-sp.units // TH)

    @T.macro
    def body(Q, DI, ids, Out, s, by, u):
        cw = T.decl_buffer((sp.code_texels * TEXEL,), "uint32", scope="local")
        hv = T.decl_buffer((TEXEL,), "uint32", scope="local")
        dv = T.decl_buffer((TEXEL,), "uint32", scope="local")
        for slot in T.unroll(P):
            if u * P + slot < sp.superblocks:
                _load_superblock(sp, Q, DI, cw, hv, dv, T.Cast("int64", ids[by // s, by % s]), u, slot)
                for g in T.unroll(NG):
                    for j in T.unroll(G):
                        Out[by // s, by % s, (u * P + slot) * SB + g * G + j] = sp.weight(cw, hv, dv, u * P + slot, slot, g, j)

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
                        if bx * TH + tx < sp.units:
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
                    if bx * TH + tx < sp.units:
                        body(Q, DI, ids, Out, s, by, bx * TH + tx)

    return texture_sb_d_take
