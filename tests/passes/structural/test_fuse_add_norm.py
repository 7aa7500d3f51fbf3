"""fuse_add_norm: ``s = a + b; y = rmsnorm(s) * w`` (six primitive ops, as the ONNX import spells it) becomes
one ``add_rms_norm`` kernel returning (s, y); an RMSNorm without an add before it one ``rms_norm`` kernel.

The kernels are compared by identity to their generator (``_kernels.rms_norm_kernel`` at the expected hidden
size, eps and the target's lanes, with the ``perfx.fused_op`` JSON that fuse_gemv_prologue reads); the Relax
functions as written here.
"""

from __future__ import annotations

import json

import numpy as np
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from perfx_compiler.kernels.rms_norm import rms_norm_kernel
from perfx_compiler.passes import fuse_add_norm

from ._util import assert_unchanged, opaque, rand, run_pass, with_kernels

EPS = float(np.float32(1e-5))  # the constant is float32 in the graph
LANES = 16  # x86-avx512: 512-bit vectors


@I.ir_module
class Before:
    @R.function
    def decode(a: R.Tensor((1, 1, 16), "float32"), b: R.Tensor((1, 1, 16), "float32"),
               w1: R.Tensor((16,), "float32"), w2: R.Tensor((16,), "float32")):
        R.func_attr({"num_input": 2})
        with R.dataflow():
            s = R.add(a, b)
            p = R.power(s, R.const(2.0, "float32"))
            m = R.mean(p, axis=[-1], keepdims=True)
            e = R.add(m, R.const(1e-5, "float32"))
            q = R.sqrt(e)
            d = R.divide(s, q)
            y = R.multiply(d, w1)
            # a norm of a: no add before it
            p2 = R.power(a, R.const(2.0, "float32"))
            m2 = R.mean(p2, axis=[-1], keepdims=True)
            e2 = R.add(m2, R.const(1e-5, "float32"))
            q2 = R.sqrt(e2)
            d2 = R.divide(a, q2)
            z = R.multiply(w2, d2)  # weight on the left
            out = (s, y, z)
            R.output(out)
        return out


@I.ir_module(check_well_formed=False)
class Expected:
    @T.prim_func(private=True)
    def add_rms_norm_16_1em05():
        T.evaluate(0)

    @T.prim_func(private=True)
    def rms_norm_16_1em05():
        T.evaluate(0)

    @R.function
    def decode(a: R.Tensor((1, 1, 16), "float32"), b: R.Tensor((1, 1, 16), "float32"),
               w1: R.Tensor((16,), "float32"), w2: R.Tensor((16,), "float32")):
        R.func_attr({"num_input": 2})
        cls = Expected
        with R.dataflow():
            t = R.call_tir(cls.add_rms_norm_16_1em05, (a, b, w1),
                           out_ty=[R.Tensor((1, 1, 16), "float32"), R.Tensor((1, 1, 16), "float32")])
            s = t[0]
            y = t[1]
            z = R.call_tir(cls.rms_norm_16_1em05, (a, w2), out_ty=R.Tensor((1, 1, 16), "float32"))
            out = (s, y, z)
            R.output(out)
        return out


def _kernel(residual: bool) -> tvm.tirx.PrimFunc:
    op = json.dumps({"op": "add_rms_norm" if residual else "rms_norm", "eps": EPS})
    return opaque(rms_norm_kernel(16, EPS, residual, LANES).with_attr("perfx.fused_op", op))


WEIGHTS = {"w1": rand(16), "w2": rand(16, seed=1)}


def test_add_and_norm_become_one_kernel() -> None:
    after, weights = run_pass(fuse_add_norm, Before, WEIGHTS)
    expected = with_kernels(Expected, add_rms_norm_16_1em05=_kernel(True), rms_norm_16_1em05=_kernel(False))
    tvm.ir.assert_structural_equal(after, expected)
    assert weights.keys() == WEIGHTS.keys()


@I.ir_module
class SharedIntermediate:
    """The mean of squares is also returned: folding the chain would lose it, so nothing changes."""

    @R.function
    def decode(a: R.Tensor((1, 1, 16), "float32"), b: R.Tensor((1, 1, 16), "float32"),
               w1: R.Tensor((16,), "float32"), w2: R.Tensor((16,), "float32")):
        R.func_attr({"num_input": 2})
        with R.dataflow():
            s = R.add(a, b)
            p = R.power(s, R.const(2.0, "float32"))
            m = R.mean(p, axis=[-1], keepdims=True)
            e = R.add(m, R.const(1e-5, "float32"))
            q = R.sqrt(e)
            d = R.divide(s, q)
            y = R.multiply(d, w1)
            z = R.multiply(y, w2)
            out = (y, m, z)
            R.output(out)
        return out


@I.ir_module
class WeightNotAParameter:
    """The scale is computed in the function (not a weight), and the mean is over the wrong axis."""

    @R.function
    def decode(a: R.Tensor((1, 1, 16), "float32"), b: R.Tensor((1, 1, 16), "float32"),
               w1: R.Tensor((16,), "float32"), w2: R.Tensor((16,), "float32")):
        R.func_attr({"num_input": 2})
        with R.dataflow():
            s = R.add(a, b)
            p = R.power(s, R.const(2.0, "float32"))
            m = R.mean(p, axis=[-1], keepdims=True)
            e = R.add(m, R.const(1e-5, "float32"))
            q = R.sqrt(e)
            d = R.divide(s, q)
            w = R.add(w1, w2)
            y = R.multiply(d, w)
            p2 = R.power(a, R.const(2.0, "float32"))
            m2 = R.mean(p2, axis=[1], keepdims=True)
            e2 = R.add(m2, R.const(1e-5, "float32"))
            q2 = R.sqrt(e2)
            d2 = R.divide(a, q2)
            z = R.multiply(d2, w2)
            out = (y, z)
            R.output(out)
        return out


def test_no_match_leaves_the_module_unchanged() -> None:
    assert_unchanged(fuse_add_norm, SharedIntermediate, WEIGHTS)
    assert_unchanged(fuse_add_norm, WeightNotAParameter, WEIGHTS)
