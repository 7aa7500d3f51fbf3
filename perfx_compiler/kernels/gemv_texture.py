"""GEMV with the weight read through OpenCL images (Adreno's texture path), the packing of weights
into images, and the Adreno TIR pipeline.

Adreno GPUs read weights fastest through the texture units (L1 texture cache, 4-channel texels). A
weight matrix becomes an ``image2d_array_t`` of RGBA texels: row ``n`` of the matrix is texel row
``n % height`` of layer ``n // height`` (rows past the image height limit fold into further layers),
texel ``t`` of a row holds the row's 4 consecutive 32-bit words ``4t .. 4t+3``:

* ``f32``: the float weights (RGBA32F); texel t = ``W[n, 4t:4t+4]``.
* ``q4`` (int4 codes, ``formats/int4.py`` layout): the uint32 code words (RGBA32UI), 32 codes a texel;
  scales (and zeros / mins) go to a second image.
* ``q8`` (int8 codes, ``formats/int8.py``): the codes' bytes as uint32 words (RGBA32UI), 16 codes a
  texel; scales to a second image.

Scale images hold the float16 values' own bits (RGBA32UI, :func:`pack_scales`), decoded to float32 by
integer operations (``kernels/half_bits.te_half``): OpenCL reads float16 only with cl_khr_fp16, and
float32 images took twice the scale bytes (Q4_0 on images was 1.33x the file with its column of 8s, now
1.0x). One column (q8, symmetric q4): 8 scales a texel, two a word, low half first; two columns (scale
and zero | min): 4 groups a texel, a word each, the scale in the low half.

The buffers are declared in scope ``global.texture``: TVM's ``TextureFlatten`` turns their loads into
``texture2d_load`` and the OpenCL codegen into image reads. For uint32 images TVM 0.27 prints
``as_uint4(READ_IMAGEF(...))`` (a float read of an integer image is undefined in OpenCL, and a
bit-cast through float may flush denormal patterns): :func:`register_opencl_postproc` rewrites it to
``read_imageui`` through TVM's ``tvm_callback_opencl_postproc`` hook, for every OpenCL build.

:func:`adreno_tir_pipeline` assembles the lowering TVM 0.27 registers for Adreno but cannot be used as
registered (``get_tir_pipeline("adreno")`` returns one Pass where every caller unpacks a
(pipeline, finalize_host, finalize_device) triple); it is registered as ``perfx_adreno`` for
``tvm.compile(..., tir_pipeline="perfx_adreno")``.

One thread per output row, ``threads`` rows per block; the loop over texels is unrolled by two. The
unroll is also a workaround: in TVM 0.27 the OpenCL codegen prints a serial loop whose body starts with
a texel read as an empty loop; with the read in an unrolled inner loop it prints correctly (checked on
PoCL against numpy). So the texels per row must be even.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
from tvm.script import tirx as T

TEXEL = 4  # RGBA channels (32-bit words) per texel
PIPELINE_NAME = "perfx_adreno"


def adreno_tir_pipeline() -> tuple[Any, Any, Any]:
    """(pipeline, finalize_host, finalize_device) for ``opencl -device=adreno`` with texture lowering."""
    from tvm.s_tir.backend.adreno.pipeline import default_tir_pipeline
    from tvm.tirx import compilation_pipeline

    register_opencl_postproc()
    _, finalize_host, finalize_device = compilation_pipeline.get_tir_pipeline("s_tir")
    return default_tir_pipeline(), finalize_host, finalize_device


def register_pipeline() -> str:
    """Register :func:`adreno_tir_pipeline` as a named TIR pipeline; return its name."""
    from tvm.tirx import compilation_pipeline

    compilation_pipeline.register_tir_pipeline(PIPELINE_NAME, adreno_tir_pipeline)
    register_opencl_postproc()
    return PIPELINE_NAME


_UINT_READ = re.compile(r"as_uint4\(READ_IMAGEF\(")


def fix_uint_image_reads(code: str) -> str:
    """``as_uint4(READ_IMAGEF(img, s, c))`` -> ``read_imageui(img, s, c)`` (same parentheses)."""
    return _UINT_READ.sub("(read_imageui(", code)


def register_opencl_postproc() -> None:
    """Install :func:`fix_uint_image_reads` as TVM's OpenCL source post-processing hook (idempotent).
    It changes only uint image reads, which no other PerfX kernel emits."""
    import tvm_ffi

    if tvm_ffi.get_global_func("tvm_callback_opencl_postproc", allow_missing=True) is not None:
        return

    def postproc(code: str, _target: Any) -> str:
        return fix_uint_image_reads(str(code))

    tvm_ffi.register_global_func("tvm_callback_opencl_postproc", postproc)


# -- layout -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ImageLayout:
    """One image2d_array: ``layers`` x ``height`` x ``width`` RGBA texels holding ``rows`` matrix rows."""

    rows: int
    width: int
    height: int
    layers: int
    fmt: str  # RGBA32F | RGBA32UI | RGBA16F

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.layers, self.height, self.width, TEXEL)

class TextureLimitError(ValueError):
    """The matrix does not fit the target's image limits (the GEMV then keeps reading a buffer)."""


