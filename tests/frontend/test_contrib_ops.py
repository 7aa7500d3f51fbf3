"""com.microsoft contrib-op converters (MatMulNBits, GroupQueryAttention, RotaryEmbedding,
SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization) each vs onnxruntime on a minimal
graph, and MatMulNBits dequantization in numpy vs onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as onh
from tvm import relax

from perfx_compiler.frontend.contrib_ops import CONTRIB_CONVERTERS, dequantize_matmulnbits
from perfx_compiler.frontend.onnx_import import import_onnx

ort = pytest.importorskip("onnxruntime")
MS = "com.microsoft"


def model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    g = oh.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid(MS, 1)])
    m.ir_version = 8
    return m


def vi(name: str, dtype: int, shape: list) -> onnx.ValueInfoProto:
    return oh.make_tensor_value_info(name, dtype, shape)


def run_both(m: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, feeds)
    mod = import_onnx(m, keep_params_in_input=True, extra_converters=CONTRIB_CONVERTERS)
    main = mod["main"]
    params = [p.numpy() for p in main.attrs["params"]] if "params" in (main.attrs or {}) else []
    vm = relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target({"kind": "llvm"})), tvm.cpu())
    names = [i.name for i in m.graph.input]
    out = vm["main"](*[tvm.runtime.tensor(feeds[n]) for n in names], *[tvm.runtime.tensor(p) for p in params])
    got = [out.numpy()] if hasattr(out, "numpy") else [o.numpy() for o in out]
    return got, want


def close(a: np.ndarray, b: np.ndarray, tol: float = 1e-4) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    assert np.abs(a - b).max() <= tol * max(1.0, np.abs(b).max()), np.abs(a - b).max()


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    per = 8 // bits
    c = codes.reshape(*codes.shape[:-1], -1, per).astype(np.uint8)
    return sum((c[..., j] << (bits * j)) for j in range(per)).astype(np.uint8)


@pytest.mark.parametrize("k,bits,zero_points", [(64, 4, None), (40, 4, "uint8"), (64, 8, "uint8"), (64, 4, "float")])
def test_matmulnbits(k, bits, zero_points):
    rng = np.random.default_rng(k + bits)
    n, block = 24, 32
    nb = -(-k // block)
    codes = rng.integers(0, 1 << bits, (n, nb, block))
    b = pack(codes, bits)
    scales = rng.uniform(0.01, 0.1, (n, nb)).astype(np.float32)
    inits = [onh.from_array(b, "B"), onh.from_array(scales, "S")]
    ins = ["A", "B", "S"]
    if zero_points == "uint8":
        zc = rng.integers(0, 1 << bits, (n, -(-nb // (8 // bits)) * (8 // bits)))
        inits.append(onh.from_array(pack(zc, bits), "Z"))
        ins.append("Z")
    elif zero_points == "float":
        inits.append(onh.from_array(rng.uniform(6, 9, (n, nb)).astype(np.float32), "Z"))
        ins.append("Z")
    node = oh.make_node("MatMulNBits", ins, ["Y"], domain=MS, K=k, N=n, bits=bits, block_size=block, accuracy_level=1)
    m = model([node], [vi("A", TP.FLOAT, [3, k])], [vi("Y", TP.FLOAT, [3, n])], inits)
    a = rng.standard_normal((3, k)).astype(np.float32)
    got, want = run_both(m, {"A": a})
    close(got[0], want[0])
    consts = {t.name: onh.to_array(t) for t in m.graph.initializer}
    w = dequantize_matmulnbits(node, consts.get)
    close(a @ w.T, want[0], 1e-5)  # the dequantized matrix is what onnxruntime multiplies by


def test_simplified_layer_norms():
    rng = np.random.default_rng(0)
    x, s = rng.standard_normal((1, 5, 32)).astype(np.float32), rng.standard_normal((1, 5, 32)).astype(np.float32)
    w = onh.from_array(rng.standard_normal(32).astype(np.float32), "W")
    nodes = [
        oh.make_node("SimplifiedLayerNormalization", ["X", "W"], ["Y0"], axis=-1, epsilon=1e-5),
        oh.make_node("SkipSimplifiedLayerNormalization", ["X", "S", "W"], ["Y1", "", "", "SUM"], domain=MS, epsilon=1e-6),
    ]
    m = model(nodes, [vi("X", TP.FLOAT, [1, 5, 32]), vi("S", TP.FLOAT, [1, 5, 32])],
              [vi("Y0", TP.FLOAT, [1, 5, 32]), vi("Y1", TP.FLOAT, [1, 5, 32]), vi("SUM", TP.FLOAT, [1, 5, 32])], [w])
    got, want = run_both(m, {"X": x, "S": s})
    for g, t in zip(got, want, strict=True):
        close(g, t)


@pytest.mark.parametrize("interleaved", [0, 1])
def test_rotary_embedding(interleaved):
    rng = np.random.default_rng(interleaved)
    heads, d, s = 2, 8, 5
    ang = np.arange(32)[:, None] * (10000.0 ** (-np.arange(0, d, 2) / d))[None]
    inits = [onh.from_array(np.cos(ang).astype(np.float32), "C"), onh.from_array(np.sin(ang).astype(np.float32), "Sn")]
    node = oh.make_node("RotaryEmbedding", ["X", "P", "C", "Sn"], ["Y"], domain=MS, interleaved=interleaved,
                        num_heads=heads)
    m = model([node], [vi("X", TP.FLOAT, [1, s, heads * d]), vi("P", TP.INT64, [1, s])],
              [vi("Y", TP.FLOAT, [1, s, heads * d])], inits)
    feeds = {"X": rng.standard_normal((1, s, heads * d)).astype(np.float32),
             "P": np.arange(3, 3 + s, dtype=np.int64).reshape(1, s)}
    got, want = run_both(m, feeds)
    close(got[0], want[0])


@pytest.mark.parametrize("past,seq,interleaved", [(0, 4, 0), (3, 2, 0), (6, 1, 1)])
def test_group_query_attention(past, seq, interleaved):
    rng = np.random.default_rng(past * 10 + seq)
    heads, kvh, d = 4, 2, 16
    ang = np.arange(32)[:, None] * (10000.0 ** (-np.arange(0, d, 2) / d))[None]
    inits = [onh.from_array(np.cos(ang).astype(np.float32), "C"), onh.from_array(np.sin(ang).astype(np.float32), "Sn")]
    width = (heads + 2 * kvh) * d
    node = oh.make_node(
        "GroupQueryAttention", ["Q", "", "", "PK", "PV", "SL", "TL", "C", "Sn"], ["O", "K", "V"], domain=MS,
        num_heads=heads, kv_num_heads=kvh, do_rotary=1, rotary_interleaved=interleaved, scale=0.0,
    )
    total = past + seq
    m = model(
        [node],
        [vi("Q", TP.FLOAT, [1, seq, width]), vi("PK", TP.FLOAT, [1, kvh, past, d]), vi("PV", TP.FLOAT, [1, kvh, past, d]),
         vi("SL", TP.INT32, [1]), vi("TL", TP.INT32, [])],
        [vi("O", TP.FLOAT, [1, seq, heads * d]), vi("K", TP.FLOAT, [1, kvh, total, d]), vi("V", TP.FLOAT, [1, kvh, total, d])],
        inits,
    )
    feeds = {
        "Q": rng.standard_normal((1, seq, width)).astype(np.float32),
        "PK": rng.standard_normal((1, kvh, past, d)).astype(np.float32),
        "PV": rng.standard_normal((1, kvh, past, d)).astype(np.float32),
        "SL": np.array([total - 1], np.int32), "TL": np.array(total, np.int32),
    }
    got, want = run_both(m, feeds)
    for g, t in zip(got, want, strict=True):
        close(g, t)


@pytest.mark.parametrize("past,seq,causal,with_bias", [(0, 4, 1, 0), (3, 2, 0, 1), (5, 1, 1, 1)])
def test_multi_head_attention(past, seq, causal, with_bias):
    rng = np.random.default_rng(past * 10 + seq)
    heads, d = 4, 8
    total = past + seq
    ins = ["Q", "K", "V", "", "", "AB" if with_bias else "", "PK", "PV"]
    node = oh.make_node("MultiHeadAttention", ins, ["O", "PKo", "PVo"], domain=MS, num_heads=heads,
                        unidirectional=causal, scale=0.3)
    inputs = [vi("Q", TP.FLOAT, [1, seq, heads * d]), vi("K", TP.FLOAT, [1, seq, heads * d]),
              vi("V", TP.FLOAT, [1, seq, heads * d]), vi("PK", TP.FLOAT, [1, heads, past, d]),
              vi("PV", TP.FLOAT, [1, heads, past, d])]
    feeds = {n: rng.standard_normal((1, seq, heads * d)).astype(np.float32) for n in "QKV"}
    feeds |= {n: rng.standard_normal((1, heads, past, d)).astype(np.float32) for n in ("PK", "PV")}
    if with_bias:
        inputs.append(vi("AB", TP.FLOAT, [1, heads, seq, total]))
        feeds["AB"] = rng.standard_normal((1, heads, seq, total)).astype(np.float32)
    m = model([node], inputs, [vi("O", TP.FLOAT, [1, seq, heads * d]), vi("PKo", TP.FLOAT, [1, heads, total, d]),
                               vi("PVo", TP.FLOAT, [1, heads, total, d])])
    got, want = run_both(m, feeds)
    for g, t in zip(got, want, strict=True):
        close(g, t)
