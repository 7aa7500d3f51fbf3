"""cast_weights (quantization ``bf16``): a linear's weight and an untied embedding (only gathered) are stored
as bfloat16 bit patterns (``<W>_bf16``, uint16); decode's linear calls the half-weight matmul, prefill's
widens W (dequantize) before the float matmul, the gather reads the half table.

The kernels are compared by identity to their generator (``_half.half_compute``), the Relax functions as
written here, the arrays to ``_half.to_half``.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from perfx_compiler.formats.half import half_compute, to_half
from perfx_compiler.passes import cast_weights

from ._util import assert_unchanged, context, opaque, rand, run_pass, with_kernels


@I.ir_module
class Before:
    @R.function
    def decode(ids: R.Tensor((1, 1), "int64"), emb: R.Tensor((16, 32), "float32"), w: R.Tensor((8, 32), "float32"),
               n: R.Tensor((32,), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            h = R.take(emb, ids, axis=0)
            hn = R.multiply(h, n)
            pt = R.permute_dims(w, axes=[1, 0])
            y = R.matmul(hn, pt)
            R.output(y)
        return y

    @R.function
    def prefill(ids: R.Tensor((1, "seq"), "int64"), emb: R.Tensor((16, 32), "float32"),
                w: R.Tensor((8, 32), "float32"), n: R.Tensor((32,), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            h = R.take(emb, ids, axis=0)
            hn = R.multiply(h, n)
            pt = R.permute_dims(w, axes=[1, 0])
            y = R.matmul(hn, pt)
            R.output(y)
        return y


@I.ir_module(check_well_formed=False)
class Expected:
    @T.prim_func(private=True)
    def bf16_take_16_32_w_1x1():
        T.evaluate(0)

    @T.prim_func(private=True)
    def bf16_matmul_8_32_w_1x1():
        T.evaluate(0)

    @T.prim_func(private=True)
    def bf16_take_16_32_w_1xn():
        T.evaluate(0)

    @T.prim_func(private=True)
    def bf16_dequant_8_32_w():
        T.evaluate(0)

    @R.function
    def decode(ids: R.Tensor((1, 1), "int64"), emb_bf16: R.Tensor((16, 32), "uint16"),
               w_bf16: R.Tensor((8, 32), "uint16"), n: R.Tensor((32,), "float32")):
        R.func_attr({"num_input": 1})
        cls = Expected
        with R.dataflow():
            h = R.call_tir(cls.bf16_take_16_32_w_1x1, (emb_bf16, ids), out_ty=R.Tensor((1, 1, 32), "float32"))
            hn = R.multiply(h, n)
            y = R.call_tir(cls.bf16_matmul_8_32_w_1x1, (hn, w_bf16), out_ty=R.Tensor((1, 1, 8), "float32"))
            R.output(y)
        return y

    @R.function
    def prefill(ids: R.Tensor((1, "seq"), "int64"), emb_bf16: R.Tensor((16, 32), "uint16"),
                w_bf16: R.Tensor((8, 32), "uint16"), n: R.Tensor((32,), "float32")):
        R.func_attr({"num_input": 1})
        seq = T.int64()
        cls = Expected
        with R.dataflow():
            h = R.call_tir(cls.bf16_take_16_32_w_1xn, (emb_bf16, ids), out_ty=R.Tensor((1, seq, 32), "float32"))
            hn = R.multiply(h, n)
            wd = R.call_tir(cls.bf16_dequant_8_32_w, (w_bf16,), out_ty=R.Tensor((8, 32), "float32"))
            pt = R.permute_dims(wd, axes=[1, 0])
            y = R.matmul(hn, pt)
            R.output(y)
        return y


WEIGHTS = {"emb": rand(16, 32), "w": rand(8, 32, seed=1), "n": rand(32, seed=2)}


def _kernel(n: int, kind: str, rows: tuple[int | None, int | None] = (None, None)) -> tvm.tirx.PrimFunc:
    return opaque(half_compute(n, 32, "bf16", kind=kind, rows=rows, act="f32"))


def test_linear_and_embedding_weights_are_stored_bf16() -> None:
    after, weights = run_pass(cast_weights, Before, WEIGHTS, context(quantization="bf16"))
    expected = with_kernels(
        Expected,
        bf16_take_16_32_w_1x1=_kernel(16, "take", (1, 1)),
        bf16_matmul_8_32_w_1x1=_kernel(8, "matmul", (1, 1)),
        bf16_take_16_32_w_1xn=_kernel(16, "take", (1, None)),
        bf16_dequant_8_32_w=_kernel(8, "dequant"),
    )
    tvm.ir.assert_structural_equal(after, expected)
    assert list(weights) == ["emb_bf16", "w_bf16", "n"]
    for name in ("emb", "w"):
        assert weights[f"{name}_bf16"].dtype == np.uint16
        np.testing.assert_array_equal(weights[f"{name}_bf16"], to_half(WEIGHTS[name], "bf16"))


@I.ir_module
class FloatReads:
    """The embedding is also read as floats (an add), the weight only by an untransposed matmul."""

    @R.function
    def decode(ids: R.Tensor((1, 1), "int64"), emb: R.Tensor((16, 32), "float32"), w: R.Tensor((8, 32), "float32"),
               n: R.Tensor((32,), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            h = R.take(emb, ids, axis=0)
            e2 = R.add(emb, emb)
            y = R.matmul(w, n)
            out = (h, e2, y)
            R.output(out)
        return out


def test_weights_read_as_floats_stay_float() -> None:
    assert_unchanged(cast_weights, FloatReads, WEIGHTS, context(quantization="bf16"))
