"""fuse_gemv_prologue: in decode, ``add_rms_norm -> VNNI GEMV`` becomes one GEMV that makes its x from
(a, b, w) and also returns a + b; a ``swiglu`` reading a GEMV's y goes into that GEMV as its epilogue, and a
swiglu of anything else into the VNNI GEMV that reads it as its prologue.

The before modules hold the kernels the earlier passes emit (``rms_norm_kernel`` with its ``perfx.fused_op``
JSON, ``swiglu_kernel``, ``formats.vnni.vnni_compute`` GEMVs); the fused kernels are compared by identity to
``vnni_compute`` with the expected prologue / epilogue, the Relax functions as written here. Of the kernels
the fused ones replace, the private ones (norm, swiglu) leave the module with their last call; the GEMVs
(``te.create_prim_func`` gives them a global symbol) stay until phase 2.
"""

from __future__ import annotations

import json

import numpy as np
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from perfx_compiler.formats.int4 import int4_matmul_compute
from perfx_compiler.formats.vnni import vnni_compute
from perfx_compiler.kernels.rms_norm import rms_norm_kernel
from perfx_compiler.kernels.swiglu import swiglu_kernel
from perfx_compiler.passes import fuse_gemv_prologue

from ._util import assert_unchanged, opaque, run_pass, with_kernels

EPS = float(np.float32(1e-5))


def _norm() -> tvm.tirx.PrimFunc:
    return opaque(rms_norm_kernel(64, EPS, True, 16).with_attr(
        "perfx.fused_op", json.dumps({"op": "add_rms_norm", "eps": EPS})))


def _swiglu() -> tvm.tirx.PrimFunc:
    return opaque(swiglu_kernel(64).with_attr("perfx.fused_op", '{"op": "swiglu"}'))


def _gemv(n: int, prologue: str = "", epilogue: str = "") -> tvm.tirx.PrimFunc:
    """An asymmetric int4 g32 VNNI GEMV of one row, K = 64 (as quantize_int4 emits it under int8 activations)."""
    return opaque(vnni_compute(n, 64, 32, 4, False, False, "matmul", (1, 1), prologue=prologue,
                               eps=EPS if prologue == "add_rms_norm" else 0.0, epilogue=epilogue))


KERNELS = {"add_rms_norm_64_1em05": _norm, "swiglu_64": _swiglu,
           "q4_matmul_128_64_g32v_1x1": lambda: _gemv(128), "q4_matmul_64_64_g32v_1x1": lambda: _gemv(64)}


def _with(mod: tvm.IRModule, **extra: tvm.tirx.PrimFunc) -> tvm.IRModule:
    """``mod`` with its stubs of KERNELS (and ``extra``) filled in."""
    names = {gv.name_hint for gv in mod.get_global_vars()}
    return with_kernels(mod, **{name: make() for name, make in KERNELS.items() if name in names}, **extra)


@I.ir_module(check_well_formed=False)
class Layer:
    """Post-attention norm -> gate|up GEMV -> swiglu -> down GEMV."""

    @T.prim_func(private=True)
    def add_rms_norm_64_1em05():
        T.evaluate(0)

    @T.prim_func(private=True)
    def swiglu_64():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q4_matmul_128_64_g32v_1x1():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q4_matmul_64_64_g32v_1x1():
        T.evaluate(0)

    @R.function
    def decode(a: R.Tensor((1, 1, 64), "float32"), b: R.Tensor((1, 1, 64), "float32"), wn: R.Tensor((64,), "float32"),
               gu_q4: R.Tensor((64, 64), "uint8"), gu_scale: R.Tensor((128, 16), "float16"),
               gu_zero: R.Tensor((128, 16), "uint8"), d_q4: R.Tensor((32, 64), "uint8"),
               d_scale: R.Tensor((64, 16), "float16"), d_zero: R.Tensor((64, 16), "uint8")):
        R.func_attr({"num_input": 2})
        cls = Layer
        with R.dataflow():
            t = R.call_tir(cls.add_rms_norm_64_1em05, (a, b, wn),
                           out_ty=[R.Tensor((1, 1, 64), "float32"), R.Tensor((1, 1, 64), "float32")])
            s = t[0]
            x = t[1]
            gu = R.call_tir(cls.q4_matmul_128_64_g32v_1x1, (x, gu_q4, gu_scale, gu_zero),
                            out_ty=R.Tensor((1, 1, 128), "float32"))
            h = R.call_tir(cls.swiglu_64, (gu,), out_ty=R.Tensor((1, 1, 64), "float32"))
            d = R.call_tir(cls.q4_matmul_64_64_g32v_1x1, (h, d_q4, d_scale, d_zero), out_ty=R.Tensor((1, 1, 64), "float32"))
            out = (s, d)
            R.output(out)
        return out


