"""fuse_gemm_swiglu: ``swiglu`` reading a VNNI GEMM's y (symbolic rows: prefill, batched decode) becomes that
GEMM with the swiglu epilogue, returning h alone. A y read elsewhere too, and a one-row GEMV (the
prologue pass's), are left alone. The plain GEMM (``te.create_prim_func`` gives it a global symbol) stays
until phase 2; the private swiglu leaves with its last call. Kernels compared by identity to
``formats.vnni.vnni_compute``, the Relax functions as written here."""

from __future__ import annotations

import json

import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from perfx_compiler.formats.vnni import vnni_compute
from perfx_compiler.kernels.swiglu import swiglu_kernel
from perfx_compiler.passes import fuse_gemm_swiglu

from ._util import assert_unchanged, opaque, run_pass, with_kernels


def _swiglu() -> tvm.tirx.PrimFunc:
    return opaque(swiglu_kernel(64).with_attr("perfx.fused_op", json.dumps({"op": "swiglu"})))


def _gemm(n: int, rows: tuple = (1, None), epilogue: str = "") -> tvm.tirx.PrimFunc:
    """An asymmetric int4 g32 VNNI matmul, K = 64 (as quantize_int4 emits it under int8 activations)."""
    return opaque(vnni_compute(n, 64, 32, 4, False, False, "matmul", rows, epilogue=epilogue))


@I.ir_module(check_well_formed=False)
class Ffn:
    """gate|up GEMM -> swiglu -> down GEMM over a prompt chunk of n rows."""

    @T.prim_func(private=True)
    def swiglu_64():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q4_matmul_128_64_g32v_1xn():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q4_matmul_64_64_g32v_1xn():
        T.evaluate(0)

    @R.function
    def prefill(x: R.Tensor((1, "n", 64), "float32"), gu_q4: R.Tensor((64, 64), "uint8"),
                gu_scale: R.Tensor((128, 16), "float16"), gu_zero: R.Tensor((128, 16), "uint8"),
                d_q4: R.Tensor((32, 64), "uint8"), d_scale: R.Tensor((64, 16), "float16"),
                d_zero: R.Tensor((64, 16), "uint8")):
        n = T.int64()
        R.func_attr({"num_input": 1})
        cls = Ffn
        with R.dataflow():
            gu = R.call_tir(cls.q4_matmul_128_64_g32v_1xn, (x, gu_q4, gu_scale, gu_zero),
                            out_ty=R.Tensor((1, n, 128), "float32"))
            h = R.call_tir(cls.swiglu_64, (gu,), out_ty=R.Tensor((1, n, 64), "float32"))
            d = R.call_tir(cls.q4_matmul_64_64_g32v_1xn, (h, d_q4, d_scale, d_zero), out_ty=R.Tensor((1, n, 64), "float32"))
            R.output(d)
        return d


@I.ir_module(check_well_formed=False)
class FfnFused:
    @T.prim_func(private=True)
    def q4_matmul_128_64_g32v_1xn():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q4_matmul_64_64_g32v_1xn():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q4_matmul_128_64_g32v_1xn_swiglu():
        T.evaluate(0)

    @R.function
    def prefill(x: R.Tensor((1, "n", 64), "float32"), gu_q4: R.Tensor((64, 64), "uint8"),
                gu_scale: R.Tensor((128, 16), "float16"), gu_zero: R.Tensor((128, 16), "uint8"),
                d_q4: R.Tensor((32, 64), "uint8"), d_scale: R.Tensor((64, 16), "float16"),
                d_zero: R.Tensor((64, 16), "uint8")):
        n = T.int64()
        R.func_attr({"num_input": 1})
        cls = FfnFused
        with R.dataflow():
            h = R.call_tir(cls.q4_matmul_128_64_g32v_1xn_swiglu, (x, gu_q4, gu_scale, gu_zero),
                           out_ty=R.Tensor((1, n, 64), "float32"))
            d = R.call_tir(cls.q4_matmul_64_64_g32v_1xn, (h, d_q4, d_scale, d_zero), out_ty=R.Tensor((1, n, 64), "float32"))
            R.output(d)
        return d


def test_swiglu_goes_into_the_gate_up_gemm() -> None:
    before = with_kernels(Ffn, swiglu_64=_swiglu(), q4_matmul_128_64_g32v_1xn=_gemm(128),
                          q4_matmul_64_64_g32v_1xn=_gemm(64))
    after, _ = run_pass(fuse_gemm_swiglu, before, {})
    expected = with_kernels(FfnFused, q4_matmul_128_64_g32v_1xn=_gemm(128), q4_matmul_64_64_g32v_1xn=_gemm(64),
                            q4_matmul_128_64_g32v_1xn_swiglu=_gemm(128, epilogue="swiglu"))
    tvm.ir.assert_structural_equal(after, expected)


@I.ir_module(check_well_formed=False)
class Left:
    """gate|up's y also returned (swiglu is not its only reader), and a one-row GEMV's y into swiglu (the
    decode GEMV's epilogue belongs to fuse_gemv_prologue)."""

    @T.prim_func(private=True)
    def swiglu_64():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q4_matmul_128_64_g32v_1xn():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q4_matmul_128_64_g32v_1x1():
        T.evaluate(0)

    @R.function
    def prefill(x: R.Tensor((1, "n", 64), "float32"), t: R.Tensor((1, 1, 64), "float32"),
                gu_q4: R.Tensor((64, 64), "uint8"), gu_scale: R.Tensor((128, 16), "float16"),
                gu_zero: R.Tensor((128, 16), "uint8")):
        n = T.int64()
        R.func_attr({"num_input": 2})
        cls = Left
        with R.dataflow():
            gu = R.call_tir(cls.q4_matmul_128_64_g32v_1xn, (x, gu_q4, gu_scale, gu_zero),
                            out_ty=R.Tensor((1, n, 128), "float32"))
            h = R.call_tir(cls.swiglu_64, (gu,), out_ty=R.Tensor((1, n, 64), "float32"))
            g1 = R.call_tir(cls.q4_matmul_128_64_g32v_1x1, (t, gu_q4, gu_scale, gu_zero),
                            out_ty=R.Tensor((1, 1, 128), "float32"))
            h1 = R.call_tir(cls.swiglu_64, (g1,), out_ty=R.Tensor((1, 1, 64), "float32"))
            out = (gu, h, h1)
            R.output(out)
        return out


def test_shared_outputs_and_one_row_gemvs_are_left_alone() -> None:
    mod = with_kernels(Left, swiglu_64=_swiglu(), q4_matmul_128_64_g32v_1xn=_gemm(128),
                       q4_matmul_128_64_g32v_1x1=_gemm(128, rows=(1, 1)))
    assert_unchanged(fuse_gemm_swiglu, mod, {})
