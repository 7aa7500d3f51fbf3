"""Emit a ModelDescription as an ONNX graph that onnxruntime can run.

The graph is the model's one portable form. Attention is a node of PerfX's own
``perfx.CachedAttention`` operator whose body is an ONNX *function* made of
standard operators, so:

* onnxruntime inlines the function body and runs the graph as it is;
* PerfX's importer sees one node and maps it onto the fused attention kernel
  that updates the KV cache in place.

Graph I/O (batch 1, ``seq`` symbolic):
    input_ids  int64  [1, seq]
    past_len   int64  [1]                       tokens already in the cache
    (``index_dtype="int32"``: ids, past_len, positions and page_table are int32, for targets without
    64-bit integers such as WebGPU; the attention functions widen them to int64 internally)
    cache_k.{i}, cache_v.{i}  float [1, kv_heads, max_context, head_dim]
    -> logits  float  [1, seq, vocab]  (or [1, 1, vocab] with ``logits="last"``)
    -> cache_k_out.{i}, cache_v_out.{i}          the caches with this step written
Weights are initializers, or graph inputs of the same names with ``weights="inputs"``
(what the compiler imports: no weight bytes go through protobuf).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from perfx_compiler.model.description import ModelConfig, ModelDescription, rope_tables

OPSET = 18
PERFX_DOMAIN = "perfx"
ROPE_COS = "rope.cos"
ROPE_SIN = "rope.sin"
# the sliding layers' tables of a model with two RoPE bases (Gemma 3)
ROPE_COS_LOCAL = "rope.cos_local"
ROPE_SIN_LOCAL = "rope.sin_local"


def rope_arrays(config: ModelConfig) -> dict[str, np.ndarray]:
    """The RoPE tables the graph reads, float32 [max_context, head_dim/2] each."""
    cos, sin = rope_tables(config, config.max_context)
    out = {ROPE_COS: cos.astype(np.float32), ROPE_SIN: sin.astype(np.float32)}
    if any(config.layer_rope_local(i) for i in range(config.num_layers)):
        cos, sin = rope_tables(config, config.max_context, local=True)
        out[ROPE_COS_LOCAL], out[ROPE_SIN_LOCAL] = cos.astype(np.float32), sin.astype(np.float32)
    return out


def cache_names(num_layers: int) -> list[str]:
    """Cache input names in graph order."""
    return [n for i in range(num_layers) for n in (f"cache_k.{i}", f"cache_v.{i}")]


def cache_shape(config: ModelConfig, kv_cache: str = "f32") -> list[int]:
    """[1, KVH, MAXC, row]: row = head_dim, or head_dim + 4 for an int8 cache (the row's float32 scale
    follows its values: kernels/_kv_cache.py)."""
    from perfx_compiler.kernels._kv_cache import kv_dtype, row_stride

    return [1, config.num_kv_heads, config.max_context, row_stride(config.head_dim, kv_dtype(kv_cache))]


_KV_ONNX = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "int8": TensorProto.INT8}


class _Graph:
    """Tiny helper that names intermediate values and collects nodes."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._n = 0

    def op(self, op_type: str, *inputs: str, n_out: int = 1, domain: str = "", **attrs) -> str | list[str]:
        self._n += 1
        outs = [f"{op_type.lower()}_{self._n}" + (f"_{j}" if n_out > 1 else "") for j in range(n_out)]
        self.nodes.append(
            helper.make_node(op_type, list(inputs), outs, name=f"{op_type}_{self._n}", domain=domain, **attrs)
        )
        return outs[0] if n_out == 1 else outs

    def const(self, value: np.ndarray | list | float, dtype=np.int64) -> str:
        self._n += 1
        name = f"const_{self._n}"
        self.nodes.append(
            helper.make_node(
                "Constant", [], [name], name=name, value=numpy_helper.from_array(np.asarray(value, dtype=dtype), name)
            )
        )
        return name


