"""texture_weights (Adreno, ``templates.gpu_gemv.texture``): a weight that decode's GEMV reads becomes one
RGBA32F image ``<W>__tex`` ([layers, height, width, 4]) and only that: decode's linear calls the texture
GEMV, prefill's the texture GEMM. An int4 weight (quantize_int4's kernels) becomes an RGBA32UI image of its
code words and an RGBA32UI one of its (scale, zero) pairs as float16 bits, read by the texture int4 GEMV / GEMM. A weight
with a read no texture kernel replaces keeps its buffer.

The kernels are compared by identity to their generators (``kernels.gemv_texture.texture_gemv_kernel``,
``kernels.gemm_texture.texture_gemm_kernel``, their int4 variants, with the expected image layouts and the
target's 64 threads),
the Relax functions as written here, the image to ``gemv_texture.pack_image``.
"""

from __future__ import annotations

import json

import numpy as np
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from perfx_compiler.formats.int4 import int4_matmul_compute
from perfx_compiler.kernels.gemm_texture import texture_gemm_kernel, texture_q4_gemm_kernel
from perfx_compiler.kernels.gemv_texture import ImageLayout, texture_gemv_kernel, texture_q4_gemv_kernel
from perfx_compiler.passes import texture_weights

from ._util import assert_unchanged, context, opaque, rand, run_pass, with_kernels

LAYOUT = ImageLayout(rows=8, width=4, height=8, layers=1, fmt="RGBA32F")  # 8 rows of 16 floats: 4 texels a row


