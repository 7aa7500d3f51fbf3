"""texture_weights (Adreno, ``templates.gpu_gemv.texture``): a weight that decode's GEMV reads becomes one
RGBA32F image ``<W>__tex`` ([layers, height, width, 4]) and only that: decode's linear calls the texture
GEMV, prefill's the texture GEMM. A weight with a read no texture kernel replaces keeps its buffer.

The kernels are compared by identity to their generators (``kernels.gemv_texture.texture_gemv_kernel``,
``kernels.gemm_texture.texture_gemm_kernel`` with the expected image layout and the target's 64 threads),
the Relax functions as written here, the image to ``gemv_texture.pack_image``.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from perfx_compiler.kernels.gemm_texture import texture_gemm_kernel
from perfx_compiler.kernels.gemv_texture import ImageLayout, texture_gemv_kernel
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
