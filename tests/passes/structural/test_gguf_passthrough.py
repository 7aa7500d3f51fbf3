"""gguf_passthrough (quantization ``gguf``): linears read the GGUF file's Q4_0 / Q8_0 blocks as they are
(repacked for the kernels, never requantized); a merged projection (qkv) takes its members' blocks
concatenated by rows; a weight without blocks stays float.

The kernels are compared by identity to their generators (``formats.int4.int4_matmul_compute`` symmetric g32 for
Q4_0, ``formats.int8.int8_matmul_compute`` g32 for Q8_0), the Relax function as written here, and the packed
arrays to the codes and scales the blocks were written from (built here byte by byte). Under int8
activations (the pipeline's default on AVX-512 VNNI CPUs) the blocks go straight to the VNNI layout
(``_qvnni``: row pairs in nibbles, codes + 128, groups padded to 16) and the GEMVs are ``vnni_compute``'s.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from perfx_compiler.errors import PerfXError
from perfx_compiler.formats.int4 import int4_matmul_compute, pack_int4
from perfx_compiler.formats.int8 import int8_matmul_compute
from perfx_compiler.formats.vnni import vnni_compute
from perfx_compiler.passes import gguf_passthrough
from perfx_compiler.passes._quantized_linears import use_activations

from ._util import assert_unchanged, context, opaque, rand, run_pass, with_kernels

QKV = "model_layers_0_self_attn_qkv_proj_weight"
DOWN = "model_layers_0_mlp_down_proj_weight"


def q4_0_blocks(codes: np.ndarray, d: np.ndarray) -> np.ndarray:
    """ggml Q4_0: per 32 weights, d (f16) then 16 bytes; byte j holds weight j (low nibble) and j + 16."""
    n, k = codes.shape
    c = codes.reshape(n, k // 32, 32).astype(np.uint8)
    qs = c[:, :, :16] | (c[:, :, 16:] << 4)
    return np.concatenate([d.astype(np.float16).reshape(n, -1, 1).view(np.uint8), qs], axis=2).reshape(n, -1)


def q8_0_blocks(codes: np.ndarray, d: np.ndarray) -> np.ndarray:
    """ggml Q8_0: per 32 weights, d (f16) then 32 int8."""
    n, k = codes.shape
    q = codes.astype(np.int8).reshape(n, k // 32, 32).view(np.uint8)
    return np.concatenate([d.astype(np.float16).reshape(n, -1, 1).view(np.uint8), q], axis=2).reshape(n, -1)


def _model() -> tuple[SimpleNamespace, dict[str, np.ndarray], dict[str, tuple[np.ndarray, np.ndarray]]]:
    """GGUF-style blocks for q/k/v (Q4_0) and down (Q8_0), the float weights they decode to, and the
    (codes, scales) they were written from."""
    rng = np.random.default_rng(0)
    quantized, parts = {}, {}
    for name, n in (("q_proj", 8), ("k_proj", 4), ("v_proj", 4)):
        codes = rng.integers(0, 16, size=(n, 32)).astype(np.uint8)
        d = (0.01 + 0.1 * rng.random((n, 1))).astype(np.float16)
        quantized[f"model.layers.0.self_attn.{name}.weight"] = ("Q4_0", q4_0_blocks(codes, d), (n, 32))
        parts[name] = (codes, d)
    codes8 = rng.integers(-127, 128, size=(16, 64)).astype(np.int8)
    d8 = (0.01 + 0.1 * rng.random((16, 2))).astype(np.float16)
    quantized["model.layers.0.mlp.down_proj.weight"] = ("Q8_0", q8_0_blocks(codes8, d8), (16, 64))
    cat = np.concatenate
    codes4 = cat([parts[m][0] for m in ("q_proj", "k_proj", "v_proj")])
    d4 = cat([parts[m][1] for m in ("q_proj", "k_proj", "v_proj")])
    weights = {
        QKV: ((codes4.astype(np.float32) - 8) * d4.astype(np.float32)),
        DOWN: codes8.astype(np.float32) * np.repeat(d8.astype(np.float32), 32, axis=1),
        "other_weight": rand(16, 16),
    }
    return SimpleNamespace(quantized=quantized), weights, {QKV: (codes4, d4), DOWN: (codes8, d8)}


@I.ir_module
class Before:
    @R.function
    def decode(x: R.Tensor((1, 1, 32), "float32"), h: R.Tensor((1, 1, 64), "float32"), z: R.Tensor((1, 1, 16), "float32"),
               model_layers_0_self_attn_qkv_proj_weight: R.Tensor((16, 32), "float32"),
               model_layers_0_mlp_down_proj_weight: R.Tensor((16, 64), "float32"),
               other_weight: R.Tensor((16, 16), "float32")):
        R.func_attr({"num_input": 3})
        with R.dataflow():
            p1 = R.permute_dims(model_layers_0_self_attn_qkv_proj_weight, axes=[1, 0])
            qkv = R.matmul(x, p1)
            p2 = R.permute_dims(model_layers_0_mlp_down_proj_weight, axes=[1, 0])
            down = R.matmul(h, p2)
            p3 = R.permute_dims(other_weight, axes=[1, 0])
            other = R.matmul(z, p3)
            out = (qkv, down, other)
            R.output(out)
        return out


@I.ir_module(check_well_formed=False)
class Expected:
    @T.prim_func(private=True)
    def q4_matmul_16_32_g32s_1x1():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q8_matmul_16_64_g32_1x1():
        T.evaluate(0)

    @R.function
    def decode(x: R.Tensor((1, 1, 32), "float32"), h: R.Tensor((1, 1, 64), "float32"), z: R.Tensor((1, 1, 16), "float32"),
               model_layers_0_self_attn_qkv_proj_weight_q4: R.Tensor((16, 4), "uint32"),
               model_layers_0_self_attn_qkv_proj_weight_q4_scale: R.Tensor((16, 1), "float16"),
               model_layers_0_mlp_down_proj_weight_q8: R.Tensor((16, 64), "int8"),
               model_layers_0_mlp_down_proj_weight_q8_scale: R.Tensor((16, 2), "float16"),
               other_weight: R.Tensor((16, 16), "float32")):
        R.func_attr({"num_input": 3})
        cls = Expected
        with R.dataflow():
            qkv = R.call_tir(cls.q4_matmul_16_32_g32s_1x1,
                             (x, model_layers_0_self_attn_qkv_proj_weight_q4, model_layers_0_self_attn_qkv_proj_weight_q4_scale),
                             out_ty=R.Tensor((1, 1, 16), "float32"))
            down = R.call_tir(cls.q8_matmul_16_64_g32_1x1,
                              (h, model_layers_0_mlp_down_proj_weight_q8, model_layers_0_mlp_down_proj_weight_q8_scale),
                              out_ty=R.Tensor((1, 1, 16), "float32"))
            p3 = R.permute_dims(other_weight, axes=[1, 0])
            other = R.matmul(z, p3)
            out = (qkv, down, other)
            R.output(out)
        return out


def test_linears_read_the_gguf_blocks() -> None:
    desc, weights, parts = _model()
    after, new = run_pass(gguf_passthrough, Before, weights, context(quantization="gguf", desc=desc))
    expected = with_kernels(
        Expected,
        q4_matmul_16_32_g32s_1x1=opaque(int4_matmul_compute(16, 32, 32, 4, True, kind="matmul", rows=(1, 1))),
        q8_matmul_16_64_g32_1x1=opaque(int8_matmul_compute(16, 64, 32, kind="matmul", rows=(1, 1))),
    )
    tvm.ir.assert_structural_equal(after, expected)
    # Q4_0 is symmetric: zero point 8 in the kernels, no zero array
    assert list(new) == [QKV + "_q4", QKV + "_q4_scale", DOWN + "_q8", DOWN + "_q8_scale", "other_weight"]
    codes4, d4 = parts[QKV]
    np.testing.assert_array_equal(new[QKV + "_q4"], pack_int4(codes4, 4))
    np.testing.assert_array_equal(new[QKV + "_q4_scale"].view(np.uint16), d4.view(np.uint16))  # bit for bit
    codes8, d8 = parts[DOWN]
    np.testing.assert_array_equal(new[DOWN + "_q8"], codes8)
    np.testing.assert_array_equal(new[DOWN + "_q8_scale"].view(np.uint16), d8.view(np.uint16))
    assert new["other_weight"] is weights["other_weight"]


@I.ir_module
class NoLinear:
    """The block-backed weights are read by other ops only: nothing to pass through."""

    @R.function
    def decode(x: R.Tensor((1, 1, 32), "float32"), h: R.Tensor((1, 1, 64), "float32"), z: R.Tensor((1, 1, 16), "float32"),
               model_layers_0_self_attn_qkv_proj_weight: R.Tensor((16, 32), "float32"),
               model_layers_0_mlp_down_proj_weight: R.Tensor((16, 64), "float32"),
               other_weight: R.Tensor((16, 16), "float32")):
        R.func_attr({"num_input": 3})
        with R.dataflow():
            a = R.add(model_layers_0_self_attn_qkv_proj_weight, model_layers_0_self_attn_qkv_proj_weight)
            b = R.matmul(z, model_layers_0_mlp_down_proj_weight)
            out = (a, b)
            R.output(out)
        return out


def test_weights_no_linear_reads_stay_float() -> None:
    desc, weights, _ = _model()
    assert_unchanged(gguf_passthrough, NoLinear, weights, context(quantization="gguf", desc=desc))


def test_blocks_that_do_not_match_the_graph_are_refused() -> None:
    desc, weights, _ = _model()
    weights[DOWN] = weights[DOWN] + 1e-3
    with pytest.raises(PerfXError, match="do not reproduce"):
        gguf_passthrough.apply(Before, weights, context(quantization="gguf", desc=desc))


@I.ir_module(check_well_formed=False)
class ExpectedVnni:
    @T.prim_func(private=True)
    def q4_matmul_16_32_g32sv_1x1():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q8_matmul_16_64_g32v_1x1():
        T.evaluate(0)

    @R.function
    def decode(x: R.Tensor((1, 1, 32), "float32"), h: R.Tensor((1, 1, 64), "float32"), z: R.Tensor((1, 1, 16), "float32"),
               model_layers_0_self_attn_qkv_proj_weight_q4: R.Tensor((8, 64), "uint8"),
               model_layers_0_self_attn_qkv_proj_weight_q4_scale: R.Tensor((16, 16), "float16"),
               model_layers_0_mlp_down_proj_weight_q8: R.Tensor((16, 64), "uint8"),
               model_layers_0_mlp_down_proj_weight_q8_scale: R.Tensor((16, 16), "float16"),
               other_weight: R.Tensor((16, 16), "float32")):
        R.func_attr({"num_input": 3})
        cls = ExpectedVnni
        with R.dataflow():
            qkv = R.call_tir(cls.q4_matmul_16_32_g32sv_1x1,
                             (x, model_layers_0_self_attn_qkv_proj_weight_q4, model_layers_0_self_attn_qkv_proj_weight_q4_scale),
                             out_ty=R.Tensor((1, 1, 16), "float32"))
            down = R.call_tir(cls.q8_matmul_16_64_g32v_1x1,
                              (h, model_layers_0_mlp_down_proj_weight_q8, model_layers_0_mlp_down_proj_weight_q8_scale),
                              out_ty=R.Tensor((1, 1, 16), "float32"))
            p3 = R.permute_dims(other_weight, axes=[1, 0])
            other = R.matmul(z, p3)
            out = (qkv, down, other)
            R.output(out)
        return out


def test_int8_activations_read_the_blocks_in_the_vnni_layout() -> None:
    desc, weights, parts = _model()
    with use_activations("int8"):
        after, new = run_pass(gguf_passthrough, Before, weights, context(quantization="gguf", desc=desc))
    expected = with_kernels(
        ExpectedVnni,
        q4_matmul_16_32_g32sv_1x1=opaque(vnni_compute(16, 32, 32, 4, True, False, "matmul", (1, 1))),
        q8_matmul_16_64_g32v_1x1=opaque(vnni_compute(16, 64, 32, 8, True, False, "matmul", (1, 1))),
    )
    tvm.ir.assert_structural_equal(after, expected)
    codes4, d4 = parts[QKV]  # the VNNI layouts as _qvnni documents them, K padded to 64, groups to 16
    pairs = np.zeros((8, 64), np.uint8)
    pairs[:, :32] = codes4[0::2] | (codes4[1::2] << 4)  # rows 2p (low nibble) and 2p + 1 (high)
    np.testing.assert_array_equal(new[QKV + "_q4"], pairs)
    np.testing.assert_array_equal(new[QKV + "_q4_scale"], np.pad(d4, ((0, 0), (0, 15))))
    assert QKV + "_q4_zero" not in new  # symmetric: no zero array
    codes8, d8 = parts[DOWN]
    np.testing.assert_array_equal(new[DOWN + "_q8"], (codes8.astype(np.int16) + 128).astype(np.uint8))
    np.testing.assert_array_equal(new[DOWN + "_q8_scale"], np.pad(d8, ((0, 0), (0, 14))))
