"""weight_layout: ``x @ permute_dims(W)`` becomes one NT matmul reading W as stored; on CPU targets every
float weight read only by such matmuls and row gathers is packed at compile time into [N / nb, K, nb] panels
(nb = 64 on x86-avx512) that the matmul and the gather read directly, and a quantized weight dequantized at
run time (prefill) is written by its dequantize kernel straight into such panels. A weight N not divisible by
nb, or read by anything else, keeps its [N, K] layout. Every PrimFunc here is small and written out in full
(the int4 dequantize one as ``formats.int4.int4_matmul_compute`` emits it), except the half-panel kernels, compared by
identity to their generators (``_half_panels.half_panel_matmul`` / ``half_panel_take``)."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import tirx
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from perfx_compiler.formats.half import half_compute
from perfx_compiler.formats.int4 import int4_matmul_compute
from perfx_compiler.passes import weight_layout
from perfx_compiler.passes._half_panels import half_panel_matmul, half_panel_take

from ._util import assert_unchanged, context, opaque, rand, run_pass, with_kernels

NB = 64


@I.ir_module
class Before:
    @R.function
    def decode(x: R.Tensor((1, 1, 8), "float32"), ids: R.Tensor((1, 1), "int64"), w: R.Tensor((128, 8), "float32")):
        R.func_attr({"num_input": 2})
        with R.dataflow():
            h = R.take(w, ids, axis=0)
            pt = R.permute_dims(w, axes=[1, 0])
            y = R.matmul(x, pt)
            out = (h, y)
            R.output(out)
        return out


@I.ir_module
class Expected:
    @T.prim_func(private=True, s_tir=True)
    def NT_matmul_packed(x: T.Buffer((T.int64(1), T.int64(1), T.int64(8)), "float32"),
                         w: T.Buffer((T.int64(2), T.int64(8), T.int64(64)), "float32"),
                         NT_matmul: T.Buffer((T.int64(1), T.int64(1), T.int64(128)), "float32")):
        T.func_attr({"tirx.noalias": True})
        for i0, i1, i2, k in T.grid(T.int64(1), T.int64(1), T.int64(128), T.int64(8)):
            with T.sblock("NT_matmul"):
                v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
                T.reads(x[v_i0, v_i1, v_k], w[v_i2 // T.int64(64), v_k, v_i2 % T.int64(64)])
                T.writes(NT_matmul[v_i0, v_i1, v_i2])
                with T.init():
                    NT_matmul[v_i0, v_i1, v_i2] = T.float32(0.0)
                NT_matmul[v_i0, v_i1, v_i2] = (NT_matmul[v_i0, v_i1, v_i2]
                                               + x[v_i0, v_i1, v_k] * w[v_i2 // T.int64(64), v_k, v_i2 % T.int64(64)])

    @T.prim_func(private=True, s_tir=True)
    def take_packed(w: T.Buffer((T.int64(2), T.int64(8), T.int64(64)), "float32"),
                    ids: T.Buffer((T.int64(1), T.int64(1)), "int64"),
                    take_packed: T.Buffer((T.int64(1), T.int64(1), T.int64(8)), "float32")):
        T.func_attr({"tirx.noalias": True})
        for i0, i1, i2 in T.grid(T.int64(1), T.int64(1), T.int64(8)):
            with T.sblock("take_packed"):
                v_i0, v_i1, v_i2 = T.axis.remap("SSS", [i0, i1, i2])
                T.reads(w[ids[v_i0, v_i1] // T.int64(64), v_i2, ids[v_i0, v_i1] % T.int64(64)], ids[v_i0, v_i1])
                T.writes(take_packed[v_i0, v_i1, v_i2])
                take_packed[v_i0, v_i1, v_i2] = w[ids[v_i0, v_i1] // T.int64(64), v_i2, ids[v_i0, v_i1] % T.int64(64)]

    @R.function
    def decode(x: R.Tensor((1, 1, 8), "float32"), ids: R.Tensor((1, 1), "int64"), w: R.Tensor((2, 8, 64), "float32")):
        R.func_attr({"num_input": 2})
        cls = Expected
        with R.dataflow():
            t = R.call_tir(cls.take_packed, (w, ids), out_ty=R.Tensor((1, 1, 8), "float32"))
            h = t
            y = R.call_tir(cls.NT_matmul_packed, (x, w), out_ty=R.Tensor((1, 1, 128), "float32"))
            out = (h, y)
            R.output(out)
        return out


def test_linear_weights_are_packed_into_panels() -> None:
    w = rand(128, 8)
    after, weights = run_pass(weight_layout, Before, {"w": w})
    tvm.ir.assert_structural_equal(after, Expected)
    np.testing.assert_array_equal(weights["w"], w.reshape(2, NB, 8).transpose(0, 2, 1))  # [p, k, j] = W[p*nb + j, k]


@I.ir_module
class Unpackable:
    """w has 48 rows (not a multiple of 64); e is also read by an add."""

    @R.function
    def decode(x: R.Tensor((1, 1, 8), "float32"), w: R.Tensor((48, 8), "float32"), e: R.Tensor((64, 8), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            pt = R.permute_dims(w, axes=[1, 0])
            y = R.matmul(x, pt)
            pe = R.permute_dims(e, axes=[1, 0])
            z = R.matmul(x, pe)
            e2 = R.add(e, e)
            out = (y, z, e2)
            R.output(out)
        return out


@I.ir_module
class UnpackableAfter:
    """FuseTransposeMatmul's NT matmuls; its two composite functions stay behind, uncalled (nothing else in
    the pass runs DeadCodeElimination on this path; phase 2's drops them)."""

    @R.function(private=True)
    def fused_relax_permute_dims_relax_matmul(w: R.Tensor((48, 8), "float32"), x: R.Tensor((1, 1, 8), "float32")):
        R.func_attr({"Composite": "transpose_matmul_fuse", "Primitive": True})
        with R.dataflow():
            pt = R.permute_dims(w, axes=[1, 0])
            gv = R.matmul(x, pt)
            R.output(gv)
        return gv

    @R.function(private=True)
    def fused_relax_permute_dims_relax_matmul1(e: R.Tensor((64, 8), "float32"), x: R.Tensor((1, 1, 8), "float32")):
        R.func_attr({"Composite": "transpose_matmul_fuse", "Primitive": True})
        with R.dataflow():
            pe = R.permute_dims(e, axes=[1, 0])
            gv = R.matmul(x, pe)
            R.output(gv)
        return gv
    @T.prim_func(private=True, s_tir=True)
    def NT_matmul(x: T.Buffer((T.int64(1), T.int64(1), T.int64(8)), "float32"),
                  w: T.Buffer((T.int64(48), T.int64(8)), "float32"),
                  NT_matmul: T.Buffer((T.int64(1), T.int64(1), T.int64(48)), "float32")):
        T.func_attr({"tirx.noalias": True})
        for i0, i1, i2, k in T.grid(T.int64(1), T.int64(1), T.int64(48), T.int64(8)):
            with T.sblock("NT_matmul"):
                v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
                T.reads(x[v_i0, v_i1, v_k], w[v_i2, v_k])
                T.writes(NT_matmul[v_i0, v_i1, v_i2])
                with T.init():
                    NT_matmul[v_i0, v_i1, v_i2] = T.float32(0.0)
                NT_matmul[v_i0, v_i1, v_i2] = NT_matmul[v_i0, v_i1, v_i2] + x[v_i0, v_i1, v_k] * w[v_i2, v_k]

    @T.prim_func(private=True, s_tir=True)
    def NT_matmul1(x: T.Buffer((T.int64(1), T.int64(1), T.int64(8)), "float32"),
                   w: T.Buffer((T.int64(64), T.int64(8)), "float32"),
                   NT_matmul: T.Buffer((T.int64(1), T.int64(1), T.int64(64)), "float32")):
        T.func_attr({"tirx.noalias": True})
        for i0, i1, i2, k in T.grid(T.int64(1), T.int64(1), T.int64(64), T.int64(8)):
            with T.sblock("NT_matmul"):
                v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
                T.reads(x[v_i0, v_i1, v_k], w[v_i2, v_k])
                T.writes(NT_matmul[v_i0, v_i1, v_i2])
                with T.init():
                    NT_matmul[v_i0, v_i1, v_i2] = T.float32(0.0)
                NT_matmul[v_i0, v_i1, v_i2] = NT_matmul[v_i0, v_i1, v_i2] + x[v_i0, v_i1, v_k] * w[v_i2, v_k]

    @R.function
    def decode(x: R.Tensor((1, 1, 8), "float32"), w: R.Tensor((48, 8), "float32"), e: R.Tensor((64, 8), "float32")):
        R.func_attr({"num_input": 1})
        cls = UnpackableAfter
        with R.dataflow():
            y = R.call_tir(cls.NT_matmul, (x, w), out_ty=R.Tensor((1, 1, 48), "float32"))
            z = R.call_tir(cls.NT_matmul1, (x, e), out_ty=R.Tensor((1, 1, 64), "float32"))
            e2 = R.add(e, e)
            out = (y, z, e2)
            R.output(out)
        return out


