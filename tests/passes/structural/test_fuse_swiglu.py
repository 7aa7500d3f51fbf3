"""fuse_swiglu: ``silu(gate) * up`` over the two halves of a merged [.., 2F] gate|up tensor (two last-axis
slices, sigmoid, two multiplies) becomes one ``swiglu_F`` kernel reading the merged tensor.

The kernel is compared by identity to its generator (``_kernels.swiglu_kernel(F)`` with the
``perfx.fused_op`` JSON), the Relax function as written here.
"""

from __future__ import annotations

import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from perfx_compiler.kernels.swiglu import swiglu_kernel
from perfx_compiler.passes import fuse_swiglu

from ._util import assert_unchanged, opaque, rand, run_pass, with_kernels


@I.ir_module
class Before:
    @R.function
    def prefill(y: R.Tensor((1, "seq", 16), "float32"), w: R.Tensor((16,), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            g = R.strided_slice(y, axes=[2], begin=[0], end=[8])
            u = R.strided_slice(y, axes=[2], begin=[8], end=[16])
            sg = R.sigmoid(g)
            silu = R.multiply(g, sg)
            h = R.multiply(u, silu)  # up on the left
            out = R.add(h, h)
            R.output(out)
        return out


@I.ir_module(check_well_formed=False)
class Expected:
    @T.prim_func(private=True)
    def swiglu_8():
        T.evaluate(0)

    @R.function
    def prefill(y: R.Tensor((1, "seq", 16), "float32"), w: R.Tensor((16,), "float32")):
        R.func_attr({"num_input": 1})
        seq = T.int64()
        cls = Expected
        with R.dataflow():
            h = R.call_tir(cls.swiglu_8, (y,), out_ty=R.Tensor((1, seq, 8), "float32"))
            out = R.add(h, h)
            R.output(out)
        return out


WEIGHTS = {"w": rand(16)}


def test_silu_gate_times_up_becomes_one_kernel() -> None:
    after, _ = run_pass(fuse_swiglu, Before, WEIGHTS)
    kernel = opaque(swiglu_kernel(8).with_attr("perfx.fused_op", '{"op": "swiglu"}'))
    tvm.ir.assert_structural_equal(after, with_kernels(Expected, swiglu_8=kernel))


@I.ir_module
class NotHalves:
    """up is not the second half (columns 4..12); up is a slice of another tensor; a gate is also read by
    another op."""

    @R.function
    def prefill(y: R.Tensor((1, "seq", 16), "float32"), w: R.Tensor((16,), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            g = R.strided_slice(y, axes=[2], begin=[0], end=[8])
            u = R.strided_slice(y, axes=[2], begin=[4], end=[12])
            sg = R.sigmoid(g)
            silu = R.multiply(g, sg)
            h = R.multiply(silu, u)
            g2 = R.strided_slice(y, axes=[2], begin=[0], end=[8])
            u2 = R.strided_slice(y, axes=[2], begin=[8], end=[16])
            sg2 = R.sigmoid(g2)
            silu2 = R.multiply(g2, sg2)
            h2 = R.multiply(silu2, u2)
            z = R.add(y, y)
            g3 = R.strided_slice(y, axes=[2], begin=[0], end=[8])
            u3 = R.strided_slice(z, axes=[2], begin=[8], end=[16])
            sg3 = R.sigmoid(g3)
            silu3 = R.multiply(g3, sg3)
            h3 = R.multiply(silu3, u3)
            out = (h, h2, g2, h3)
            R.output(out)
        return out


def test_other_slices_are_left_alone() -> None:
    assert_unchanged(fuse_swiglu, NotHalves, WEIGHTS)
