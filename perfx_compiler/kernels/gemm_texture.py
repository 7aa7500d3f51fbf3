"""Multi-row matmuls and embedding gathers that read their weight from the OpenCL images of the
Adreno texture path (layouts in ``kernels/gemv_texture.py``).

The decode GEMVs read a weight as an image; prefill, ``prefill_all`` and the batched ``paged_*``
functions use the same weight with more than one row of x, and a tied embedding gathers its rows.
With these kernels every function reads the one image copy, so the buffer form of the weight is not
kept at all (``passes/texture_weights.py``).

* :func:`texture_gemm_kernel` / :func:`texture_q4_gemm_kernel` / :func:`texture_q8_gemm_kernel`:
  ``y[b, s, n] = sum_k x[b, s, k] W[n, k]`` with ``b``, ``s`` symbolic. One thread per output column
  ``n`` and ``rows`` consecutive rows of x (flattened ``b * s``): each weight texel is read and
  dequantized once and applied to all of them (blockIdx.y walks the row tiles).
* :func:`texture_take_kernel`: ``out[b, s, :] = W[ids[b, s], :]`` for the f32 / q4 / q8 images, one
  thread per (token, texel).

Texel loops are unrolled by two, as the GEMV's (the module note of ``gemv_texture.py``: TVM 0.27's
OpenCL codegen prints a serial loop whose body starts with a texel read as an empty loop).
"""

from __future__ import annotations

from typing import Any

from tvm.script import tirx as T

from perfx_compiler.kernels.gemv_texture import (
    TEXEL,
    ImageLayout,
    TextureLimitError,
    group_scale,
    q4_col0,
    q4_columns,
    q4_weight,
    q8_code,
    scale_texel,
)

ROWS = 4  # rows of x per thread


def _q4_parts(info: dict[str, Any]) -> tuple[int, int, int, int, bool, int]:
    N, K, G, L = int(info["N"]), int(info["K"]), int(info["group"]), int(info["lanes"])
    if K % 64 or L % TEXEL or G % TEXEL:
        raise TextureLimitError(f"texture q4 kernels need K % 64 == 0 and lanes, group multiples of 4 (K={K})")
    return N, K, G, L, bool(info.get("offset")), q4_columns(info)