def test_unpackable_weights_keep_their_layout() -> None:
    """Only the transpose is fused (NT matmuls reading W as stored); the weights stay [N, K]."""
    w = {"w": rand(48, 8), "e": rand(64, 8, seed=1)}
    after, weights = run_pass(weight_layout, Unpackable, w)
    tvm.ir.assert_structural_equal(after, UnpackableAfter)
    assert all(weights[n] is w[n] for n in w)


def test_gpu_targets_keep_weights_as_stored() -> None:
    """cuda: NT matmul, no panels (GPU rules read NT weights)."""
    after, weights = run_pass(weight_layout, Unpackable, {"w": rand(48, 8), "e": rand(64, 8)}, context("cuda-sm80"))
    tvm.ir.assert_structural_equal(after, UnpackableAfter)


@I.ir_module
class NoLinear:
    @R.function
    def decode(ids: R.Tensor((1, 1), "int64"), e: R.Tensor((64, 8), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            h = R.take(e, ids, axis=0)
            e2 = R.add(e, e)
            out = (h, e2)
            R.output(out)
        return out


def test_weights_read_as_floats_are_left_alone() -> None:
    assert_unchanged(weight_layout, NoLinear, {"e": rand(64, 8)})


@I.ir_module(check_well_formed=False)
class Dequantized:
    """Prefill over an int4 weight (quantize_int4's form): dequantize, then the float matmul."""

    @T.prim_func(private=True)
    def q4_dequant_128_32_g32():
        T.evaluate(0)

    @R.function
    def prefill(x: R.Tensor((1, "seq", 32), "float32"), w_q4: R.Tensor((128, 4), "uint32"),
                w_q4_scale: R.Tensor((128, 1), "float16"), w_q4_zero: R.Tensor((128, 1), "uint8")):
        R.func_attr({"num_input": 1})
        cls = Dequantized
        with R.dataflow():
            wd = R.call_tir(cls.q4_dequant_128_32_g32, (w_q4, w_q4_scale, w_q4_zero), out_ty=R.Tensor((128, 32), "float32"))
            pt = R.permute_dims(wd, axes=[1, 0])
            y = R.matmul(x, pt)
            R.output(y)
        return y


@I.ir_module
class DequantizedToPanels:
    @T.prim_func(s_tir=True)
    def q4_dequant_128_32_g32_packed(q: T.Buffer((128, 4), "uint32"), scale: T.Buffer((128, 1), "float16"),
                                     zero: T.Buffer((128, 1), "uint8"), dequant_q4: T.Buffer((2, 32, 64), "float32")):
        T.func_attr({"global_symbol": "main", "op_pattern": 8, "tirx.noalias": True, "perfx.quant":
                     '{"K": 32, "N": 128, "bits": 4, "group": 32, "kind": "dequant", "lanes": 4, "sym": false}'})
        for row, col in T.grid(128, 32):
            with T.sblock("dequant_q4"):
                v_row, v_col = T.axis.remap("SS", [row, col])
                T.reads(q[v_row, v_col // 32 * 4 + v_col % 4], zero[v_row, v_col // 32], scale[v_row, v_col // 32])
                T.writes(dequant_q4[v_row // 64, v_col, v_row % 64])
                dequant_q4[v_row // 64, v_col, v_row % 64] = (
                    T.Cast("float32", q[v_row, v_col // 32 * 4 + v_col % 4] >> T.Cast("uint32", v_col % 32 // 4 * 4)
                           & T.uint32(15))
                    - T.Cast("float32", zero[v_row, v_col // 32])) * T.Cast("float32", scale[v_row, v_col // 32])

    @T.prim_func(private=True, s_tir=True)
    def NT_matmul_packed(var_x: T.handle, wd: T.Buffer((T.int64(2), T.int64(32), T.int64(64)), "float32"),
                         var_NT_matmul: T.handle):
        T.func_attr({"tirx.noalias": True})
        seq = T.int64()
        x = T.match_buffer(var_x, (T.int64(1), seq, T.int64(32)))
        NT_matmul = T.match_buffer(var_NT_matmul, (T.int64(1), seq, T.int64(128)))
        for i0, i1, i2, k in T.grid(T.int64(1), seq, T.int64(128), T.int64(32)):
            with T.sblock("NT_matmul"):
                v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
                T.reads(x[v_i0, v_i1, v_k], wd[v_i2 // T.int64(64), v_k, v_i2 % T.int64(64)])
                T.writes(NT_matmul[v_i0, v_i1, v_i2])
                with T.init():
                    NT_matmul[v_i0, v_i1, v_i2] = T.float32(0.0)
                NT_matmul[v_i0, v_i1, v_i2] = (NT_matmul[v_i0, v_i1, v_i2]
                                               + x[v_i0, v_i1, v_k] * wd[v_i2 // T.int64(64), v_k, v_i2 % T.int64(64)])

    @R.function
    def prefill(x: R.Tensor((1, "seq", 32), "float32"), w_q4: R.Tensor((128, 4), "uint32"),
                w_q4_scale: R.Tensor((128, 1), "float16"), w_q4_zero: R.Tensor((128, 1), "uint8")):
        R.func_attr({"num_input": 1})
        seq = T.int64()
        cls = DequantizedToPanels
        with R.dataflow():
            wd = R.call_tir(cls.q4_dequant_128_32_g32_packed, (w_q4, w_q4_scale, w_q4_zero),
                            out_ty=R.Tensor((2, 32, 64), "float32"))
            y = R.call_tir(cls.NT_matmul_packed, (x, wd), out_ty=R.Tensor((1, seq, 128), "float32"))
            R.output(y)
        return y


def test_runtime_dequantized_weights_are_written_as_panels() -> None:
    """The dequantize kernel writes [N / nb, K, nb]; the unpacked dequantize, now uncalled, leaves the module;
    the quantized arrays are untouched."""
    dequant = opaque(int4_matmul_compute(128, 32, 32, 4, False, kind="dequant", rows=(None, None)))
    w = {"w_q4": np.zeros((128, 4), "uint32"), "w_q4_scale": np.ones((128, 1), "float16"),
         "w_q4_zero": np.zeros((128, 1), "uint8")}
    after, weights = run_pass(weight_layout, with_kernels(Dequantized, q4_dequant_128_32_g32=dequant), w)
    tvm.ir.assert_structural_equal(after, DequantizedToPanels)
    assert all(weights[n] is w[n] for n in w)


@I.ir_module(check_well_formed=False)
class Half:
    """cast_weights' form (bf16): decode's half GEMV and gathers, prefill's widen (dequantize) + matmul."""

    @T.prim_func(private=True)
    def bf16_take_64_32_w_1x1():
        T.evaluate(0)

    @T.prim_func(private=True)
    def bf16_matmul_64_32_w_1x1():
        T.evaluate(0)

    @T.prim_func(private=True)
    def bf16_take_64_32_w_1xn():
        T.evaluate(0)

    @T.prim_func(private=True)
    def bf16_dequant_64_32_w():
        T.evaluate(0)

    @R.function
    def decode(ids: R.Tensor((1, 1), "int64"), x: R.Tensor((1, 1, 32), "float32"),
               emb_bf16: R.Tensor((64, 32), "uint16"), w_bf16: R.Tensor((64, 32), "uint16")):
        R.func_attr({"num_input": 2})
        cls = Half
        with R.dataflow():
            h = R.call_tir(cls.bf16_take_64_32_w_1x1, (emb_bf16, ids), out_ty=R.Tensor((1, 1, 32), "float32"))
            y = R.call_tir(cls.bf16_matmul_64_32_w_1x1, (x, w_bf16), out_ty=R.Tensor((1, 1, 64), "float32"))
            out = (h, y)
            R.output(out)
        return out

    @R.function
    def prefill(ids: R.Tensor((1, "seq"), "int64"), x: R.Tensor((1, "seq", 32), "float32"),
                emb_bf16: R.Tensor((64, 32), "uint16"), w_bf16: R.Tensor((64, 32), "uint16")):
        R.func_attr({"num_input": 2})
        seq = T.int64()
        cls = Half
        with R.dataflow():
            h = R.call_tir(cls.bf16_take_64_32_w_1xn, (emb_bf16, ids), out_ty=R.Tensor((1, seq, 32), "float32"))
            wd = R.call_tir(cls.bf16_dequant_64_32_w, (w_bf16,), out_ty=R.Tensor((64, 32), "float32"))
            pt = R.permute_dims(wd, axes=[1, 0])
            y = R.matmul(x, pt)
            out = (h, y)
            R.output(out)
        return out


@I.ir_module(check_well_formed=False)
class HalfPanels:
    """The half weights as [N / nb, K, nb] half panels, read by panel kernels; the row-layout half kernels
    and prefill's float32 dequantize are gone."""

    @T.prim_func(private=True)
    def bf16_take_64_32_1x1_int64_panels():
        T.evaluate(0)

    @T.prim_func(private=True)
    def bf16_gemv_64_32_1x1_panels():
        T.evaluate(0)

    @T.prim_func(private=True)
    def bf16_take_64_32_1xn_int64_panels():
        T.evaluate(0)

    @T.prim_func(private=True)
    def bf16_gemm_64_32_1xn_panels():
        T.evaluate(0)

    @R.function
    def decode(ids: R.Tensor((1, 1), "int64"), x: R.Tensor((1, 1, 32), "float32"),
               emb_bf16: R.Tensor((1, 32, 64), "uint16"), w_bf16: R.Tensor((1, 32, 64), "uint16")):
        R.func_attr({"num_input": 2})
        cls = HalfPanels
        with R.dataflow():
            h = R.call_tir(cls.bf16_take_64_32_1x1_int64_panels, (emb_bf16, ids), out_ty=R.Tensor((1, 1, 32), "float32"))
            y = R.call_tir(cls.bf16_gemv_64_32_1x1_panels, (x, w_bf16), out_ty=R.Tensor((1, 1, 64), "float32"))
            out = (h, y)
            R.output(out)
        return out

    @R.function
    def prefill(ids: R.Tensor((1, "seq"), "int64"), x: R.Tensor((1, "seq", 32), "float32"),
                emb_bf16: R.Tensor((1, 32, 64), "uint16"), w_bf16: R.Tensor((1, 32, 64), "uint16")):
        R.func_attr({"num_input": 2})
        seq = T.int64()
        cls = HalfPanels
        with R.dataflow():
            h = R.call_tir(cls.bf16_take_64_32_1xn_int64_panels, (emb_bf16, ids), out_ty=R.Tensor((1, seq, 32), "float32"))
            y = R.call_tir(cls.bf16_gemm_64_32_1xn_panels, (x, w_bf16), out_ty=R.Tensor((1, seq, 64), "float32"))
            out = (h, y)
            R.output(out)
        return out


def test_half_weights_become_half_panels() -> None:
    def half(kind: str, rows: tuple[int | None, int | None] = (None, None)) -> tvm.tirx.PrimFunc:
        return opaque(half_compute(64, 32, "bf16", kind=kind, rows=rows, act="f32"))

    before = with_kernels(Half, bf16_take_64_32_w_1x1=half("take", (1, 1)), bf16_matmul_64_32_w_1x1=half("matmul", (1, 1)),
                          bf16_take_64_32_w_1xn=half("take", (1, None)), bf16_dequant_64_32_w=half("dequant"))
    rng = np.random.default_rng(0)
    w = {n: rng.integers(0, 2**16, size=(64, 32), dtype=np.uint16) for n in ("emb_bf16", "w_bf16")}
    after, weights = run_pass(weight_layout, before, w)
    def seq() -> tirx.Var:  # each kernel has its own row variable (bound by its x / ids)
        return tirx.Var("n1", "int64")

    expected = with_kernels(
        HalfPanels,
        bf16_take_64_32_1x1_int64_panels=half_panel_take([1, 1], "int64", 64, 32, NB, "bf16"),
        bf16_gemv_64_32_1x1_panels=half_panel_matmul([1, 1, 32], 64, 32, NB, "bf16"),
        bf16_take_64_32_1xn_int64_panels=half_panel_take([1, seq()], "int64", 64, 32, NB, "bf16"),
        bf16_gemm_64_32_1xn_panels=half_panel_matmul([1, seq(), 32], 64, 32, NB, "bf16"),
    )
    tvm.ir.assert_structural_equal(after, expected)
    for n in w:
        np.testing.assert_array_equal(weights[n], w[n].reshape(1, NB, 32).transpose(0, 2, 1))
