"""onnxruntime-genai-format decoder graphs built with onnx.helper from random weights, the way the
genai builder lays them out: Gather embedding, (Skip)SimplifiedLayerNormalization, int4
``MatMulNBits`` linears holding real round-to-nearest codes of random weights, GroupQueryAttention
with RoPE inside (cos/sin caches), SiLU-gated MLP, ``genai_config.json`` next to the file.

Knobs the builder does not expose: block size, zero points, a (trivial) ``g_idx`` input,
``accuracy_level``, packed or separate Q/K/V, rotary interleaving.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as onh

from perfx_compiler.model.description import ModelDescription

MS = "com.microsoft"


@dataclass(frozen=True)
class GenaiSpec:
    block: int = 32
    zero_points: bool = False
    g_idx: bool = False
    accuracy_level: int = 1
    packed_qkv: bool = True
    interleaved: bool = False
    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 256
    vocab: int = 300
    context: int = 256
    theta: float = 10000.0
    seed: int = 0


def quantize_rtn(w: np.ndarray, block: int, zero_points: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Round-to-nearest int4 codes uint8 [N, nb*block] (last block zero-padded), float32 scales
    [N, nb] and uint8 zero points [N, nb] (None: symmetric, zero 8)."""
    n, k = w.shape
    nb = -(-k // block)
    wp = np.zeros((n, nb * block), np.float64)
    wp[:, :k] = w
    g = wp.reshape(n, nb, block)
    if zero_points:
        lo, hi = np.minimum(g.min(axis=2), 0), np.maximum(g.max(axis=2), 0)
        scale = ((hi - lo) / 15).astype(np.float32)
        s = np.where(scale == 0, 1, scale).astype(np.float64)
        zero = np.clip(np.rint(-lo / s), 0, 15).astype(np.uint8)
        codes = np.clip(np.rint(g / s[..., None]) + zero[..., None], 0, 15)
    else:
        scale = (np.abs(g).max(axis=2) / 7).astype(np.float32)
        s = np.where(scale == 0, 1, scale).astype(np.float64)
        zero = None
        codes = np.clip(np.rint(g / s[..., None]) + 8, 0, 15)
    return codes.reshape(n, nb * block).astype(np.uint8), scale, zero


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 codes [..., 2m] -> bytes [..., m], lower nibble first (onnxruntime's order)."""
    c = codes.reshape(*codes.shape[:-1], -1, 2).astype(np.uint8)
    return (c[..., 0] | (c[..., 1] << 4)).astype(np.uint8)


class _Builder:
    def __init__(self, spec: GenaiSpec) -> None:
        self.spec = spec
        self.rng = np.random.default_rng(spec.seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        # name -> (codes [N, K], scales, zeros | None): what each MatMulNBits holds, for checks
        self.tables: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]] = {}

    def init(self, name: str, arr: np.ndarray) -> str:
        self.inits.append(onh.from_array(arr, name))
        return name

    def node(self, op: str, ins: list[str], outs: list[str], domain: str = "", **attrs) -> None:
        self.nodes.append(oh.make_node(op, ins, outs, name=f"/{op}_{len(self.nodes)}", domain=domain, **attrs))

    def matmul_nbits(self, name: str, x: str, n: int, k: int) -> str:
        s = self.spec
        w = self.rng.standard_normal((n, k)) / np.sqrt(k)
        codes, scale, zero = quantize_rtn(w, s.block, s.zero_points)
        nb = codes.shape[1] // s.block
        self.tables[name] = (codes[:, :k], scale, zero)
        ins = [x, self.init(f"{name}.weight_Q4", pack_nibbles(codes).reshape(n, nb, s.block // 2)),
               self.init(f"{name}.weight_scales", scale.reshape(-1))]
        if zero is not None:
            zpad = np.zeros((n, nb + nb % 2), np.uint8)
            zpad[:, :nb] = zero
            ins.append(self.init(f"{name}.weight_zp", pack_nibbles(zpad).reshape(-1)))
        if s.g_idx:
            ins += [""] * (3 - len(ins) + 1)
            ins.append(self.init(f"{name}.g_idx", (np.arange(k) // s.block).astype(np.int32)))
        out = f"/{name}/output_0"
        self.node("MatMulNBits", ins, [out], MS, K=k, N=n, bits=4, block_size=s.block,
                  accuracy_level=s.accuracy_level)
        return out


def build_genai_model(folder: Path, spec: GenaiSpec) -> tuple[Path, dict]:
    """Write ``folder/model.onnx`` + ``genai_config.json``; returns (path, MatMulNBits tables by name)."""
    s = spec
    b = _Builder(s)
    d = s.hidden // s.heads
    emb = b.init("model.embed_tokens.weight", (b.rng.standard_normal((s.vocab, s.hidden))).astype(np.float32))
    b.node("Gather", [emb, "input_ids"], ["/embed/output_0"])
    # seqlens_k = sum(mask) - 1, total_sequence_length = mask length (both int32), as the builder writes them
    b.node("ReduceSum", ["attention_mask", b.init("/one_axis", np.array([1], np.int64))], ["/mask_sum"], keepdims=0)
    b.node("Sub", ["/mask_sum", b.init("/one", np.array(1, np.int64))], ["/mask_sub"])
    b.node("Cast", ["/mask_sub"], ["seqlens_k"], to=TP.INT32)
    b.node("Shape", ["attention_mask"], ["/mask_shape"])
    b.node("Gather", ["/mask_shape", b.init("/idx1", np.array(1, np.int64))], ["/total"])
    b.node("Cast", ["/total"], ["total_len"], to=TP.INT32)
    ang = np.arange(s.context)[:, None] * (s.theta ** (-np.arange(0, d, 2) / d))[None]
    cos = b.init("cos_cache", np.cos(ang).astype(np.float32))
    sin = b.init("sin_cache", np.sin(ang).astype(np.float32))

    def norm_w(name: str) -> str:
        return b.init(name, (1 + 0.1 * b.rng.standard_normal(s.hidden)).astype(np.float32))

    inputs = [oh.make_tensor_value_info("input_ids", TP.INT64, [1, "seq"]),
              oh.make_tensor_value_info("attention_mask", TP.INT64, [1, "total"])]
    outputs = [oh.make_tensor_value_info("logits", TP.FLOAT, [1, "seq", s.vocab])]
    residual, x = "/embed/output_0", None
    for i in range(s.layers):
        p = f"model.layers.{i}"
        if x is None:
            b.node("SimplifiedLayerNormalization", [residual, norm_w(f"{p}.input_layernorm.weight")], [f"/{p}/in_norm"],
                   axis=-1, epsilon=1e-5)
        else:
            b.node("SkipSimplifiedLayerNormalization", [x, residual, norm_w(f"{p}.input_layernorm.weight")],
                   [f"/{p}/in_norm", "", "", f"/{p}/in_sum"], MS, epsilon=1e-5)
            residual = f"/{p}/in_sum"
        h = f"/{p}/in_norm"
        q_rows, kv_rows = s.heads * d, s.kv_heads * d
        if s.packed_qkv:
            qkv = [b.matmul_nbits(f"{p}.attn.qkv_proj", h, q_rows + 2 * kv_rows, s.hidden), "", ""]
        else:
            qkv = [b.matmul_nbits(f"{p}.attn.{n}_proj", h, r, s.hidden)
                   for n, r in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))]
        pk, pv = f"past_key_values.{i}.key", f"past_key_values.{i}.value"
        ok, ov = f"present.{i}.key", f"present.{i}.value"
        for name, io in ((pk, inputs), (pv, inputs), (ok, outputs), (ov, outputs)):
            io.append(oh.make_tensor_value_info(name, TP.FLOAT, [1, s.kv_heads, "past" if io is inputs else "tot", d]))
        b.node("GroupQueryAttention", [*qkv, pk, pv, "seqlens_k", "total_len", cos, sin], [f"/{p}/attn", ok, ov], MS,
               num_heads=s.heads, kv_num_heads=s.kv_heads, do_rotary=1, rotary_interleaved=int(s.interleaved),
               local_window_size=-1, scale=0.0)
        o = b.matmul_nbits(f"{p}.attn.o_proj", f"/{p}/attn", s.hidden, q_rows)
        b.node("SkipSimplifiedLayerNormalization", [o, residual, norm_w(f"{p}.post_attention_layernorm.weight")],
               [f"/{p}/post_norm", "", "", f"/{p}/post_sum"], MS, epsilon=1e-5)
        residual = f"/{p}/post_sum"
        gate = b.matmul_nbits(f"{p}.mlp.gate_proj", f"/{p}/post_norm", s.ffn, s.hidden)
        up = b.matmul_nbits(f"{p}.mlp.up_proj", f"/{p}/post_norm", s.ffn, s.hidden)
        b.node("Sigmoid", [gate], [f"/{p}/sig"])
        b.node("Mul", [gate, f"/{p}/sig"], [f"/{p}/silu"])
        b.node("Mul", [f"/{p}/silu", up], [f"/{p}/act"])
        x = b.matmul_nbits(f"{p}.mlp.down_proj", f"/{p}/act", s.hidden, s.ffn)
    b.node("SkipSimplifiedLayerNormalization", [x, residual, norm_w("model.norm.weight")],
           ["/final_norm", "", "", "/final_sum"], MS, epsilon=1e-5)
    head = b.matmul_nbits("lm_head", "/final_norm", s.vocab, s.hidden)
    b.node("Identity", [head], ["logits"])
    graph = oh.make_graph(b.nodes, "genai_decoder", inputs, outputs, initializer=b.inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21), oh.make_opsetid(MS, 1)])
    model.ir_version = 10
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    onnx.save(model, str(path))
    (folder / "genai_config.json").write_text(json.dumps(_genai_config(s, d)))
    return path, b.tables


def _genai_config(s: GenaiSpec, d: int) -> dict:
    return {
        "model": {
            "type": "llama", "context_length": s.context, "bos_token_id": 1, "eos_token_id": 2, "vocab_size": s.vocab,
            "decoder": {
                "filename": "model.onnx", "head_size": d, "hidden_size": s.hidden, "num_attention_heads": s.heads,
                "num_key_value_heads": s.kv_heads, "num_hidden_layers": s.layers,
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                           "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
            },
        },
        "search": {"max_length": s.context, "past_present_share_buffer": False},
    }


def kernel_weights_desc(desc: ModelDescription) -> ModelDescription:
    """The description with each int4 weight as the kernels hold it (float16 scales)."""
    weights = dict(desc.weights)
    for name, (_, t, _) in desc.quantized.items():
        idx = np.arange(t.shape[1]) // t.block
        s16 = t.scales.astype(np.float16).astype(np.float32)[:, idx]
        weights[name] = (t.codes.astype(np.float32) - t.zero_points().astype(np.float32)[:, idx]) * s16
    return replace(desc, weights=weights, quantized={})
