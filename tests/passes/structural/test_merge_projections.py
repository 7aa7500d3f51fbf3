"""merge_projections: the Q/K/V linears of one input become one matmul over the concatenated weight (and
bias), gate/up another; the members are ``strided_slice`` views of the merged result (no attention kernel
here to read Q/K/V in place). The weight table changes with the signature: ``qkv_proj`` at q's position,
``gate_up_proj`` at gate's."""

from __future__ import annotations

import numpy as np
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from perfx_compiler.passes import merge_projections

from ._util import assert_unchanged, rand, run_pass

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
