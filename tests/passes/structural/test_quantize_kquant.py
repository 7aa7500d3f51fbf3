"""quantize_kquant (``q4_k``, int8 activations): a linear whose K is whole 256-superblocks becomes Q4_K
blocks in the VNNI layout (``<W>_q4`` row pairs, ``_q4_scale`` / ``_q4_min``: int8 sub-scales / mins with
the superblock's float16 d / dmin bytes after them); decode's and prefill's linears each one
``formats.vnni.vnni_compute`` call (``sb`` 256). The kernels are compared by identity to their generator,
the Relax functions as written here, the arrays to ``subscaled_vnni_packed`` of llama.cpp's quantizer port."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from perfx_compiler.formats import ggml
from perfx_compiler.formats.ggml import q4_k, q6_k
from perfx_compiler.formats.superblocks import subscaled_packed
from perfx_compiler.formats.vnni import subscaled_vnni_packed, vnni_compute
from perfx_compiler.passes import quantize_kquant
from perfx_compiler.passes._quantized_linears import use_activations

from ._util import context, opaque, rand, run_pass, with_kernels


@I.ir_module
class Before:
    @R.function
    def decode(x: R.Tensor((1, 1, 256), "float32"), w: R.Tensor((16, 256), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            pt = R.permute_dims(w, axes=[1, 0])
            y = R.matmul(x, pt)
            R.output(y)
        return y

    @R.function
    def prefill(x: R.Tensor((1, "seq", 256), "float32"), w: R.Tensor((16, 256), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            pt = R.permute_dims(w, axes=[1, 0])
            y = R.matmul(x, pt)
            R.output(y)
        return y


@I.ir_module(check_well_formed=False)
class Expected:
    @T.prim_func(private=True)
    def q4_matmul_16_256_q4kv_1x1():
        T.evaluate(0)

    @T.prim_func(private=True)
    def q4_matmul_16_256_q4kv_1xn():
        T.evaluate(0)

    @R.function
    def decode(x: R.Tensor((1, 1, 256), "float32"), w_q4: R.Tensor((8, 256), "uint8"),
               w_q4_scale: R.Tensor((16, 18), "int8"), w_q4_min: R.Tensor((16, 18), "int8")):
        R.func_attr({"num_input": 1})
        cls = Expected
        with R.dataflow():
            y = R.call_tir(cls.q4_matmul_16_256_q4kv_1x1, (x, w_q4, w_q4_scale, w_q4_min),
                           out_ty=R.Tensor((1, 1, 16), "float32"))
            R.output(y)
        return y

    @R.function
    def prefill(x: R.Tensor((1, "seq", 256), "float32"), w_q4: R.Tensor((8, 256), "uint8"),
                w_q4_scale: R.Tensor((16, 18), "int8"), w_q4_min: R.Tensor((16, 18), "int8")):
        R.func_attr({"num_input": 1})
        seq = T.int64()
        cls = Expected
        with R.dataflow():
            y = R.call_tir(cls.q4_matmul_16_256_q4kv_1xn, (x, w_q4, w_q4_scale, w_q4_min),
                           out_ty=R.Tensor((1, seq, 16), "float32"))
            R.output(y)
        return y


WEIGHTS = {"w": rand(16, 256)}


def test_linears_read_q4_k_blocks() -> None:
    with use_activations("int8"):
        after, weights = run_pass(quantize_kquant, Before, WEIGHTS, context(quantization="q4_k"))
    expected = with_kernels(
        Expected,
        q4_matmul_16_256_q4kv_1x1=opaque(vnni_compute(16, 256, 32, 4, False, True, "matmul", (1, 1), sb=256)),
        q4_matmul_16_256_q4kv_1xn=opaque(vnni_compute(16, 256, 32, 4, False, True, "matmul", (1, None), sb=256)),
    )
    tvm.ir.assert_structural_equal(after, expected)
    w = np.asarray(WEIGHTS["w"], dtype=np.float32)
    want = subscaled_vnni_packed(ggml.unpack("Q4_K", q4_k.quantize(w), w.shape), "Q4_K")
    assert list(weights) == ["w_q4", "w_q4_scale", "w_q4_min"]
    for suffix, arr in want.arrays:
        np.testing.assert_array_equal(weights[f"w{suffix}"], arr)


@pytest.mark.parametrize("quantization,activations,suffixes", [
    ("q4_k", "f32", ["_q4", "_q4_scale", "_q4_min"]),  # int4 interleaved codes (formats/superblocks.py)
    ("q6_k", "f32", ["_q8", "_q8_scale"]),  # int8 codes
    ("q6_k", "int8", ["_q6", "_q6_scale"]),  # 6-bit row quads (formats/vnni.py)
])
def test_arrays_are_the_quantizer_blocks(quantization: str, activations: str, suffixes: list[str]) -> None:
    """Each layout's arrays equal the packing of llama.cpp's quantizer port's blocks (the blocks themselves
    are compared with llama.cpp's in tests/formats/test_ggml_quantize.py), and every linear reads them."""
    qtype = quantization.upper()
    with use_activations(activations):
        after, weights = run_pass(quantize_kquant, Before, WEIGHTS, context(quantization=quantization))
    w = np.asarray(WEIGHTS["w"], dtype=np.float32)
    sub = ggml.unpack(qtype, {"Q4_K": q4_k, "Q6_K": q6_k}[qtype].quantize(w), w.shape)
    want = subscaled_vnni_packed(sub, qtype) if activations == "int8" else subscaled_packed(sub, qtype)
    assert list(weights) == [f"w{s}" for s in suffixes] == [f"w{s}" for s, _ in want.arrays]
    for suffix, arr in want.arrays:
        np.testing.assert_array_equal(weights[f"w{suffix}"], arr)
    for name in ("decode", "prefill"):
        params = [p.name for p in after[name].params]
        assert params == ["x", *[f"w{s}" for s in suffixes]], params
    kernels = sorted(gv.name_hint for gv, f in after.functions.items() if isinstance(f, tvm.tirx.PrimFunc))
    assert kernels and all(f"{qtype.lower().replace('_', '')}" in k for k in kernels), kernels
