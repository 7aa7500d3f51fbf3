"""quantize_int8 (``q8``: symmetric groups of 32): a linear's weight becomes int8 codes + fp16 scales
(``<W>_q8``, ``<W>_q8_scale``); decode's linear one quantized-matmul call, prefill's dequantize -> float
matmul; a bias stays an add after it.

The kernels are compared by identity to their generator (``formats.int8.int8_matmul_compute``), the Relax
functions as written here, the arrays to ``_quant8``'s quantization. Under int8 activations (the pipeline's
default on AVX-512 VNNI CPUs) the codes take the VNNI layout (code + 128, groups padded to 16) and both
linears, prefill's too, are ``formats.vnni.vnni_compute`` calls.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from perfx_compiler.errors import PerfXError
from perfx_compiler.formats.int8 import int8_matmul_compute
from perfx_compiler.formats.int8 import quantize_int8 as quantize_codes
from perfx_compiler.formats.vnni import vnni_compute
from perfx_compiler.passes import quantize_int8
from perfx_compiler.passes._quantized_linears import use_activations

from ._util import assert_unchanged, context, opaque, rand, run_pass, with_kernels


@I.ir_module
class Before:
    @R.function
    def decode(x: R.Tensor((1, 1, 64), "float32"), w: R.Tensor((16, 64), "float32"), b: R.Tensor((16,), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            pt = R.permute_dims(w, axes=[1, 0])
            m = R.matmul(x, pt)
            y = R.add(m, b)
            R.output(y)
        return y

    @R.function
    def prefill(x: R.Tensor((1, "seq", 64), "float32"), w: R.Tensor((16, 64), "float32"),
                b: R.Tensor((16,), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            pt = R.permute_dims(w, axes=[1, 0])
            m = R.matmul(x, pt)
            y = R.add(m, b)
            R.output(y)
        return y


@I.ir_module(check_well_formed=False)
class Expected:
    @T.prim_func(private=True)
    def q8_matmul_16_64_g32_1x1():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q8_dequant_16_64_g32():
        T.evaluate(0)

    @R.function
    def decode(x: R.Tensor((1, 1, 64), "float32"), w_q8: R.Tensor((16, 64), "int8"),
               w_q8_scale: R.Tensor((16, 2), "float16"), b: R.Tensor((16,), "float32")):
        R.func_attr({"num_input": 1})
        cls = Expected
        with R.dataflow():
            m = R.call_tir(cls.q8_matmul_16_64_g32_1x1, (x, w_q8, w_q8_scale), out_ty=R.Tensor((1, 1, 16), "float32"))
            y = R.add(m, b)
            R.output(y)
        return y

    @R.function
    def prefill(x: R.Tensor((1, "seq", 64), "float32"), w_q8: R.Tensor((16, 64), "int8"),
                w_q8_scale: R.Tensor((16, 2), "float16"), b: R.Tensor((16,), "float32")):
        R.func_attr({"num_input": 1})
        cls = Expected
        with R.dataflow():
            wd = R.call_tir(cls.q8_dequant_16_64_g32, (w_q8, w_q8_scale), out_ty=R.Tensor((16, 64), "float32"))
            pt = R.permute_dims(wd, axes=[1, 0])
            m = R.matmul(x, pt)
            y = R.add(m, b)
            R.output(y)
        return y


WEIGHTS = {"w": rand(16, 64), "b": rand(16, seed=1)}


def test_linears_read_int8_codes() -> None:
    after, weights = run_pass(quantize_int8, Before, WEIGHTS, context(quantization="q8"))
    expected = with_kernels(
        Expected,
        q8_matmul_16_64_g32_1x1=opaque(int8_matmul_compute(16, 64, 32, kind="matmul", rows=(1, 1))),
        q8_dequant_16_64_g32=opaque(int8_matmul_compute(16, 64, 32, kind="dequant", rows=(None, None))),
    )
    tvm.ir.assert_structural_equal(after, expected)
    codes, scale = quantize_codes(WEIGHTS["w"], 32)
    assert list(weights) == ["w_q8", "w_q8_scale", "b"]
    np.testing.assert_array_equal(weights["w_q8"], codes.astype(np.int8))
    np.testing.assert_array_equal(weights["w_q8_scale"], scale.astype(np.float16))
    assert weights["b"] is WEIGHTS["b"]


@I.ir_module
class NotLinear:
    """The weight is read untransposed (x @ W, not x @ W^T): no linear of the importer's form."""

    @R.function
    def decode(x: R.Tensor((1, 1, 16), "float32"), w: R.Tensor((16, 64), "float32"), b: R.Tensor((16,), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            y = R.matmul(x, w)
            R.output(y)
        return y


def test_other_matmuls_are_left_alone() -> None:
    assert_unchanged(quantize_int8, NotLinear, WEIGHTS, context(quantization="q8"))


def test_group_must_divide_k() -> None:
    with pytest.raises(PerfXError, match="q8"):
        quantize_int8.apply(Before, dict(WEIGHTS), context(quantization="q8_g128"))


@I.ir_module(check_well_formed=False)
class ExpectedVnni:
    @T.prim_func(private=True)
    def q8_matmul_16_64_g32v_1x1():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q8_matmul_16_64_g32v_1xn():
        T.evaluate(0)

    @R.function
    def decode(x: R.Tensor((1, 1, 64), "float32"), w_q8: R.Tensor((16, 64), "uint8"),
               w_q8_scale: R.Tensor((16, 16), "float16"), b: R.Tensor((16,), "float32")):
        R.func_attr({"num_input": 1})
        cls = ExpectedVnni
        with R.dataflow():
            m = R.call_tir(cls.q8_matmul_16_64_g32v_1x1, (x, w_q8, w_q8_scale), out_ty=R.Tensor((1, 1, 16), "float32"))
            y = R.add(m, b)
            R.output(y)
        return y

    @R.function
    def prefill(x: R.Tensor((1, "seq", 64), "float32"), w_q8: R.Tensor((16, 64), "uint8"),
                w_q8_scale: R.Tensor((16, 16), "float16"), b: R.Tensor((16,), "float32")):
        R.func_attr({"num_input": 1})
        seq = T.int64()
        cls = ExpectedVnni
        with R.dataflow():
            m = R.call_tir(cls.q8_matmul_16_64_g32v_1xn, (x, w_q8, w_q8_scale), out_ty=R.Tensor((1, seq, 16), "float32"))
            y = R.add(m, b)
            R.output(y)
        return y


def test_int8_activations_use_the_vnni_layout() -> None:
    with use_activations("int8"):
        after, weights = run_pass(quantize_int8, Before, WEIGHTS, context(quantization="q8"))
    expected = with_kernels(
        ExpectedVnni,
        q8_matmul_16_64_g32v_1x1=opaque(vnni_compute(16, 64, 32, 8, True, False, "matmul", (1, 1))),
        q8_matmul_16_64_g32v_1xn=opaque(vnni_compute(16, 64, 32, 8, True, False, "matmul", (1, None))),
    )
    tvm.ir.assert_structural_equal(after, expected)
    codes, scale = quantize_codes(WEIGHTS["w"], 32)
    np.testing.assert_array_equal(weights["w_q8"], (codes.astype(np.int16) + 128).astype(np.uint8))  # K = KP = 64
    padded = np.zeros((16, 16), np.float16)  # 2 groups, stored as 16
    padded[:, :2] = scale
    np.testing.assert_array_equal(weights["w_q8_scale"], padded)