# -- multi-row matmuls --------------------------------------------------------------------------
def texture_gemm_kernel(n: int, k: int, layout: ImageLayout, threads: int = 64, rows: int = ROWS) -> Any:
    """float32 W [n, k] in an RGBA32F image; x [b, s, k] -> y [b, s, n]."""
    texels = k // TEXEL
    if k % TEXEL or texels % 2:
        raise TextureLimitError(f"texture GEMM needs K divisible by {2 * TEXEL}, got {k}")
    N, TH, H, R = n, threads, layout.height, rows
    BLOCKS = -(-N // TH)

    @T.prim_func(private=True)
    def texture_gemm(x_h: T.handle, w_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        b = T.int64()
        s = T.int64()
        X = T.match_buffer(x_h, (b, s, k), "float32")
        W = T.match_buffer(w_h, layout.shape, "float32", scope="global.texture")
        Y = T.match_buffer(y_h, (b, s, N), "float32")
        for by in T.thread_binding((b * s + R - 1) // R, thread="blockIdx.y"):
            for bx in T.thread_binding(T.int64(BLOCKS), thread="blockIdx.x"):
                for tx in T.thread_binding(T.int64(TH), thread="threadIdx.x"):
                    acc = T.decl_buffer((R,), "float32", scope="local")
                    texel = T.decl_buffer((TEXEL,), "float32", scope="local")
                    if bx * TH + tx < N:
                        for i in T.unroll(R):
                            acc[i] = T.float32(0)
                        for ko in range(texels // 2):
                            for ki in T.unroll(2):
                                for c in T.vectorized(TEXEL):
                                    texel[c] = W[(bx * TH + tx) // H, (bx * TH + tx) % H, ko * 2 + ki, c]
                                for i in T.unroll(R):
                                    if by * R + i < b * s:
                                        for c in range(TEXEL):
                                            acc[i] = acc[i] + X[(by * R + i) // s, (by * R + i) % s,
                                                                (ko * 2 + ki) * TEXEL + c] * texel[c]
                        for i in T.unroll(R):
                            if by * R + i < b * s:
                                Y[(by * R + i) // s, (by * R + i) % s, bx * TH + tx] = acc[i]

    return texture_gemm


def _quant_image_gemm(N: int, K: int, texels: int, per: int, codes: ImageLayout, scales: ImageLayout,
                      threads: int, rows: int, dequant: Any, dot: Any) -> Any:
    """Shared body of the int4 / int8 multi-row kernels: per code texel, ``dequant`` (Q, S, word, sv,
    wv, row, t, HS) writes the texel's ``per`` dequantized weights to ``wv`` (column order given by
    the format's); then ``dot`` (X, wv, acc, mb, ms, i, t) adds them times x row (mb, ms) to acc[i]."""
    TH, HC, HS, R = threads, codes.height, scales.height, rows
    BLOCKS = -(-N // TH)

    @T.prim_func(private=True)
    def texture_quant_gemm(x_h: T.handle, q_h: T.handle, s_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        b = T.int64()
        s = T.int64()
        X = T.match_buffer(x_h, (b, s, K), "float32")
        Q = T.match_buffer(q_h, codes.shape, "uint32", scope="global.texture")
        S = T.match_buffer(s_h, scales.shape, "uint32", scope="global.texture")
        Y = T.match_buffer(y_h, (b, s, N), "float32")
        for by in T.thread_binding((b * s + R - 1) // R, thread="blockIdx.y"):
            for bx in T.thread_binding(T.int64(BLOCKS), thread="blockIdx.x"):
                for tx in T.thread_binding(T.int64(TH), thread="threadIdx.x"):
                    acc = T.decl_buffer((R,), "float32", scope="local")
                    word = T.decl_buffer((TEXEL,), "uint32", scope="local")
                    sv = T.decl_buffer((TEXEL,), "uint32", scope="local")
                    wv = T.decl_buffer((per,), "float32", scope="local")
                    if bx * TH + tx < N:
                        for i in T.unroll(R):
                            acc[i] = T.float32(0)
                        for ko in range(texels // 2):
                            for ki in T.unroll(2):
                                for c in T.vectorized(TEXEL):
                                    word[c] = Q[(bx * TH + tx) // HC, (bx * TH + tx) % HC, ko * 2 + ki, c]
                                dequant(S, word, sv, wv, bx * TH + tx, ko * 2 + ki, HS)
                                for i in T.unroll(R):
                                    if by * R + i < b * s:
                                        dot(X, wv, acc, (by * R + i) // s, (by * R + i) % s, i, ko * 2 + ki)
                        for i in T.unroll(R):
                            if by * R + i < b * s:
                                Y[(by * R + i) // s, (by * R + i) % s, bx * TH + tx] = acc[i]

    return texture_quant_gemm


def texture_q4_gemm_kernel(info: dict[str, Any], codes: ImageLayout, scales: ImageLayout, threads: int = 64,
                           rows: int = ROWS) -> Any:
    """int4 (``formats/int4.py`` layout) W with codes and (scale, min|zero) in images; x [b, s, K]."""
    N, K, G, L, offset, cols = _q4_parts(info)
    texels = K // 8 // TEXEL
    if texels % 2:
        raise TextureLimitError(f"texture q4 GEMM needs an even number of code texels per row (K={K})")

    @T.macro
    def dequant(S, word, sz, wv, row, t, HS):
        # wv[4 j + c] = weight of column col0(t, j) + c; sz = the scale texel holding its group
        for j in T.unroll(8):
            for c in T.vectorized(TEXEL):
                sz[c] = S[row // HS, row % HS, scale_texel(q4_col0(t, j, L) // G, cols), c]
            for c in range(TEXEL):
                wv[j * TEXEL + c] = q4_weight(word[c], j, sz, q4_col0(t, j, L) // G, offset, cols)

    @T.macro
    def dot(X, wv, acc, mb, ms, i, t):
        for j in T.unroll(8):
            for c in range(TEXEL):
                acc[i] = acc[i] + X[mb, ms, q4_col0(t, j, L) + c] * wv[j * TEXEL + c]

    return _quant_image_gemm(N, K, texels, 32, codes, scales, threads, rows, dequant, dot)


def texture_q8_gemm_kernel(info: dict[str, Any], codes: ImageLayout, scales: ImageLayout, threads: int = 64,
                           rows: int = ROWS) -> Any:
    """int8 (``formats/int8.py``) W: code bytes as uint32 words and scales in images; x [b, s, K]."""
    N, K, G = int(info["N"]), int(info["K"]), int(info["group"])
    texels = K // 16
    if K % 32 or texels % 2 or G % 16:
        raise TextureLimitError(f"texture q8 GEMM needs K % 32 == 0 and a group multiple of 16 (K={K}, G={G})")

    @T.macro
    def dequant(S, word, sc, wv, row, t, HS):
        # 16 columns a texel, one group: wv = codes * the group's scale
        for c in T.vectorized(TEXEL):
            sc[c] = S[row // HS, row % HS, scale_texel(t * 16 // G, 1), c]
        for c in range(TEXEL):
            for bb in T.unroll(4):
                wv[c * 4 + bb] = q8_code(word[c], bb) * group_scale(sc, t * 16 // G, 1)

    @T.macro
    def dot(X, wv, acc, mb, ms, i, t):
        for c in range(16):
            acc[i] = acc[i] + X[mb, ms, t * 16 + c] * wv[c]

    return _quant_image_gemm(N, K, texels, 16, codes, scales, threads, rows, dequant, dot)



# -- embedding gather ---------------------------------------------------------------------------
def texture_take_kernel(fmt: str, k: int, codes: ImageLayout, scales: ImageLayout | None = None,
                        info: dict[str, Any] | None = None, ids_dtype: str = "int64", threads: int = 64) -> Any:
    """``out[b, s, :] = W[ids[b, s], :]`` (float32) with W in the images of format ``fmt``
    (``f32`` | ``q4`` | ``q8``; ``info``: the ``perfx.quant`` info of q4 / q8). One thread per
    (token, code texel)."""
    TH, HC = threads, codes.height
    HS = scales.height if scales is not None else 1
    texels = codes.width
    BLOCKS = -(-texels // TH)
    if fmt == "q4":
        _, K, G, L, offset, cols = _q4_parts(info or {})
    elif fmt == "q8":
        K, G = int((info or {})["K"]), int((info or {})["group"])
        if K % 16 or G % 16:
            raise TextureLimitError(f"texture q8 gather needs K % 16 == 0 and a group multiple of 16 (K={K})")
    elif fmt != "f32" or k % TEXEL:
        raise TextureLimitError(f"texture gather: format {fmt}, K={k}")

    @T.macro
    def row_texel(Q, S, Out, r, t, ob, os, sv, word, sw):
        # sv: a float32 texel (f32 weights), word / sw: the code and scale texels
        if fmt == "f32":
            for c in T.vectorized(TEXEL):
                sv[c] = Q[r // HC, r % HC, t, c]
            for c in range(TEXEL):
                Out[ob, os, t * TEXEL + c] = sv[c]
        elif fmt == "q8":
            for c in T.vectorized(TEXEL):
                word[c] = Q[r // HC, r % HC, t, c]
            for c in T.vectorized(TEXEL):
                sw[c] = S[r // HS, r % HS, scale_texel(t * 16 // G, 1), c]
            for c in range(TEXEL):
                for bb in T.unroll(4):
                    Out[ob, os, t * 16 + c * 4 + bb] = q8_code(word[c], bb) * group_scale(sw, t * 16 // G, 1)
        else:
            for c in T.vectorized(TEXEL):
                word[c] = Q[r // HC, r % HC, t, c]
            for j in T.unroll(8):
                for c in T.vectorized(TEXEL):
                    sw[c] = S[r // HS, r % HS, scale_texel(q4_col0(t, j, L) // G, cols), c]
                for c in range(TEXEL):
                    Out[ob, os, q4_col0(t, j, L) + c] = q4_weight(word[c], j, sw, q4_col0(t, j, L) // G, offset, cols)

    if fmt == "f32":

        @T.prim_func(private=True)
        def texture_take(q_h: T.handle, i_h: T.handle, o_h: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
            b = T.int64()
            s = T.int64()
            Q = T.match_buffer(q_h, codes.shape, "float32", scope="global.texture")
            ids = T.match_buffer(i_h, (b, s), ids_dtype)
            Out = T.match_buffer(o_h, (b, s, k), "float32")
            for by in T.thread_binding(b * s, thread="blockIdx.y"):
                for bx in T.thread_binding(T.int64(BLOCKS), thread="blockIdx.x"):
                    for tx in T.thread_binding(T.int64(TH), thread="threadIdx.x"):
                        sv = T.decl_buffer((TEXEL,), "float32", scope="local")
                        word = T.decl_buffer((TEXEL,), "uint32", scope="local")
                        if bx * TH + tx < texels:
                            row_texel(Q, Q, Out, T.Cast("int64", ids[by // s, by % s]), bx * TH + tx,
                                      by // s, by % s, sv, word, word)

        return texture_take

    @T.prim_func(private=True)
    def texture_quant_take(q_h: T.handle, s_h: T.handle, i_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        b = T.int64()
        s = T.int64()
        Q = T.match_buffer(q_h, codes.shape, "uint32", scope="global.texture")
        S = T.match_buffer(s_h, scales.shape, "uint32", scope="global.texture")
        ids = T.match_buffer(i_h, (b, s), ids_dtype)
        Out = T.match_buffer(o_h, (b, s, k), "float32")
        for by in T.thread_binding(b * s, thread="blockIdx.y"):
            for bx in T.thread_binding(T.int64(BLOCKS), thread="blockIdx.x"):
                for tx in T.thread_binding(T.int64(TH), thread="threadIdx.x"):
                    word = T.decl_buffer((TEXEL,), "uint32", scope="local")
                    sw = T.decl_buffer((TEXEL,), "uint32", scope="local")
                    if bx * TH + tx < texels:
                        row_texel(Q, S, Out, T.Cast("int64", ids[by // s, by % s]), bx * TH + tx,
                                  by // s, by % s, sw, word, sw)

    return texture_quant_take