def _rope(g: _Graph, x: str, cos: str, sin: str, d: int) -> str:
    """Rotate-half RoPE of ``x`` [..., D] with ``cos``/``sin`` tables [..., D/2] broadcast against it."""
    x1, x2 = g.op("Split", x, g.const([d // 2, d // 2]), axis=-1, n_out=2)
    r1 = g.op("Sub", g.op("Mul", x1, cos), g.op("Mul", x2, sin))
    r2 = g.op("Add", g.op("Mul", x2, cos), g.op("Mul", x1, sin))
    return g.op("Concat", r1, r2, axis=-1)


# The attention operators' variant attributes and their defaults (plain causal, no capping);
# the function bodies read them through attribute references.
_VARIANT_DEFAULTS = [helper.make_attribute("window", 0), helper.make_attribute("softcap", 0.0)]


def _attr_const(g: _Graph, name: str, kind: str) -> str:
    g._n += 1
    out = f"{name}_{g._n}"
    attr = helper.make_attribute_ref(
        kind, onnx.AttributeProto.INT if kind == "value_int" else onnx.AttributeProto.FLOAT, ref_attr_name=name)
    node = helper.make_node("Constant", [], [out], name=out)
    node.attribute.append(attr)
    g.nodes.append(node)
    return out


def _mask(g: _Graph, key_pos: str, pos: str) -> str:
    """True where a key is hidden from a query: in its future, or (window W > 0) W or more behind it."""
    window = _attr_const(g, "window", "value_int")
    future = g.op("Greater", key_pos, pos)
    behind = g.op("LessOrEqual", key_pos, g.op("Sub", pos, window))
    return g.op("Or", future, g.op("And", behind, g.op("Greater", window, g.const(0))))


def _softcap(g: _Graph, scores: str) -> str:
    """c * tanh(s / c) when the softcap attribute c > 0 (Gemma 2), else the scores."""
    cap = _attr_const(g, "softcap", "value_float")
    capped = g.op("Mul", g.op("Tanh", g.op("Div", scores, cap)), cap)
    return g.op("Where", g.op("Greater", cap, g.const(0.0, np.float32)), capped, scores)


def _attention_function(config: ModelConfig, index_dtype: str = "int64") -> onnx.FunctionProto:
    """``perfx.CachedAttention`` as standard ONNX ops (what onnxruntime runs).

    inputs: q [1,seq,H*D], k/v [1,seq,KVH*D], cache_k/cache_v [1,KVH,MAXC,D], past_len [1],
            rope_cos/rope_sin [MAXC, D/2]
    outputs: out [1,seq,H*D], cache_k_out, cache_v_out
    RoPE (rotate-half) is applied to q and k inside; k/v are written at positions
    past_len .. past_len+seq-1; query i sees cache positions <= past_len + i.
    """
    c = config
    h, kvh, d, maxc = c.num_heads, c.num_kv_heads, c.head_dim, c.max_context
    g = _Graph()
    seq_shape = g.op("Shape", "q")
    seq = g.op("Gather", seq_shape, g.const(1), axis=0)  # scalar
    past = g.op("Squeeze", "past_len", g.const([0]))
    if index_dtype != "int64":
        past = g.op("Cast", past, to=TensorProto.INT64)
    pos = g.op("Range", past, g.op("Add", past, seq), g.const(1))  # [seq]
    cos = g.op("Gather", "rope_cos", pos, axis=0)  # [seq, D/2]
    sin = g.op("Gather", "rope_sin", pos, axis=0)

    def heads(x: str, n: int) -> str:  # [1,seq,n*D] -> [1,n,seq,D]
        return g.op("Transpose", g.op("Reshape", x, g.const([1, -1, n, d])), perm=[0, 2, 1, 3])

    q = _rope(g, heads("q", h), cos, sin, d)
    k = _rope(g, heads("k", kvh), cos, sin, d)
    v = heads("v", kvh)
    # Scatter k/v rows into the caches along the position axis.
    idx = g.op("Expand", g.op("Reshape", pos, g.const([1, 1, -1, 1])), g.op("Shape", k))
    g.nodes.append(helper.make_node("ScatterElements", ["cache_k", idx, k], ["cache_k_out"], axis=2))
    g.nodes.append(helper.make_node("ScatterElements", ["cache_v", idx, v], ["cache_v_out"], axis=2))
    # GQA: query head j uses kv head j // (H/KVH): group queries as [1,KVH,G,seq,D].
    q5 = g.op("Reshape", q, g.const([1, kvh, h // kvh, -1, d]))
    k5 = g.op("Unsqueeze", g.op("Transpose", "cache_k_out", perm=[0, 1, 3, 2]), g.const([2]))
    v5 = g.op("Unsqueeze", "cache_v_out", g.const([2]))
    scores = _softcap(g, g.op("Mul", g.op("MatMul", q5, k5), g.const(1.0 / math.sqrt(d), np.float32)))
    key_pos = g.op("Reshape", g.const(np.arange(maxc)), g.const([1, maxc]))
    masked = _mask(g, key_pos, g.op("Reshape", pos, g.const([-1, 1])))  # [seq, MAXC]
    scores = g.op("Where", masked, g.const(-np.inf, np.float32), scores)
    probs = g.op("Softmax", scores, axis=-1)
    o = g.op("MatMul", probs, v5)  # [1,KVH,G,seq,D]
    o = g.op("Reshape", o, g.const([1, h, -1, d]))
    o = g.op("Transpose", o, perm=[0, 2, 1, 3])
    g.nodes.append(helper.make_node("Reshape", [o, g.const([1, -1, h * d])], ["out"]))
    return helper.make_function(
        PERFX_DOMAIN,
        "CachedAttention",
        ["q", "k", "v", "cache_k", "cache_v", "past_len", "rope_cos", "rope_sin"],
        ["out", "cache_k_out", "cache_v_out"],
        g.nodes,
        opset_imports=[helper.make_opsetid("", OPSET)],
        attribute_protos=_VARIANT_DEFAULTS,
    )


PAGE_SIZE = 16


def pages_per_sequence(config: ModelConfig, page_size: int = PAGE_SIZE) -> int:
    return -(-config.max_context // page_size)


def pool_names(num_layers: int) -> list[str]:
    """Paged KV pool input names in graph order."""
    return [n for i in range(num_layers) for n in (f"pool_k.{i}", f"pool_v.{i}")]


def pool_shape(config: ModelConfig, num_pages: int | str, page_size: int = PAGE_SIZE, kv_cache: str = "f32") -> list:
    """[pages, page_size, kv_heads, row]: one token's heads are contiguous (scatter-friendly); a row is
    head_dim values (and an int8 row's float32 scale: kernels/_kv_cache.py)."""
    from perfx_compiler.kernels._kv_cache import kv_dtype, row_stride

    return [num_pages, page_size, config.num_kv_heads, row_stride(config.head_dim, kv_dtype(kv_cache))]


def _paged_attention_function(config: ModelConfig, page_size: int, index_dtype: str = "int64") -> onnx.FunctionProto:
    """``perfx.PagedAttention``: CachedAttention for a batch of sequences over a paged KV pool.

    inputs: q [B,seq,H*D], k/v [B,seq,KVH*D], pool_k/pool_v [pages,PS,KVH,D], positions [B] (tokens
            already cached per sequence), page_table [B,P] (page ids; unused entries any valid id),
            rope_cos/rope_sin [MAXC, D/2]
    outputs: out [B,seq,H*D], pool_k_out, pool_v_out
    """
    c = config
    h, kvh, d = c.num_heads, c.num_kv_heads, c.head_dim
    npp = pages_per_sequence(c, page_size)
    g = _Graph()
    positions, page_table = "positions", "page_table"
    if index_dtype != "int64":
        positions = g.op("Cast", positions, to=TensorProto.INT64)
        page_table = g.op("Cast", page_table, to=TensorProto.INT64)
    seq = g.op("Gather", g.op("Shape", "q"), g.const(1), axis=0)
    steps = g.op("Unsqueeze", g.op("Range", g.const(0), seq, g.const(1)), g.const([0]))  # [1, seq]
    pos = g.op("Add", g.op("Unsqueeze", positions, g.const([1])), steps)  # [B, seq]
    cos = g.op("Unsqueeze", g.op("Gather", "rope_cos", pos, axis=0), g.const([1]))  # [B,1,seq,D/2]
    sin = g.op("Unsqueeze", g.op("Gather", "rope_sin", pos, axis=0), g.const([1]))

    def heads(x: str, n: int) -> str:  # [B,seq,n*D] -> [B,n,seq,D]
        return g.op("Transpose", g.op("Reshape", x, g.const([0, 0, n, d])), perm=[0, 2, 1, 3])

    q = _rope(g, heads("q", h), cos, sin, d)
    k = g.op("Transpose", _rope(g, heads("k", kvh), cos, sin, d), perm=[0, 2, 1, 3])  # [B,seq,KVH,D]
    v = g.op("Reshape", "v", g.const([0, 0, kvh, d]))
    page = g.op("GatherElements", page_table, g.op("Div", pos, g.const(page_size)), axis=1)
    slot = g.op("Mod", pos, g.const(page_size))
    idx = g.op("Concat", g.op("Unsqueeze", page, g.const([2])), g.op("Unsqueeze", slot, g.const([2])), axis=2)
    g.nodes.append(helper.make_node("ScatterND", ["pool_k", idx, k], ["pool_k_out"]))
    g.nodes.append(helper.make_node("ScatterND", ["pool_v", idx, v], ["pool_v_out"]))

    def gather_seq(pool: str) -> str:  # -> [B, KVH, P*PS, D]
        x = g.op("Gather", pool, page_table, axis=0)  # [B,P,PS,KVH,D]
        x = g.op("Reshape", x, g.const([0, npp * page_size, kvh, d]))
        return g.op("Transpose", x, perm=[0, 2, 1, 3])

    keys, vals = gather_seq("pool_k_out"), gather_seq("pool_v_out")
    q5 = g.op("Reshape", q, g.const([0, kvh, h // kvh, -1, d]))
    k5 = g.op("Unsqueeze", g.op("Transpose", keys, perm=[0, 1, 3, 2]), g.const([2]))
    v5 = g.op("Unsqueeze", vals, g.const([2]))
    scores = _softcap(g, g.op("Mul", g.op("MatMul", q5, k5), g.const(1.0 / math.sqrt(d), np.float32)))
    key_pos = g.op("Reshape", g.const(np.arange(npp * page_size)), g.const([1, 1, -1]))
    masked = _mask(g, key_pos, g.op("Unsqueeze", pos, g.const([2])))  # [B, seq, L]
    masked = g.op("Unsqueeze", masked, g.const([1, 2]))
    scores = g.op("Where", masked, g.const(-np.inf, np.float32), scores)
    o = g.op("MatMul", g.op("Softmax", scores, axis=-1), v5)  # [B,KVH,G,seq,D]
    o = g.op("Transpose", g.op("Reshape", o, g.const([0, h, -1, d])), perm=[0, 2, 1, 3])
    g.nodes.append(helper.make_node("Reshape", [o, g.const([0, 0, h * d])], ["out"]))
    return helper.make_function(
        PERFX_DOMAIN,
        "PagedAttention",
        ["q", "k", "v", "pool_k", "pool_v", "positions", "page_table", "rope_cos", "rope_sin"],
        ["out", "pool_k_out", "pool_v_out"],
        g.nodes,
        opset_imports=[helper.make_opsetid("", OPSET)],
        attribute_protos=_VARIANT_DEFAULTS,
    )


def emit_onnx(
    desc: ModelDescription,
    *,
    weights: Literal["initializers", "inputs"] = "initializers",
    logits: Literal["all", "last"] = "all",
    seq_len: int | str = "seq",
    kv: Literal["contiguous", "paged"] = "contiguous",
    batch: int | str = 1,
    num_pages: int | str = "pages",
    page_size: int = PAGE_SIZE,
    index_dtype: Literal["int64", "int32"] = "int64",
    kv_cache: str = "f32",
    metadata: bool = True,
) -> onnx.ModelProto:
    """Build the decoder graph for ``desc`` (see module docstring for its I/O).

    ``kv="paged"`` builds the batched variant: input_ids [batch, seq], positions [batch],
    page_table [batch, pages_per_sequence] and one paged pool per layer for K and V.
    ``index_dtype`` is the element type of the integer inputs (ids, past_len, positions, page_table).
    ``kv_cache`` ("f32" | "f16" | "int8"): the caches' (or the paged pools') storage (the compiler's kernels
    read it; the graph's ONNX function bodies, for onnxruntime, read float32 caches only).
    ``metadata``: the model props that rebuild the description (config, tokenizer, chat template); the
    compile's graphs go without (the importer reads none of it, and a 262k-token vocabulary's tokenizer is
    ~46 MB in every graph: the Gemma 3 270M compile's import phase peaked 140 MB higher with it).
    """
    if index_dtype not in ("int64", "int32"):
        raise ValueError(f"index_dtype must be 'int64' or 'int32', not {index_dtype!r}")
    if kv == "contiguous" and batch != 1:
        raise ValueError("the contiguous KV cache holds one sequence; use kv='paged' for batches")
    c = desc.config
    g = _Graph()
    weight_arrays: dict[str, np.ndarray] = {n: w for n, w in desc.weights.items()}
    weight_arrays.update(rope_arrays(c))

    def linear(x: str, name: str) -> str:
        y = g.op("MatMul", x, g.op("Transpose", name + ".weight", perm=[1, 0]))
        if name + ".bias" in weight_arrays:
            y = g.op("Add", y, name + ".bias")
        return y

    eps = g.const(np.float32(c.rms_norm_eps), np.float32)
    two = g.const(np.float32(2.0), np.float32)

    def rms_norm(x: str, weight: str) -> str:
        var = g.op("ReduceMean", g.op("Pow", x, two), g.const([-1]), keepdims=1)
        return g.op("Mul", g.op("Div", x, g.op("Sqrt", g.op("Add", var, eps))), weight)

    def head_norm(x: str, heads: int, weight: str) -> str:
        """RMSNorm over each head of x [batch, seq, heads*D] (QK-norm)."""
        y = rms_norm(g.op("Reshape", x, g.const([0, 0, heads, c.head_dim])), weight)
        return g.op("Reshape", y, g.const([0, 0, heads * c.head_dim]))

    def gate_activation(x: str) -> str:
        if c.mlp_activation == "gelu_tanh":  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
            inner = g.op("Add", x, g.op("Mul", g.op("Mul", g.op("Mul", x, x), x), g.const(0.044715, np.float32)))
            t = g.op("Tanh", g.op("Mul", inner, g.const(math.sqrt(2.0 / math.pi), np.float32)))
            return g.op("Mul", g.op("Mul", x, g.const(0.5, np.float32)), g.op("Add", t, g.const(1.0, np.float32)))
        return g.op("Mul", x, g.op("Sigmoid", x))

    def softcap(x: str, cap: float) -> str:
        return g.op("Mul", g.op("Tanh", g.op("Mul", x, g.const(1.0 / cap, np.float32))), g.const(cap, np.float32))

    x = g.op("Gather", "model.embed_tokens.weight", "input_ids", axis=0)  # [batch, seq, hidden]
    if c.embedding_scale != 1.0:
        x = g.op("Mul", x, g.const(c.embedding_scale, np.float32))
    outputs_cache: list[str] = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        hn = rms_norm(x, p + "input_layernorm.weight")
        q = linear(hn, p + "self_attn.q_proj")
        k = linear(hn, p + "self_attn.k_proj")
        v = linear(hn, p + "self_attn.v_proj")
        if c.qk_norm:
            q = head_norm(q, c.num_heads, p + "self_attn.q_norm.weight")
            k = head_norm(k, c.num_kv_heads, p + "self_attn.k_norm.weight")
        if c.query_scale:  # the kernels scale by 1/sqrt(head_dim): the rest of the model's own scale
            q = g.op("Mul", q, g.const(c.query_scale * math.sqrt(c.head_dim), np.float32))
        cos, sin = (ROPE_COS_LOCAL, ROPE_SIN_LOCAL) if c.layer_rope_local(i) else (ROPE_COS, ROPE_SIN)
        variant = {k_: v_ for k_, v_ in (("window", c.layer_window(i)), ("softcap", c.attn_softcap)) if v_}
        if kv == "paged":
            attn, ck, cv = g.op(
                "PagedAttention", q, k, v, f"pool_k.{i}", f"pool_v.{i}", "positions", "page_table",
                cos, sin, n_out=3, domain=PERFX_DOMAIN, **variant,
            )
            outs = [f"pool_k_out.{i}", f"pool_v_out.{i}"]
        else:
            attn, ck, cv = g.op(
                "CachedAttention", q, k, v, f"cache_k.{i}", f"cache_v.{i}", "past_len", cos, sin,
                n_out=3, domain=PERFX_DOMAIN, **variant,
            )
            outs = [f"cache_k_out.{i}", f"cache_v_out.{i}"]
        g.nodes.append(helper.make_node("Identity", [ck], [outs[0]]))
        g.nodes.append(helper.make_node("Identity", [cv], [outs[1]]))
        outputs_cache += outs
        o = linear(attn, p + "self_attn.o_proj")
        if c.sandwich_norms:
            o = rms_norm(o, p + "attn_output_layernorm.weight")
        x = g.op("Add", x, o)
        hn = rms_norm(x, p + "post_attention_layernorm.weight")
        gate = linear(hn, p + "mlp.gate_proj")
        up = linear(hn, p + "mlp.up_proj")
        act = g.op("Mul", gate_activation(gate), up)
        m = linear(act, p + "mlp.down_proj")
        if c.sandwich_norms:
            m = rms_norm(m, p + "mlp_output_layernorm.weight")
        x = g.op("Add", x, m)
    if logits == "last":
        end = np.iinfo(np.int64 if index_dtype == "int64" else np.int32).max  # int32: kernels index in int32
        x = g.op("Slice", x, g.const([-1]), g.const([end]), g.const([1]))
    x = rms_norm(x, "model.norm.weight")
    head = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
    if c.final_softcap:
        x = softcap(g.op("MatMul", x, g.op("Transpose", head, perm=[1, 0])), c.final_softcap)
        g.nodes.append(helper.make_node("Identity", [x], ["logits"]))
    else:
        g.nodes.append(helper.make_node("MatMul", [x, g.op("Transpose", head, perm=[1, 0])], ["logits"]))

    f32, i64 = TensorProto.FLOAT, (TensorProto.INT64 if index_dtype == "int64" else TensorProto.INT32)
    from perfx_compiler.kernels._kv_cache import kv_dtype

    kv_type = _KV_ONNX[kv_dtype(kv_cache)]
    if kv == "paged":
        cshape = pool_shape(c, num_pages, page_size, kv_cache)
        inputs = [
            helper.make_tensor_value_info("input_ids", i64, [batch, seq_len]),
            helper.make_tensor_value_info("positions", i64, [batch]),
            helper.make_tensor_value_info("page_table", i64, [batch, pages_per_sequence(c, page_size)]),
        ] + [helper.make_tensor_value_info(n, kv_type, cshape) for n in pool_names(c.num_layers)]
        function = _paged_attention_function(c, page_size, index_dtype)
    else:
        cshape = cache_shape(c, kv_cache)
        inputs = [
            helper.make_tensor_value_info("input_ids", i64, [1, seq_len]),
            helper.make_tensor_value_info("past_len", i64, [1]),
        ] + [helper.make_tensor_value_info(n, kv_type, cshape) for n in cache_names(c.num_layers)]
        function = _attention_function(c, index_dtype)
    out_seq = 1 if logits == "last" else seq_len
    outputs = [helper.make_tensor_value_info("logits", f32, [batch, out_seq, c.vocab_size])] + [
        helper.make_tensor_value_info(n, kv_type, cshape) for n in outputs_cache
    ]
    initializers = []
    for name, arr in weight_arrays.items():
        if weights == "initializers":
            initializers.append(numpy_helper.from_array(np.ascontiguousarray(arr, dtype=np.float32), name))
        else:
            inputs.append(helper.make_tensor_value_info(name, f32, list(arr.shape)))
    graph = helper.make_graph(g.nodes, f"perfx_{c.architecture}", inputs, outputs, initializers)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(PERFX_DOMAIN, 1)],
        functions=[function],
        producer_name="perfx",
    )
    model.ir_version = 9
    if not metadata:
        return model
    # The graph carries everything needed to rebuild the description (see onnx_read.py).
    meta = {"perfx.config": json.dumps(c.to_dict())}
    if desc.tokenizer_json:
        meta["perfx.tokenizer"] = desc.tokenizer_json
    if desc.chat_template:
        meta["perfx.chat_template"] = desc.chat_template
    helper.set_model_props(model, meta)
    return model


def save_onnx(desc: ModelDescription, path: str | Path) -> Path:
    """Write the runnable graph (weights as initializers; external data past protobuf's 2 GB)."""
    path = Path(path)
    model = emit_onnx(desc, weights="initializers", logits="all")
    big = sum(w.nbytes for w in desc.weights.values()) > 1_800_000_000
    onnx.save_model(model, str(path), save_as_external_data=big, location=path.name + ".data" if big else None)
    return path


def weight_input_names(desc: ModelDescription) -> list[str]:
    """Names of the weight inputs of ``emit_onnx(..., weights="inputs")``, in graph order."""
    return [*desc.weights.keys(), *rope_arrays(desc.config)]


def weight_arrays(desc: ModelDescription) -> dict[str, np.ndarray]:
    """The float32 arrays fed to the weight inputs (weights + RoPE tables)."""
    from perfx_compiler.model.lazy import is_lazy

    # Lazy GGUF matrices stay lazy: the passes read their blocks (np.asarray dequantizes on demand).
    out = {n: (w if is_lazy(w) else np.ascontiguousarray(w, dtype=np.float32)) for n, w in desc.weights.items()}
    out.update(rope_arrays(desc.config))
    return out
