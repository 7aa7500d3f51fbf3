"""merge_projections: the Q/K/V linears of one input become one matmul over the concatenated weight (and
bias), gate/up another; the members are ``strided_slice`` views of the merged result, or, where Q/K/V only
feed the attention kernel, that kernel re-targeted to read them out of the merged tensor in place. The
weight table changes with the signature: ``qkv_proj`` at q's position, ``gate_up_proj`` at gate's.

The attention kernels are the import's own (``kernels.attention.attention_prefill_kernel``) and the
re-targeted one is compared by identity to ``_kernels.attention_over_qkv`` of it."""

from __future__ import annotations

import numpy as np
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from perfx_compiler.kernels.attention import attention_prefill_kernel
from perfx_compiler.kernels.attention_qkv import attention_over_qkv
from perfx_compiler.passes import merge_projections

from ._util import assert_unchanged, opaque, rand, run_pass, with_kernels

P = "model_layers_0_"


@I.ir_module
class Before:
    @R.function
    def decode(x: R.Tensor((1, 1, 16), "float32"),
               model_layers_0_self_attn_q_proj_weight: R.Tensor((16, 16), "float32"),
               model_layers_0_self_attn_q_proj_bias: R.Tensor((16,), "float32"),
               model_layers_0_self_attn_k_proj_weight: R.Tensor((8, 16), "float32"),
               model_layers_0_self_attn_k_proj_bias: R.Tensor((8,), "float32"),
               model_layers_0_self_attn_v_proj_weight: R.Tensor((8, 16), "float32"),
               model_layers_0_self_attn_v_proj_bias: R.Tensor((8,), "float32"),
               model_layers_0_mlp_gate_proj_weight: R.Tensor((32, 16), "float32"),
               model_layers_0_mlp_up_proj_weight: R.Tensor((32, 16), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            pq = R.permute_dims(model_layers_0_self_attn_q_proj_weight, axes=[1, 0])
            mq = R.matmul(x, pq)
            q = R.add(mq, model_layers_0_self_attn_q_proj_bias)
            pk = R.permute_dims(model_layers_0_self_attn_k_proj_weight, axes=[1, 0])
            mk = R.matmul(x, pk)
            k = R.add(mk, model_layers_0_self_attn_k_proj_bias)
            pv = R.permute_dims(model_layers_0_self_attn_v_proj_weight, axes=[1, 0])
            mv = R.matmul(x, pv)
            v = R.add(model_layers_0_self_attn_v_proj_bias, mv)  # bias on the left
            pg = R.permute_dims(model_layers_0_mlp_gate_proj_weight, axes=[1, 0])
            g = R.matmul(x, pg)
            pu = R.permute_dims(model_layers_0_mlp_up_proj_weight, axes=[1, 0])
            u = R.matmul(x, pu)
            out = (q, k, v, g, u)
            R.output(out)
        return out


@I.ir_module
class Expected:
    @R.function
    def decode(x: R.Tensor((1, 1, 16), "float32"),
               model_layers_0_self_attn_qkv_proj_weight: R.Tensor((32, 16), "float32"),
               model_layers_0_self_attn_qkv_proj_bias: R.Tensor((32,), "float32"),
               model_layers_0_mlp_gate_up_proj_weight: R.Tensor((64, 16), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            pt = R.permute_dims(model_layers_0_self_attn_qkv_proj_weight, axes=[1, 0])
            y = R.matmul(x, pt)
            yb = R.add(y, model_layers_0_self_attn_qkv_proj_bias)
            q = R.strided_slice(yb, axes=[2], begin=[0], end=[16])
            k = R.strided_slice(yb, axes=[2], begin=[16], end=[24])
            v = R.strided_slice(yb, axes=[2], begin=[24], end=[32])
            pt2 = R.permute_dims(model_layers_0_mlp_gate_up_proj_weight, axes=[1, 0])
            y2 = R.matmul(x, pt2)
            g = R.strided_slice(y2, axes=[2], begin=[0], end=[32])
            u = R.strided_slice(y2, axes=[2], begin=[32], end=[64])
            out = (q, k, v, g, u)
            R.output(out)
        return out


def _weights() -> dict[str, np.ndarray]:
    shapes = {"self_attn_q_proj_weight": (16, 16), "self_attn_q_proj_bias": (16,),
              "self_attn_k_proj_weight": (8, 16), "self_attn_k_proj_bias": (8,),
              "self_attn_v_proj_weight": (8, 16), "self_attn_v_proj_bias": (8,),
              "mlp_gate_proj_weight": (32, 16), "mlp_up_proj_weight": (32, 16)}
    return {P + name: rand(*shape, seed=i) for i, (name, shape) in enumerate(shapes.items())}


def test_qkv_and_gate_up_become_one_matmul_each() -> None:
    w = _weights()
    after, weights = run_pass(merge_projections, Before, w)
    tvm.ir.assert_structural_equal(after, Expected)
    assert list(weights) == [P + "self_attn_qkv_proj_weight", P + "self_attn_qkv_proj_bias", P + "mlp_gate_up_proj_weight"]
    cat = np.concatenate
    np.testing.assert_array_equal(weights[P + "self_attn_qkv_proj_weight"],
                                  cat([w[P + f"self_attn_{m}_proj_weight"] for m in "qkv"]))
    np.testing.assert_array_equal(weights[P + "self_attn_qkv_proj_bias"],
                                  cat([w[P + f"self_attn_{m}_proj_bias"] for m in "qkv"]))
    np.testing.assert_array_equal(weights[P + "mlp_gate_up_proj_weight"],
                                  cat([w[P + "mlp_gate_proj_weight"], w[P + "mlp_up_proj_weight"]]))


@I.ir_module
class Incomplete:
    """No v projection and no up projection: no complete group, nothing merges."""

    @R.function
    def decode(x: R.Tensor((1, 1, 16), "float32"),
               model_layers_0_self_attn_q_proj_weight: R.Tensor((16, 16), "float32"),
               model_layers_0_self_attn_k_proj_weight: R.Tensor((8, 16), "float32"),
               model_layers_0_mlp_gate_proj_weight: R.Tensor((32, 16), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            pq = R.permute_dims(model_layers_0_self_attn_q_proj_weight, axes=[1, 0])
            q = R.matmul(x, pq)
            pk = R.permute_dims(model_layers_0_self_attn_k_proj_weight, axes=[1, 0])
            k = R.matmul(x, pk)
            pg = R.permute_dims(model_layers_0_mlp_gate_proj_weight, axes=[1, 0])
            g = R.matmul(x, pg)
            out = (q, k, g)
            R.output(out)
        return out


def test_incomplete_groups_are_left_alone() -> None:
    w = _weights()
    names = [P + "self_attn_q_proj_weight", P + "self_attn_k_proj_weight", P + "mlp_gate_proj_weight"]
    assert_unchanged(merge_projections, Incomplete, {n: w[n] for n in names})


@I.ir_module(check_well_formed=False)
class Attention:
    """Q/K/V read only by the attention kernel (2 heads of 8, one KV head, 16 cache rows)."""

    @T.prim_func(private=True)
    def cached_attention_2_1_8_16_float32():
        T.evaluate(0)

    @R.function
    def prefill(x: R.Tensor((1, "seq", 16), "float32"), kc: R.Tensor((1, 1, 16, 8), "float32"),
                vc: R.Tensor((1, 1, 16, 8), "float32"), past: R.Tensor((1,), "int64"),
                cos: R.Tensor((16, 4), "float32"), sin: R.Tensor((16, 4), "float32"),
                model_layers_0_self_attn_q_proj_weight: R.Tensor((16, 16), "float32"),
                model_layers_0_self_attn_k_proj_weight: R.Tensor((8, 16), "float32"),
                model_layers_0_self_attn_v_proj_weight: R.Tensor((8, 16), "float32")):
        R.func_attr({"num_input": 6})
        seq = T.int64()
        cls = Attention
        with R.dataflow():
            pq = R.permute_dims(model_layers_0_self_attn_q_proj_weight, axes=[1, 0])
            q = R.matmul(x, pq)
            pk = R.permute_dims(model_layers_0_self_attn_k_proj_weight, axes=[1, 0])
            k = R.matmul(x, pk)
            pv = R.permute_dims(model_layers_0_self_attn_v_proj_weight, axes=[1, 0])
            v = R.matmul(x, pv)
            a = R.call_tir_inplace(cls.cached_attention_2_1_8_16_float32, (q, k, v, kc, vc, past, cos, sin), [-1, 3, 4],
                                   [R.Tensor((1, seq, 16), "float32"), R.Tensor((1, 1, 16, 8), "float32"),
                                    R.Tensor((1, 1, 16, 8), "float32")])
            o = a[0]
            R.output(o)
        return o


@I.ir_module(check_well_formed=False)
class AttentionMerged:
    @T.prim_func(private=True)
    def cached_attention_2_1_8_16_float32_qkv():
        T.evaluate(0)

    @R.function
    def prefill(x: R.Tensor((1, "seq", 16), "float32"), kc: R.Tensor((1, 1, 16, 8), "float32"),
                vc: R.Tensor((1, 1, 16, 8), "float32"), past: R.Tensor((1,), "int64"),
                cos: R.Tensor((16, 4), "float32"), sin: R.Tensor((16, 4), "float32"),
                model_layers_0_self_attn_qkv_proj_weight: R.Tensor((32, 16), "float32")):
        R.func_attr({"num_input": 6})
        seq = T.int64()
        cls = AttentionMerged
        with R.dataflow():
            pt = R.permute_dims(model_layers_0_self_attn_qkv_proj_weight, axes=[1, 0])
            y = R.matmul(x, pt)
            a = R.call_tir_inplace(cls.cached_attention_2_1_8_16_float32_qkv, (y, kc, vc, past, cos, sin), [-1, 1, 2],
                                   [R.Tensor((1, seq, 16), "float32"), R.Tensor((1, 1, 16, 8), "float32"),
                                    R.Tensor((1, 1, 16, 8), "float32")])
            o = a[0]
            R.output(o)
        return o


def test_attention_reads_the_merged_qkv_in_place() -> None:
    attention = attention_prefill_kernel(2, 1, 8, 16)  # as the import names and emits it
    w = {n: v for n, v in _weights().items() if "self_attn" in n and n.endswith("weight")}
    after, weights = run_pass(merge_projections, with_kernels(Attention, cached_attention_2_1_8_16_float32=attention), w)
    expected = with_kernels(AttentionMerged,
                            cached_attention_2_1_8_16_float32_qkv=opaque(attention_over_qkv(attention)))
    tvm.ir.assert_structural_equal(after, expected)
    assert list(weights) == [P + "self_attn_qkv_proj_weight"]
