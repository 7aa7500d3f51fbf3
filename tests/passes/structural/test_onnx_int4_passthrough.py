"""onnx_int4_passthrough (quantization ``onnx``): linears of an onnxruntime-genai int4 model read its
MatMulNBits codes, scales (rounded to fp16) and zero points on PerfX's int4 kernels; merged gate|up takes its
members' tables by rows (a member without zero points joins with explicit 8s); a weight without a table, or
whose table the kernels cannot hold, stays float.

The kernel is compared by identity to its generator (``formats.int4.int4_matmul_compute``), the Relax function as
written here, the arrays to the table's codes (packed by ``formats.int4.pack_int4``), scales and zero points.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from perfx_compiler.formats.int4 import int4_matmul_compute, pack_int4
from perfx_compiler.model.foreign_onnx.nbits import NBitsTable
from perfx_compiler.passes import onnx_int4_passthrough

from ._util import assert_unchanged, context, opaque, rand, run_pass, with_kernels

GU = "model_layers_0_mlp_gate_up_proj_weight"


def _table(n: int, k: int, block: int, zeros: bool, seed: int, scale: float = 0.05) -> NBitsTable:
    rng = np.random.default_rng(seed)
    ng = -(-k // block)
    return NBitsTable(4, block, rng.integers(0, 16, size=(n, k)).astype(np.uint8),
                      (scale * (1 + rng.random((n, ng)))).astype(np.float32),
                      rng.integers(0, 16, size=(n, ng)).astype(np.uint8) if zeros else None)


@I.ir_module
class Before:
    @R.function
    def decode(x: R.Tensor((1, 1, 32), "float32"), model_layers_0_mlp_gate_up_proj_weight: R.Tensor((16, 32), "float32"),
               lm_head_weight: R.Tensor((8, 32), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            p1 = R.permute_dims(model_layers_0_mlp_gate_up_proj_weight, axes=[1, 0])
            gu = R.matmul(x, p1)
            p2 = R.permute_dims(lm_head_weight, axes=[1, 0])
            logits = R.matmul(x, p2)
            out = (gu, logits)
            R.output(out)
        return out


@I.ir_module(check_well_formed=False)
class Expected:
    @T.prim_func(private=True)
    def q4_matmul_16_32_g32_1x1():
        T.evaluate(0)

    @R.function
    def decode(x: R.Tensor((1, 1, 32), "float32"),
               model_layers_0_mlp_gate_up_proj_weight_q4: R.Tensor((16, 4), "uint32"),
               model_layers_0_mlp_gate_up_proj_weight_q4_scale: R.Tensor((16, 1), "float16"),
               model_layers_0_mlp_gate_up_proj_weight_q4_zero: R.Tensor((16, 1), "uint8"),
               lm_head_weight: R.Tensor((8, 32), "float32")):
        R.func_attr({"num_input": 1})
        cls = Expected
        with R.dataflow():
            gu = R.call_tir(cls.q4_matmul_16_32_g32_1x1,
                            (x, model_layers_0_mlp_gate_up_proj_weight_q4, model_layers_0_mlp_gate_up_proj_weight_q4_scale,
                             model_layers_0_mlp_gate_up_proj_weight_q4_zero), out_ty=R.Tensor((1, 1, 16), "float32"))
            p2 = R.permute_dims(lm_head_weight, axes=[1, 0])
            logits = R.matmul(x, p2)
            out = (gu, logits)
            R.output(out)
        return out


def test_linears_read_the_matmulnbits_tables() -> None:
    gate, up = _table(8, 32, 32, zeros=True, seed=0), _table(8, 32, 32, zeros=False, seed=1)
    desc = SimpleNamespace(quantized={"model.layers.0.mlp.gate_proj.weight": ("MatMulNBits", gate, None),
                                      "model.layers.0.mlp.up_proj.weight": ("MatMulNBits", up, None)})
    weights = {GU: np.concatenate([gate.dequantize(), up.dequantize()]), "lm_head_weight": rand(8, 32)}
    after, new = run_pass(onnx_int4_passthrough, Before, weights, context(quantization="onnx", desc=desc))
    kernel = opaque(int4_matmul_compute(16, 32, 32, 4, False, kind="matmul", rows=(1, 1)))
    tvm.ir.assert_structural_equal(after, with_kernels(Expected, q4_matmul_16_32_g32_1x1=kernel))
    assert list(new) == [GU + "_q4", GU + "_q4_scale", GU + "_q4_zero", "lm_head_weight"]
    np.testing.assert_array_equal(new[GU + "_q4"], pack_int4(np.concatenate([gate.codes, up.codes]), 4))
    np.testing.assert_array_equal(new[GU + "_q4_scale"], np.concatenate([gate.scales, up.scales]).astype(np.float16))
    np.testing.assert_array_equal(new[GU + "_q4_zero"], np.concatenate([gate.zeros, np.full((8, 1), 8, np.uint8)]))


@I.ir_module
class Unfit:
    """down's scales overflow float16; o_proj's K (16) is not a multiple of 32: both stay float."""

    @R.function
    def decode(x: R.Tensor((1, 1, 32), "float32"), y: R.Tensor((1, 1, 16), "float32"),
               model_layers_0_mlp_down_proj_weight: R.Tensor((8, 32), "float32"),
               model_layers_0_self_attn_o_proj_weight: R.Tensor((8, 16), "float32")):
        R.func_attr({"num_input": 2})
        with R.dataflow():
            p1 = R.permute_dims(model_layers_0_mlp_down_proj_weight, axes=[1, 0])
            a = R.matmul(x, p1)
            p2 = R.permute_dims(model_layers_0_self_attn_o_proj_weight, axes=[1, 0])
            b = R.matmul(y, p2)
            out = (a, b)
            R.output(out)
        return out


def test_tables_the_kernels_cannot_hold_stay_float() -> None:
    down, o = _table(8, 32, 32, zeros=True, seed=2, scale=1e5), _table(8, 16, 16, zeros=False, seed=3)
    desc = SimpleNamespace(quantized={"model.layers.0.mlp.down_proj.weight": ("MatMulNBits", down, None),
                                      "model.layers.0.self_attn.o_proj.weight": ("MatMulNBits", o, None)})
    weights = {"model_layers_0_mlp_down_proj_weight": down.dequantize(),
               "model_layers_0_self_attn_o_proj_weight": o.dequantize()}
    assert_unchanged(onnx_int4_passthrough, Unfit, weights, context(quantization="onnx", desc=desc))