@I.ir_module(check_well_formed=False)
class LayerFused:
    @T.prim_func(private=True)
    def q4_matmul_128_64_g32v_1x1():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q4_matmul_64_64_g32v_1x1():
        T.evaluate(0)

    @T.prim_func(private=True)
    def add_rms_norm_q4_matmul_128_64_g32v_1x1_swiglu():
        T.evaluate(0)

    @R.function
    def decode(a: R.Tensor((1, 1, 64), "float32"), b: R.Tensor((1, 1, 64), "float32"), wn: R.Tensor((64,), "float32"),
               gu_q4: R.Tensor((64, 64), "uint8"), gu_scale: R.Tensor((128, 16), "float16"),
               gu_zero: R.Tensor((128, 16), "uint8"), d_q4: R.Tensor((32, 64), "uint8"),
               d_scale: R.Tensor((64, 16), "float16"), d_zero: R.Tensor((64, 16), "uint8")):
        R.func_attr({"num_input": 2})
        cls = LayerFused
        with R.dataflow():
            f = R.call_tir(cls.add_rms_norm_q4_matmul_128_64_g32v_1x1_swiglu, (a, b, wn, gu_q4, gu_scale, gu_zero),
                           out_ty=[R.Tensor((1, 1, 64), "float32"), R.Tensor((1, 1, 128), "float32"),
                                   R.Tensor((1, 1, 64), "float32")])
            s = f[0]
            h = f[2]
            d = R.call_tir(cls.q4_matmul_64_64_g32v_1x1, (h, d_q4, d_scale, d_zero), out_ty=R.Tensor((1, 1, 64), "float32"))
            out = (s, d)
            R.output(out)
        return out


def test_norm_and_swiglu_go_into_the_gate_up_gemv() -> None:
    after, _ = run_pass(fuse_gemv_prologue, _with(Layer), {})
    fused = _gemv(128, prologue="add_rms_norm", epilogue="swiglu")
    tvm.ir.assert_structural_equal(after, _with(LayerFused, add_rms_norm_q4_matmul_128_64_g32v_1x1_swiglu=fused))


@I.ir_module(check_well_formed=False)
class Down:
    """gate|up is an input here (no GEMV before swiglu): swiglu becomes down's prologue."""

    @T.prim_func(private=True)
    def swiglu_64():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q4_matmul_64_64_g32v_1x1():
        T.evaluate(0)

    @R.function
    def decode(gu: R.Tensor((1, 1, 128), "float32"), d_q4: R.Tensor((32, 64), "uint8"),
               d_scale: R.Tensor((64, 16), "float16"), d_zero: R.Tensor((64, 16), "uint8")):
        R.func_attr({"num_input": 1})
        cls = Down
        with R.dataflow():
            h = R.call_tir(cls.swiglu_64, (gu,), out_ty=R.Tensor((1, 1, 64), "float32"))
            d = R.call_tir(cls.q4_matmul_64_64_g32v_1x1, (h, d_q4, d_scale, d_zero), out_ty=R.Tensor((1, 1, 64), "float32"))
            R.output(d)
        return d