@I.ir_module
class Before:
    @R.function
    def decode(x: R.Tensor((1, 1, 16), "float32"), w: R.Tensor((8, 16), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            pt = R.permute_dims(w, axes=[1, 0])
            y = R.matmul(x, pt)
            R.output(y)
        return y

    @R.function
    def prefill(x: R.Tensor((1, "seq", 16), "float32"), w: R.Tensor((8, 16), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            pt = R.permute_dims(w, axes=[1, 0])
            y = R.matmul(x, pt)
            R.output(y)
        return y


@I.ir_module(check_well_formed=False)
class Expected:
    @T.prim_func(private=True)
    def texture_gemv_8_16_l1():
        T.evaluate(0)

    @T.prim_func(private=True)
    def texture_gemm_8_16_l1():
        T.evaluate(0)

    @R.function
    def decode(x: R.Tensor((1, 1, 16), "float32"), w__tex: R.Tensor((1, 8, 4, 4), "float32")):
        R.func_attr({"num_input": 1})
        cls = Expected
        with R.dataflow():
            y = R.call_tir(cls.texture_gemv_8_16_l1, (x, w__tex), out_ty=R.Tensor((1, 1, 8), "float32"))
            R.output(y)
        return y

    @R.function
    def prefill(x: R.Tensor((1, "seq", 16), "float32"), w__tex: R.Tensor((1, 8, 4, 4), "float32")):
        R.func_attr({"num_input": 1})
        seq = T.int64()
        cls = Expected
        with R.dataflow():
            y = R.call_tir(cls.texture_gemm_8_16_l1, (x, w__tex), out_ty=R.Tensor((1, seq, 8), "float32"))
            R.output(y)
        return y


def test_gemv_weights_live_only_as_images() -> None:
    w = rand(8, 16)
    after, weights = run_pass(texture_weights, Before, {"w": w}, context("adreno"))
    expected = with_kernels(Expected, texture_gemv_8_16_l1=opaque(texture_gemv_kernel(8, 16, 64, LAYOUT)),
                            texture_gemm_8_16_l1=opaque(texture_gemm_kernel(8, 16, LAYOUT, 64)))
    tvm.ir.assert_structural_equal(after, expected)
    assert list(weights) == ["w__tex"]
    np.testing.assert_array_equal(weights["w__tex"], w.reshape(1, 8, 4, 4))  # texel x of row n = W[n, 4x:4x+4]


@I.ir_module
class AlsoReadAsBuffer:
    """prefill also adds w to itself: no texture kernel replaces that read, so w stays a buffer everywhere."""

    @R.function
    def decode(x: R.Tensor((1, 1, 16), "float32"), w: R.Tensor((8, 16), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            pt = R.permute_dims(w, axes=[1, 0])
            y = R.matmul(x, pt)
            R.output(y)
        return y

    @R.function
    def prefill(x: R.Tensor((1, "seq", 16), "float32"), w: R.Tensor((8, 16), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            w2 = R.add(w, w)
            pt = R.permute_dims(w2, axes=[1, 0])
            y = R.matmul(x, pt)
            R.output(y)
        return y


def test_weights_with_other_reads_keep_their_buffer() -> None:
    assert_unchanged(texture_weights, AlsoReadAsBuffer, {"w": rand(8, 16)}, context("adreno"))


def test_targets_without_textures_are_left_alone() -> None:
    assert_unchanged(texture_weights, Before, {"w": rand(8, 16)}, context("mali"))


@I.ir_module(check_well_formed=False)
class Int4:
    """quantize_int4's form (q4_g32, N = 8, K = 64): decode's quantized matmul, prefill's dequantize + matmul."""

    @T.prim_func(private=True)
    def q4_matmul_8_64_g32_1x1():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q4_dequant_8_64_g32():
        T.evaluate(0)

    @R.function
    def decode(x: R.Tensor((1, 1, 64), "float32"), w_q4: R.Tensor((8, 8), "uint32"),
               w_q4_scale: R.Tensor((8, 2), "float16"), w_q4_zero: R.Tensor((8, 2), "uint8")):
        R.func_attr({"num_input": 1})
        cls = Int4
        with R.dataflow():
            y = R.call_tir(cls.q4_matmul_8_64_g32_1x1, (x, w_q4, w_q4_scale, w_q4_zero), out_ty=R.Tensor((1, 1, 8), "float32"))
            R.output(y)
        return y

    @R.function
    def prefill(x: R.Tensor((1, "seq", 64), "float32"), w_q4: R.Tensor((8, 8), "uint32"),
                w_q4_scale: R.Tensor((8, 2), "float16"), w_q4_zero: R.Tensor((8, 2), "uint8")):
        R.func_attr({"num_input": 1})
        cls = Int4
        with R.dataflow():
            wd = R.call_tir(cls.q4_dequant_8_64_g32, (w_q4, w_q4_scale, w_q4_zero), out_ty=R.Tensor((8, 64), "float32"))
            pt = R.permute_dims(wd, axes=[1, 0])
            y = R.matmul(x, pt)
            R.output(y)
        return y


@I.ir_module(check_well_formed=False)
class Int4Images:
    """The buffer kernels stay in the module, uncalled (they have a global symbol); phase 2 drops them."""

    @T.prim_func(private=True)
    def q4_matmul_8_64_g32_1x1():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q4_dequant_8_64_g32():
        T.evaluate(0)

    @T.prim_func(private=True)
    def texture_q4_matmul_8_64_g32_1x1():
        T.evaluate(0)

    @T.prim_func(private=True)
    def texture_q4_dequant_8_64_g32_rows():
        T.evaluate(0)

    @R.function
    def decode(x: R.Tensor((1, 1, 64), "float32"), w_q4__tex: R.Tensor((1, 8, 2, 4), "uint32"),
               w_q4_scale__tex: R.Tensor((1, 8, 1, 4), "uint32")):
        R.func_attr({"num_input": 1})
        cls = Int4Images
        with R.dataflow():
            y = R.call_tir(cls.texture_q4_matmul_8_64_g32_1x1, (x, w_q4__tex, w_q4_scale__tex),
                           out_ty=R.Tensor((1, 1, 8), "float32"))
            R.output(y)
        return y

    @R.function
    def prefill(x: R.Tensor((1, "seq", 64), "float32"), w_q4__tex: R.Tensor((1, 8, 2, 4), "uint32"),
                w_q4_scale__tex: R.Tensor((1, 8, 1, 4), "uint32")):
        R.func_attr({"num_input": 1})
        seq = T.int64()
        cls = Int4Images
        with R.dataflow():
            y = R.call_tir(cls.texture_q4_dequant_8_64_g32_rows, (x, w_q4__tex, w_q4_scale__tex),
                           out_ty=R.Tensor((1, seq, 8), "float32"))
            R.output(y)
        return y


def test_int4_weights_live_only_as_images() -> None:
    matmul = opaque(int4_matmul_compute(8, 64, 32, 8, False, kind="matmul", rows=(1, 1)))
    dequant = opaque(int4_matmul_compute(8, 64, 32, 8, False, kind="dequant", rows=(None, None)))
    rng = np.random.default_rng(0)
    w = {"w_q4": rng.integers(0, 2**32, size=(8, 8), dtype=np.uint32),
         "w_q4_scale": rng.random((8, 2)).astype(np.float16), "w_q4_zero": rng.integers(0, 16, (8, 2)).astype(np.uint8)}
    after, weights = run_pass(texture_weights, with_kernels(Int4, q4_matmul_8_64_g32_1x1=matmul,
                                                            q4_dequant_8_64_g32=dequant), w, context("adreno"))
    codes = ImageLayout(rows=8, width=2, height=8, layers=1, fmt="RGBA32UI")  # 64 codes = 8 words = 2 texels
    scales = ImageLayout(rows=8, width=1, height=8, layers=1, fmt="RGBA32UI")  # (s0 | z0 << 16, s1 | z1 << 16, 0, 0)
    info = {kind: json.loads(str(f.attrs["perfx.quant"])) for kind, f in (("matmul", matmul), ("dequant", dequant))}
    expected = with_kernels(
        Int4Images, q4_matmul_8_64_g32_1x1=matmul, q4_dequant_8_64_g32=dequant,
        texture_q4_matmul_8_64_g32_1x1=opaque(texture_q4_gemv_kernel(info["matmul"], codes, scales, 64)),
        texture_q4_dequant_8_64_g32_rows=opaque(texture_q4_gemm_kernel(info["dequant"], codes, scales, 64)),
    )
    tvm.ir.assert_structural_equal(after, expected)
    assert list(weights) == ["w_q4__tex", "w_q4_scale__tex"]
    np.testing.assert_array_equal(weights["w_q4__tex"], w["w_q4"].reshape(1, 8, 2, 4))
    # the float16 bits, a group a word: the scale in the low half, the zero (exact in float16) in the high
    pairs = np.zeros((8, 4, 2), np.float16)
    pairs[:, :2, 0], pairs[:, :2, 1] = w["w_q4_scale"], w["w_q4_zero"]
    np.testing.assert_array_equal(weights["w_q4_scale__tex"], pairs.reshape(8, 8).view(np.uint32).reshape(1, 8, 1, 4))
