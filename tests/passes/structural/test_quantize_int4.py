"""quantize_int4 (``q4_g32``): every weight a linear reads becomes int4 codes + fp16 scales + uint8 zeros
(``<W>_q4``, ``_q4_scale``, ``_q4_zero``); a few-row linear (decode) becomes one quantized-matmul call, a
many-row one (prefill) dequantize -> float matmul; the gathers of a tied embedding read the packed table.

The kernels are compared by identity to their generator (``formats.int4.int4_matmul_compute`` at the expected N, K,
group, lanes and rows), the Relax functions as written here, the packed arrays to ``_quant``'s packing.

Under int8 activations (the pipeline's default on AVX-512 VNNI CPUs, ``_quantized_linears.use_activations``) the same
weights take the VNNI layout and every linear, prefill's too, one ``formats.vnni.vnni_compute`` call.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from perfx_compiler.formats.int4 import Int4Format, int4_matmul_compute, int4_packed
from perfx_compiler.formats.int4 import quantize_int4 as quantize_codes
from perfx_compiler.formats.vnni import vnni_compute
from perfx_compiler.passes import quantize_int4
from perfx_compiler.passes._quantized_linears import use_activations

from ._util import assert_unchanged, context, opaque, rand, run_pass, with_kernels

FMT = Int4Format(group=32, symmetric=False)
LANES = 4  # K = 32: blocks of 8 x 4 columns


@I.ir_module
class Before:
    @R.function
    def decode(ids: R.Tensor((1, 1), "int64"), emb: R.Tensor((16, 32), "float32"), w: R.Tensor((32, 32), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            h = R.take(emb, ids, axis=0)
            pt = R.permute_dims(w, axes=[1, 0])
            y = R.matmul(h, pt)
            pe = R.permute_dims(emb, axes=[1, 0])
            logits = R.matmul(y, pe)
            R.output(logits)
        return logits

    @R.function
    def prefill(ids: R.Tensor((1, "seq"), "int64"), emb: R.Tensor((16, 32), "float32"),
                w: R.Tensor((32, 32), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            h = R.take(emb, ids, axis=0)
            pt = R.permute_dims(w, axes=[1, 0])
            y = R.matmul(h, pt)
            pe = R.permute_dims(emb, axes=[1, 0])
            logits = R.matmul(y, pe)
            R.output(logits)
        return logits


@I.ir_module(check_well_formed=False)
class Expected:
    @T.prim_func(private=True)
    def q4_take_16_32_g32_1x1():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q4_matmul_32_32_g32_1x1():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q4_matmul_16_32_g32_1x1():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q4_take_16_32_g32_1xn():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q4_dequant_32_32_g32():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q4_dequant_16_32_g32():
        T.evaluate(0)

    @R.function
    def decode(ids: R.Tensor((1, 1), "int64"),
               emb_q4: R.Tensor((16, 4), "uint32"), emb_q4_scale: R.Tensor((16, 1), "float16"),
               emb_q4_zero: R.Tensor((16, 1), "uint8"),
               w_q4: R.Tensor((32, 4), "uint32"), w_q4_scale: R.Tensor((32, 1), "float16"),
               w_q4_zero: R.Tensor((32, 1), "uint8")):
        R.func_attr({"num_input": 1})
        cls = Expected
        with R.dataflow():
            h = R.call_tir(cls.q4_take_16_32_g32_1x1, (emb_q4, emb_q4_scale, emb_q4_zero, ids),
                           out_ty=R.Tensor((1, 1, 32), "float32"))
            y = R.call_tir(cls.q4_matmul_32_32_g32_1x1, (h, w_q4, w_q4_scale, w_q4_zero),
                           out_ty=R.Tensor((1, 1, 32), "float32"))
            logits = R.call_tir(cls.q4_matmul_16_32_g32_1x1, (y, emb_q4, emb_q4_scale, emb_q4_zero),
                                out_ty=R.Tensor((1, 1, 16), "float32"))
            R.output(logits)
        return logits

    @R.function
    def prefill(ids: R.Tensor((1, "seq"), "int64"),
                emb_q4: R.Tensor((16, 4), "uint32"), emb_q4_scale: R.Tensor((16, 1), "float16"),
                emb_q4_zero: R.Tensor((16, 1), "uint8"),
                w_q4: R.Tensor((32, 4), "uint32"), w_q4_scale: R.Tensor((32, 1), "float16"),
                w_q4_zero: R.Tensor((32, 1), "uint8")):
        R.func_attr({"num_input": 1})
        seq = T.int64()
        cls = Expected
        with R.dataflow():
            h = R.call_tir(cls.q4_take_16_32_g32_1xn, (emb_q4, emb_q4_scale, emb_q4_zero, ids),
                           out_ty=R.Tensor((1, seq, 32), "float32"))
            wd = R.call_tir(cls.q4_dequant_32_32_g32, (w_q4, w_q4_scale, w_q4_zero), out_ty=R.Tensor((32, 32), "float32"))
            pt = R.permute_dims(wd, axes=[1, 0])
            y = R.matmul(h, pt)
            ed = R.call_tir(cls.q4_dequant_16_32_g32, (emb_q4, emb_q4_scale, emb_q4_zero),
                            out_ty=R.Tensor((16, 32), "float32"))
            pe = R.permute_dims(ed, axes=[1, 0])
            logits = R.matmul(y, pe)
            R.output(logits)
        return logits


def _kernel(n: int, kind: str, rows: tuple[int | None, int | None] = (None, None)) -> tvm.tirx.PrimFunc:
    return opaque(int4_matmul_compute(n, 32, 32, LANES, False, kind=kind, rows=rows))


def test_linears_and_tied_embedding_read_int4() -> None:
    w = {"emb": rand(16, 32), "w": rand(32, 32, seed=1)}
    after, weights = run_pass(quantize_int4, Before, w, context(quantization="q4_g32"))
    expected = with_kernels(
        Expected,
        q4_take_16_32_g32_1x1=_kernel(16, "take", (1, 1)),
        q4_matmul_32_32_g32_1x1=_kernel(32, "matmul", (1, 1)),
        q4_matmul_16_32_g32_1x1=_kernel(16, "matmul", (1, 1)),
        q4_take_16_32_g32_1xn=_kernel(16, "take", (1, None)),
        q4_dequant_32_32_g32=_kernel(32, "dequant"),
        q4_dequant_16_32_g32=_kernel(16, "dequant"),
    )
    tvm.ir.assert_structural_equal(after, expected)
    packed = {n: int4_packed(*quantize_codes(w[n], FMT), FMT).arrays for n in w}
    assert list(weights) == [n + suffix for n in w for suffix, _ in packed[n]]
    for n in w:
        for suffix, arr in packed[n]:
            assert weights[n + suffix].dtype == arr.dtype
            np.testing.assert_array_equal(weights[n + suffix], arr)


@I.ir_module
class NoLinear:
    """A matmul whose weight is computed in the function (no weight a linear reads as it is)."""

    @R.function
    def decode(x: R.Tensor((1, 1, 32), "float32"), w: R.Tensor((32, 32), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            w2 = R.add(w, w)
            pt = R.permute_dims(w2, axes=[1, 0])
            y = R.matmul(x, pt)
            R.output(y)
        return y


def test_weights_no_linear_reads_stay_float() -> None:
    assert_unchanged(quantize_int4, NoLinear, {"w": rand(32, 32, seed=1)}, context(quantization="q4_g32"))


@I.ir_module
class GatherOnly:
    """An untied embedding: only gathered."""

    @R.function
    def decode(ids: R.Tensor((1, 1), "int64"), emb: R.Tensor((16, 32), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            h = R.take(emb, ids, axis=0)
            R.output(h)
        return h


def test_an_untied_embedding_is_gathered_from_int4_codes() -> None:
    """Its rows come from the packed table as they are gathered (a q4_take kernel): no float32 copy is kept."""
    emb = rand(16, 32)
    with use_activations("f32"):
        out, weights = run_pass(quantize_int4, GatherOnly, {"emb": emb}, context(quantization="q4_g32"))
    assert "emb" not in weights and weights["emb_q4"].dtype == np.uint32
    takes = [gv.name_hint for gv in out.get_global_vars() if gv.name_hint.startswith("q4_take")]
    assert takes == ["q4_take_16_32_g32_1x1"], [gv.name_hint for gv in out.get_global_vars()]


@I.ir_module(check_well_formed=False)
class ExpectedVnni:
    @T.prim_func(private=True)
    def q4_take_16_32_g32v_1x1():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q4_matmul_32_32_g32v_1x1():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q4_matmul_16_32_g32v_1x1():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q4_take_16_32_g32v_1xn():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q4_matmul_32_32_g32v_1xn():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q4_matmul_16_32_g32v_1xn():
        T.evaluate(0)

    @R.function
    def decode(ids: R.Tensor((1, 1), "int64"),
               emb_q4: R.Tensor((8, 64), "uint8"), emb_q4_scale: R.Tensor((16, 16), "float16"),
               emb_q4_zero: R.Tensor((16, 16), "uint8"),
               w_q4: R.Tensor((16, 64), "uint8"), w_q4_scale: R.Tensor((32, 16), "float16"),
               w_q4_zero: R.Tensor((32, 16), "uint8")):
        R.func_attr({"num_input": 1})
        cls = ExpectedVnni
        with R.dataflow():
            h = R.call_tir(cls.q4_take_16_32_g32v_1x1, (emb_q4, emb_q4_scale, emb_q4_zero, ids),
                           out_ty=R.Tensor((1, 1, 32), "float32"))
            y = R.call_tir(cls.q4_matmul_32_32_g32v_1x1, (h, w_q4, w_q4_scale, w_q4_zero),
                           out_ty=R.Tensor((1, 1, 32), "float32"))
            logits = R.call_tir(cls.q4_matmul_16_32_g32v_1x1, (y, emb_q4, emb_q4_scale, emb_q4_zero),
                                out_ty=R.Tensor((1, 1, 16), "float32"))
            R.output(logits)
        return logits

    @R.function
    def prefill(ids: R.Tensor((1, "seq"), "int64"),
                emb_q4: R.Tensor((8, 64), "uint8"), emb_q4_scale: R.Tensor((16, 16), "float16"),
                emb_q4_zero: R.Tensor((16, 16), "uint8"),
                w_q4: R.Tensor((16, 64), "uint8"), w_q4_scale: R.Tensor((32, 16), "float16"),
                w_q4_zero: R.Tensor((32, 16), "uint8")):
        R.func_attr({"num_input": 1})
        seq = T.int64()
        cls = ExpectedVnni
        with R.dataflow():
            h = R.call_tir(cls.q4_take_16_32_g32v_1xn, (emb_q4, emb_q4_scale, emb_q4_zero, ids),
                           out_ty=R.Tensor((1, seq, 32), "float32"))
            y = R.call_tir(cls.q4_matmul_32_32_g32v_1xn, (h, w_q4, w_q4_scale, w_q4_zero),
                           out_ty=R.Tensor((1, seq, 32), "float32"))
            logits = R.call_tir(cls.q4_matmul_16_32_g32v_1xn, (y, emb_q4, emb_q4_scale, emb_q4_zero),
                                out_ty=R.Tensor((1, seq, 16), "float32"))
            R.output(logits)
        return logits


def _vnni(n: int, kind: str, rows: tuple[int | None, int | None]) -> tvm.tirx.PrimFunc:
    return opaque(vnni_compute(n, 32, 32, 4, False, False, kind, rows))


def test_int8_activations_use_the_vnni_layout() -> None:
    w = {"emb": rand(16, 32), "w": rand(32, 32, seed=1)}
    with use_activations("int8"):
        after, weights = run_pass(quantize_int4, Before, w, context(quantization="q4_g32"))
    expected = with_kernels(
        ExpectedVnni,
        q4_take_16_32_g32v_1x1=_vnni(16, "take", (1, 1)),
        q4_matmul_32_32_g32v_1x1=_vnni(32, "matmul", (1, 1)),
        q4_matmul_16_32_g32v_1x1=_vnni(16, "matmul", (1, 1)),
        q4_take_16_32_g32v_1xn=_vnni(16, "take", (1, None)),
        q4_matmul_32_32_g32v_1xn=_vnni(32, "matmul", (1, None)),
        q4_matmul_16_32_g32v_1xn=_vnni(16, "matmul", (1, None)),
    )
    tvm.ir.assert_structural_equal(after, expected)
    for n in w:  # the VNNI layout as _qvnni documents it: row pairs in nibbles, K padded to 64, groups to 16
        codes, scale, zero = quantize_codes(w[n], FMT)
        pairs = np.zeros((codes.shape[0] // 2, 64), np.uint8)
        pairs[:, :32] = codes[0::2] | (codes[1::2] << 4)
        np.testing.assert_array_equal(weights[n + "_q4"], pairs)
        np.testing.assert_array_equal(weights[n + "_q4_scale"], np.pad(scale, ((0, 0), (0, 15))))
        np.testing.assert_array_equal(weights[n + "_q4_zero"], np.pad(zero, ((0, 0), (0, 15))))