@I.ir_module(check_well_formed=False)
class DownFused:
    @T.prim_func(private=True)
    def q4_matmul_64_64_g32v_1x1():
        T.evaluate(0)

    @T.prim_func(private=True)
    def swiglu_q4_matmul_64_64_g32v_1x1():
        T.evaluate(0)

    @R.function
    def decode(gu: R.Tensor((1, 1, 128), "float32"), d_q4: R.Tensor((32, 64), "uint8"),
               d_scale: R.Tensor((64, 16), "float16"), d_zero: R.Tensor((64, 16), "uint8")):
        R.func_attr({"num_input": 1})
        cls = DownFused
        with R.dataflow():
            d = R.call_tir(cls.swiglu_q4_matmul_64_64_g32v_1x1, (gu, d_q4, d_scale, d_zero),
                           out_ty=R.Tensor((1, 1, 64), "float32"))
            R.output(d)
        return d


def test_swiglu_of_an_input_goes_into_the_down_gemv() -> None:
    after, _ = run_pass(fuse_gemv_prologue, _with(Down), {})
    tvm.ir.assert_structural_equal(after, _with(DownFused, swiglu_q4_matmul_64_64_g32v_1x1=_gemv(64, prologue="swiglu")))


@I.ir_module(check_well_formed=False)
class NormAlsoReturned:
    """x is also returned (the GEMV is not its only reader), and h feeds a GEMV that is not a VNNI one."""

    @T.prim_func(private=True)
    def add_rms_norm_64_1em05():
        T.evaluate(0)

    @T.prim_func(private=True)
    def swiglu_64():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q4_matmul_64_64_g32v_1x1():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q4_matmul_64_64_g32_1x1():
        T.evaluate(0)

    @R.function
    def decode(a: R.Tensor((1, 1, 64), "float32"), b: R.Tensor((1, 1, 64), "float32"), wn: R.Tensor((64,), "float32"),
               gu: R.Tensor((1, 1, 128), "float32"), q4: R.Tensor((32, 64), "uint8"),
               scale: R.Tensor((64, 16), "float16"), zero: R.Tensor((64, 16), "uint8"),
               q4p: R.Tensor((64, 8), "uint32"), scalep: R.Tensor((64, 2), "float16"),
               zerop: R.Tensor((64, 2), "uint8")):
        R.func_attr({"num_input": 4})
        cls = NormAlsoReturned
        with R.dataflow():
            t = R.call_tir(cls.add_rms_norm_64_1em05, (a, b, wn),
                           out_ty=[R.Tensor((1, 1, 64), "float32"), R.Tensor((1, 1, 64), "float32")])
            s = t[0]
            x = t[1]
            y = R.call_tir(cls.q4_matmul_64_64_g32v_1x1, (x, q4, scale, zero), out_ty=R.Tensor((1, 1, 64), "float32"))
            h = R.call_tir(cls.swiglu_64, (gu,), out_ty=R.Tensor((1, 1, 64), "float32"))
            d = R.call_tir(cls.q4_matmul_64_64_g32_1x1, (h, q4p, scalep, zerop), out_ty=R.Tensor((1, 1, 64), "float32"))
            out = (s, x, y, d)
            R.output(out)
        return out


def test_shared_inputs_and_other_gemvs_are_left_alone() -> None:
    plain = opaque(int4_matmul_compute(64, 64, 32, 16, False, kind="matmul", rows=(1, 1)))
    mod = with_kernels(NormAlsoReturned, add_rms_norm_64_1em05=_norm(), swiglu_64=_swiglu(),
                       q4_matmul_64_64_g32v_1x1=_gemv(64), q4_matmul_64_64_g32_1x1=plain)
    assert_unchanged(fuse_gemv_prologue, mod, {})
