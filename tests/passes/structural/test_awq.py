"""awq (quantization ``q4_awq_g32``): per layer, the merged qkv and gate|up linears' input columns are scaled
by the activation-aware factors s and the norm before each divided by s (the product is unchanged), then
every linear is quantized as quantize_int4 does. The IR is quantize_int4's: the kernels are compared by
identity to ``formats.int4.int4_matmul_compute``, the Relax function as written here; the folding is checked on the
arrays: the qkv codes are those of ``W * s`` with ``s = norm_before / norm_after``.

The calibration runs the float reference of a one-layer random model (no tokenizer: fixed pseudo-random ids).
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from perfx_compiler.errors import PerfXError
from perfx_compiler.formats.int4 import Int4Format, int4_matmul_compute, int4_packed, quantize_int4
from perfx_compiler.passes import awq
from tests.passes.conftest import tiny_desc

from ._util import assert_unchanged, context, opaque, run_pass, with_kernels

P = "model_layers_0_"
FMT = Int4Format(32, symmetric=False)


def _model() -> tuple[object, dict[str, np.ndarray]]:
    """A one-layer llama (hidden 32, q 32 + k 16 + v 16, ffn 32) and its weight table after merge_projections."""
    desc = tiny_desc(hidden=32, ffn=32, layers=1, seed=3)
    for norm in ("input_layernorm", "post_attention_layernorm"):  # salient channels: every 4th is 8x larger
        desc.weights[f"model.layers.0.{norm}.weight"][::4] *= 8
    w = {k.replace(".", "_"): v for k, v in desc.weights.items()}
    cat = np.concatenate
    return desc, {
        P + "input_layernorm_weight": w[P + "input_layernorm_weight"],
        P + "self_attn_qkv_proj_weight": cat([w[P + f"self_attn_{m}_proj_weight"] for m in "qkv"]),
        P + "post_attention_layernorm_weight": w[P + "post_attention_layernorm_weight"],
        P + "mlp_gate_up_proj_weight": cat([w[P + "mlp_gate_proj_weight"], w[P + "mlp_up_proj_weight"]]),
        P + "mlp_down_proj_weight": w[P + "mlp_down_proj_weight"],
    }


@I.ir_module
class Before:
    @R.function
    def decode(x: R.Tensor((1, 1, 32), "float32"),
               model_layers_0_input_layernorm_weight: R.Tensor((32,), "float32"),
               model_layers_0_self_attn_qkv_proj_weight: R.Tensor((64, 32), "float32"),
               model_layers_0_post_attention_layernorm_weight: R.Tensor((32,), "float32"),
               model_layers_0_mlp_gate_up_proj_weight: R.Tensor((64, 32), "float32"),
               model_layers_0_mlp_down_proj_weight: R.Tensor((32, 32), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            h1 = R.multiply(x, model_layers_0_input_layernorm_weight)
            p1 = R.permute_dims(model_layers_0_self_attn_qkv_proj_weight, axes=[1, 0])
            qkv = R.matmul(h1, p1)
            h2 = R.multiply(x, model_layers_0_post_attention_layernorm_weight)
            p2 = R.permute_dims(model_layers_0_mlp_gate_up_proj_weight, axes=[1, 0])
            gu = R.matmul(h2, p2)
            p3 = R.permute_dims(model_layers_0_mlp_down_proj_weight, axes=[1, 0])
            d = R.matmul(x, p3)
            out = (qkv, gu, d)
            R.output(out)
        return out


@I.ir_module(check_well_formed=False)
class Expected:
    @T.prim_func(private=True)
    def q4_matmul_64_32_g32_1x1():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q4_matmul_32_32_g32_1x1():
        T.evaluate(0)

    @R.function
    def decode(x: R.Tensor((1, 1, 32), "float32"),
               model_layers_0_input_layernorm_weight: R.Tensor((32,), "float32"),
               model_layers_0_self_attn_qkv_proj_weight_q4: R.Tensor((64, 4), "uint32"),
               model_layers_0_self_attn_qkv_proj_weight_q4_scale: R.Tensor((64, 1), "float16"),
               model_layers_0_self_attn_qkv_proj_weight_q4_zero: R.Tensor((64, 1), "uint8"),
               model_layers_0_post_attention_layernorm_weight: R.Tensor((32,), "float32"),
               model_layers_0_mlp_gate_up_proj_weight_q4: R.Tensor((64, 4), "uint32"),
               model_layers_0_mlp_gate_up_proj_weight_q4_scale: R.Tensor((64, 1), "float16"),
               model_layers_0_mlp_gate_up_proj_weight_q4_zero: R.Tensor((64, 1), "uint8"),
               model_layers_0_mlp_down_proj_weight_q4: R.Tensor((32, 4), "uint32"),
               model_layers_0_mlp_down_proj_weight_q4_scale: R.Tensor((32, 1), "float16"),
               model_layers_0_mlp_down_proj_weight_q4_zero: R.Tensor((32, 1), "uint8")):
        R.func_attr({"num_input": 1})
        cls = Expected
        with R.dataflow():
            h1 = R.multiply(x, model_layers_0_input_layernorm_weight)
            qkv = R.call_tir(cls.q4_matmul_64_32_g32_1x1,
                             (h1, model_layers_0_self_attn_qkv_proj_weight_q4, model_layers_0_self_attn_qkv_proj_weight_q4_scale,
                              model_layers_0_self_attn_qkv_proj_weight_q4_zero), out_ty=R.Tensor((1, 1, 64), "float32"))
            h2 = R.multiply(x, model_layers_0_post_attention_layernorm_weight)
            gu = R.call_tir(cls.q4_matmul_64_32_g32_1x1,
                            (h2, model_layers_0_mlp_gate_up_proj_weight_q4, model_layers_0_mlp_gate_up_proj_weight_q4_scale,
                             model_layers_0_mlp_gate_up_proj_weight_q4_zero), out_ty=R.Tensor((1, 1, 64), "float32"))
            d = R.call_tir(cls.q4_matmul_32_32_g32_1x1,
                           (x, model_layers_0_mlp_down_proj_weight_q4, model_layers_0_mlp_down_proj_weight_q4_scale,
                            model_layers_0_mlp_down_proj_weight_q4_zero), out_ty=R.Tensor((1, 1, 32), "float32"))
            out = (qkv, gu, d)
            R.output(out)
        return out


def test_scales_fold_into_the_norms_then_int4() -> None:
    desc, weights = _model()
    after, new = run_pass(awq, Before, weights, context(quantization="q4_awq_g32", desc=desc))
    expected = with_kernels(
        Expected,
        q4_matmul_64_32_g32_1x1=opaque(int4_matmul_compute(64, 32, 32, 4, False, kind="matmul", rows=(1, 1))),
        q4_matmul_32_32_g32_1x1=opaque(int4_matmul_compute(32, 32, 32, 4, False, kind="matmul", rows=(1, 1))),
    )
    tvm.ir.assert_structural_equal(after, expected)
    norm, qkv = P + "input_layernorm_weight", P + "self_attn_qkv_proj_weight"
    s = weights[norm] / new[norm]
    assert not np.allclose(s, 1.0)  # the calibration found salient channels
    scaled = int4_packed(*quantize_int4(weights[qkv] * s[None, :], FMT), FMT).arrays
    for suffix, arr in scaled:
        np.testing.assert_array_equal(new[qkv + suffix], arr)


def test_other_quantizations_are_left_to_their_passes() -> None:
    desc, weights = _model()
    assert_unchanged(awq, Before, weights, context(quantization="q4_g32", desc=desc))


def test_needs_the_merged_projections() -> None:
    desc, weights = _model()
    weights[P + "self_attn_q_proj_weight"] = weights.pop(P + "self_attn_qkv_proj_weight")
    with pytest.raises(PerfXError, match="merge_projections"):
        awq.apply(Before, weights, context(quantization="q4_awq_g32", desc=desc))