def image_layout(rows: int, texels: int, fmt: str, limits: dict[str, int]) -> ImageLayout:
    """Fold ``rows`` rows of ``texels`` texels into an image array within ``limits``
    (``max_width``, ``max_height``, ``max_layers``)."""
    if texels > limits["max_width"]:
        raise TextureLimitError(f"{texels} texels per row > image width limit {limits['max_width']}")
    layers = -(-rows // limits["max_height"])
    if layers > limits["max_layers"]:
        raise TextureLimitError(f"{rows} rows need {layers} layers > {limits['max_layers']}")
    return ImageLayout(rows, texels, -(-rows // layers), layers, fmt)


def pack_image(words: np.ndarray, layout: ImageLayout) -> np.ndarray:
    """[rows, 4 * width] 32-bit words -> [layers, height, width, 4] (rows past ``rows`` zero)."""
    rows, cols = words.shape
    assert rows == layout.rows and cols == TEXEL * layout.width, (words.shape, layout)
    out = np.zeros((layout.layers * layout.height, cols), words.dtype)
    out[:rows] = words
    return out.reshape(layout.shape)


def scale_groups_per_texel(columns: int) -> int:
    """Groups a scale texel holds: 8 scales alone, 4 (scale, zero | min) pairs (module docstring)."""
    return 8 if columns == 1 else 4


def scale_layout(rows: int, groups: int, columns: int, limits: dict[str, int]) -> ImageLayout:
    """The RGBA32UI image of ``rows`` rows of ``groups`` groups, ``columns`` float16 values a group."""
    return image_layout(rows, -(-groups // scale_groups_per_texel(columns)), "RGBA32UI", limits)


def pack_scales(columns: list[np.ndarray], layout: ImageLayout) -> np.ndarray:
    """Per-group arrays [rows, ng] (float16 scales / mins, or uint8 zeros: all exact in float16) as
    their float16 bits in uint32 [layers, height, width, 4] (module docstring); missing groups zero."""
    rows, ng = columns[0].shape
    halves = np.zeros((rows, layout.width * scale_groups_per_texel(len(columns)), len(columns)), np.float16)
    for i, c in enumerate(columns):
        c = np.asarray(c)
        if c.dtype != np.float16 and not np.array_equal(c.astype(np.float16).astype(c.dtype), c):
            raise ValueError(f"scale image: {c.dtype} values not exact in float16")
        halves[:, :ng, i] = c
    return pack_image(halves.reshape(rows, -1).view(np.uint32), layout)


def scale_texel(g: Any, columns: int) -> Any:
    """Texel (column of the scale image) of group ``g``."""
    return g // scale_groups_per_texel(columns)


def group_scale(sv: Any, g: Any, columns: int) -> Any:
    """float32 scale of group ``g`` from its scale texel ``sv`` (4 uint32 words)."""
    from perfx_compiler.kernels.half_bits import te_half

    if columns == 1:
        return te_half((sv[g // 2 % 4] >> T.uint32(16) * T.Cast("uint32", g % 2)) & T.uint32(0xFFFF))
    return te_half(sv[g % 4] & T.uint32(0xFFFF))


def group_second(sv: Any, g: Any) -> Any:
    """float32 zero | min of group ``g`` (two-column texels)."""
    from perfx_compiler.kernels.half_bits import te_half

    return te_half(sv[g % 4] >> T.uint32(16))


# -- kernels ------------------------------------------------------------------------------------
def texture_gemv_kernel(n: int, k: int, threads: int = 64, layout: ImageLayout | None = None) -> Any:
    """y[0, 0, n] = sum_k x[0, 0, k] * W[n, k] with W in a ``f32`` image (:func:`image_layout`)."""
    texels = k // TEXEL
    if k % TEXEL or texels % 2:
        raise TextureLimitError(f"texture GEMV needs K divisible by {2 * TEXEL}, got {k}")
    lay = layout or ImageLayout(n, texels, n, 1, "RGBA32F")
    N, TH, H = n, threads, lay.height
    BLOCKS = -(-N // TH)

    @T.prim_func(private=True)
    def texture_gemv(x_h: T.handle, w_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        X = T.match_buffer(x_h, (1, 1, k), "float32")
        W = T.match_buffer(w_h, lay.shape, "float32", scope="global.texture")
        Y = T.match_buffer(y_h, (1, 1, N), "float32")
        for bx in T.thread_binding(BLOCKS, thread="blockIdx.x"):
            for tx in T.thread_binding(TH, thread="threadIdx.x"):
                acc = T.decl_buffer((1,), "float32", scope="local")
                texel = T.decl_buffer((TEXEL,), "float32", scope="local")
                if bx * TH + tx < N:
                    acc[0] = T.float32(0)
                    for ko in range(texels // 2):
                        for ki in T.unroll(2):
                            for c in T.vectorized(TEXEL):
                                texel[c] = W[(bx * TH + tx) // H, (bx * TH + tx) % H, ko * 2 + ki, c]
                            for c in range(TEXEL):
                                acc[0] = acc[0] + X[0, 0, (ko * 2 + ki) * TEXEL + c] * texel[c]
                    Y[0, 0, bx * TH + tx] = acc[0]

    return texture_gemv


def _quant_image_gemv(N: int, K: int, texels: int, codes: ImageLayout, scales: ImageLayout, threads: int,
                      accumulate: Any) -> Any:
    """The quantized GEMV shared by the int4 and int8 formats: one thread per output row reads the row's
    code texels (two per step, see the module note on the unroll) and hands each to the format's
    ``accumulate`` macro (X, S, word, sv, part, acc, row, t, HS): texel ``t`` of row ``row`` is in
    ``word``; ``sv`` (a texel of scales) and ``part`` are its scratch."""
    TH, HC, HS = threads, codes.height, scales.height
    BLOCKS = -(-N // TH)

    @T.prim_func(private=True)
    def texture_quant_gemv(x_h: T.handle, q_h: T.handle, s_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        X = T.match_buffer(x_h, (1, 1, K), "float32")
        Q = T.match_buffer(q_h, codes.shape, "uint32", scope="global.texture")
        S = T.match_buffer(s_h, scales.shape, "uint32", scope="global.texture")
        Y = T.match_buffer(y_h, (1, 1, N), "float32")
        for bx in T.thread_binding(BLOCKS, thread="blockIdx.x"):
            for tx in T.thread_binding(TH, thread="threadIdx.x"):
                acc = T.decl_buffer((1,), "float32", scope="local")
                part = T.decl_buffer((1,), "float32", scope="local")
                word = T.decl_buffer((TEXEL,), "uint32", scope="local")
                sv = T.decl_buffer((TEXEL,), "uint32", scope="local")
                if bx * TH + tx < N:
                    acc[0] = T.float32(0)
                    for ko in range(texels // 2):
                        for ki in T.unroll(2):
                            for c in T.vectorized(TEXEL):
                                word[c] = Q[(bx * TH + tx) // HC, (bx * TH + tx) % HC, ko * 2 + ki, c]
                            accumulate(X, S, word, sv, part, acc, bx * TH + tx, ko * 2 + ki, HS)
                    Y[0, 0, bx * TH + tx] = acc[0]

    return texture_quant_gemv


# Dequantization expressions the texture GEMVs and GEMMs (gemm_texture.py) share: built in Python and
# written inline (an assignment inside the prim_func becomes a local buffer, and TVM's CSE then merges
# texture reads whose indices load it at different points).
def q4_col0(t: Any, j: int, L: int) -> Any:
    """First of the 4 consecutive columns that nibble ``j`` of code texel ``t`` holds (``formats/int4.py`` lanes)."""
    return (t * TEXEL // L) * (8 * L) + j * L + t * TEXEL % L


def q4_columns(info: dict[str, Any]) -> int:
    """Scale-image values a group of an int4 weight: 1 (symmetric: zero point 8, no array), else 2."""
    return 1 if info.get("sym") and not info.get("offset") else 2


def q4_weight(word: Any, j: int, sz: Any, g: Any, offset: bool, columns: int) -> Any:
    """Weight of nibble ``j`` of ``word`` in group ``g``; sz = the scale texel holding that group:
    code * scale + min (``offset``) or (code - zero) * scale (zero 8 with one column)."""
    code = T.Cast("float32", (word >> T.uint32(4) * T.Cast("uint32", j)) & T.uint32(15))
    if offset:
        return code * group_scale(sz, g, columns) + group_second(sz, g)
    zero = T.float32(8) if columns == 1 else group_second(sz, g)
    return (code - zero) * group_scale(sz, g, columns)


def q8_code(w: Any, b: Any) -> Any:
    """Byte ``b`` of word ``w``, sign-extended without 8-bit types."""
    return T.Cast("float32", (T.Cast("int32", (w >> T.uint32(8) * T.Cast("uint32", b)) & T.uint32(255)) ^ 128) - 128)


def texture_q4_gemv_kernel(info: dict[str, Any], codes: ImageLayout, scales: ImageLayout, threads: int = 64) -> Any:
    """int4 GEMV (``perfx.quant`` info of ``formats/int4.py``) with codes and scales in images:
    w = code * scale + min (``offset``) or (code - zero) * scale."""
    N, K, G, L = int(info["N"]), int(info["K"]), int(info["group"]), int(info["lanes"])
    offset, cols = bool(info.get("offset")), q4_columns(info)
    texels = K // 8 // TEXEL
    if K % 32 or texels % 2 or L % TEXEL or G % TEXEL:
        raise TextureLimitError(f"texture q4 GEMV needs K % 64 == 0 and lanes, group multiples of 4 (K={K})")

    @T.macro
    def accumulate(X, S, word, sz, part, acc, row, t, HS):
        # the texel's 4 words share block kb and lanes l0..l0+3: per nibble j they hold 4 consecutive
        # columns of one group; sz = the scale texel holding that group
        for j in T.unroll(8):
            for c in T.vectorized(TEXEL):
                sz[c] = S[row // HS, row % HS, scale_texel(q4_col0(t, j, L) // G, cols), c]
            for c in range(TEXEL):
                acc[0] = acc[0] + X[0, 0, q4_col0(t, j, L) + c] * q4_weight(
                    word[c], j, sz, q4_col0(t, j, L) // G, offset, cols)

    return _quant_image_gemv(N, K, texels, codes, scales, threads, accumulate)


def texture_q8_gemv_kernel(info: dict[str, Any], codes: ImageLayout, scales: ImageLayout, threads: int = 64) -> Any:
    """int8 GEMV (``formats/int8.py``) with the code bytes (as uint32 words) and scales in images."""
    N, K, G = int(info["N"]), int(info["K"]), int(info["group"])
    texels = K // 16
    if K % 32 or texels % 2 or G % 16:
        raise TextureLimitError(f"texture q8 GEMV needs K % 32 == 0 and a group multiple of 16 (K={K}, G={G})")

    @T.macro
    def accumulate(X, S, word, sc, part, acc, row, t, HS):
        # 16 columns a texel, all in one group: sum them, then one multiply by the group's scale
        for c in T.vectorized(TEXEL):
            sc[c] = S[row // HS, row % HS, scale_texel(t * 16 // G, 1), c]
        part[0] = T.float32(0)
        for c in range(TEXEL):
            for b in T.unroll(4):
                part[0] = part[0] + X[0, 0, t * 16 + c * 4 + b] * q8_code(word[c], b)
        acc[0] = acc[0] + part[0] * group_scale(sc, t * 16 // G, 1)

    return _quant_image_gemv(N, K, texels, codes, scales, threads, accumulate)

