"""precision (``--precision bf16``): each linear with symbolic rows (prefill) reads its input through one
``round_bf16_K`` kernel; few-row linears (decode: the GEMV rounds x itself) and everything else stay.

The rounding kernel is compared by identity to its generator (``_half.half_compute(kind="round")``), the
Relax functions as written here.
"""

from __future__ import annotations

import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from perfx_compiler.formats.half import half_compute
from perfx_compiler.passes import precision

from ._util import assert_unchanged, context, opaque, rand, run_pass, with_kernels


@I.ir_module
class Before:
    @R.function
    def prefill(x: R.Tensor((1, "seq", 16), "float32"), w: R.Tensor((8, 16), "float32"),
                n: R.Tensor((16,), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            h = R.multiply(x, n)
            pt = R.permute_dims(w, axes=[1, 0])
            y = R.matmul(h, pt)
            R.output(y)
        return y


@I.ir_module(check_well_formed=False)
class Expected:
    @T.prim_func(private=True)
    def round_bf16_16():
        T.evaluate(0)

    @R.function
    def prefill(x: R.Tensor((1, "seq", 16), "float32"), w: R.Tensor((8, 16), "float32"),
                n: R.Tensor((16,), "float32")):
        R.func_attr({"num_input": 1})
        seq = T.int64()
        cls = Expected
        with R.dataflow():
            h = R.multiply(x, n)
            pt = R.permute_dims(w, axes=[1, 0])
            hr = R.call_tir(cls.round_bf16_16, (h,), out_ty=R.Tensor((1, seq, 16), "float32"))
            y = R.matmul(hr, pt)
            R.output(y)
        return y


WEIGHTS = {"w": rand(8, 16), "n": rand(16, seed=1)}


def test_prefill_linear_inputs_are_rounded() -> None:
    after, weights = run_pass(precision, Before, WEIGHTS, context(precision="bf16", quantization="bf16"))
    kernel = opaque(half_compute(1, 16, "f16", kind="round", rows=(None, None), act="bf16"))
    tvm.ir.assert_structural_equal(after, with_kernels(Expected, round_bf16_16=kernel))
    assert weights.keys() == WEIGHTS.keys()


@I.ir_module
class FewRows:
    """Linears of 1 and 2 x 4 rows (the GEMV's): not rounded here; a matmul of two activations is no linear."""

    @R.function
    def decode(x: R.Tensor((1, 1, 16), "float32"), x4: R.Tensor((2, 4, 16), "float32"),
               w: R.Tensor((8, 16), "float32"), n: R.Tensor((16,), "float32")):
        R.func_attr({"num_input": 2})
        with R.dataflow():
            pt = R.permute_dims(w, axes=[1, 0])
            y = R.matmul(x, pt)
            pt4 = R.permute_dims(w, axes=[1, 0])
            y4 = R.matmul(x4, pt4)
            xt = R.permute_dims(x4, axes=[0, 2, 1])
            a = R.matmul(x4, xt)
            out = (y, y4, a)
            R.output(out)
        return out


def test_few_row_linears_are_left_alone() -> None:
    assert_unchanged(precision, FewRows, WEIGHTS, context(precision="bf16", quantization="bf16"))
