"""Recognise a Llama-family decoder in a third-party ONNX graph and rebuild its ModelDescription.

The graph's *structure* is matched, not its names (``torch.onnx`` dynamo exports constant-fold
every linear weight into an anonymous pre-transposed initializer):

* embedding: ``Gather(table, input_ids)``;
* linears: ``MatMul(x, W)``, ``MatMul(x, Transpose(W))``, ``Gemm``, or com.microsoft
  ``MatMulNBits`` (blocks dequantized exactly, see ``contrib_ops``; int4 ones are also kept as
  ``NBitsTable``s in ``ModelDescription.quantized`` for ``passes/onnx_int4_passthrough``), each with an
  optional bias ``Add``; linears sharing one input form a group, and a layer is four groups
  in graph order: q/k/v (or one packed qkv) -> o -> gate/up -> down; the last linear is lm_head;
* q vs k vs v: which KV output (``present.N.key`` / ``.value``) or attention-op input a
  linear's result reaches without passing another linear; gate vs up: which one feeds SiLU;
* RMSNorms feeding each group: ``SimplifiedLayerNormalization``, ``SkipSimplifiedLayerNormalization``,
  ``RMSNormalization`` or the ``Pow -> ReduceMean -> Add(eps) -> Sqrt -> Reciprocal -> Mul -> Mul(w)``
  chain (its weight and epsilon);
* RoPE: the ``inv_freq`` constant (torch) or the cos/sin caches of ``GroupQueryAttention`` /
  ``RotaryEmbedding`` (genai), fitted to ``theta^(-2i/d)`` (optionally / a linear factor);
  interleaved rotary is turned into rotate-half by permuting Q/K rows (and their int4 tables' rows);
* sliding window (Mistral ``sliding_window``, genai ``decoder.sliding_window``, GQA
  ``local_window_size``): PerfX attention has none, so the context is capped at the window and a
  longer ``max_context`` is refused.

Config values the graph cannot give (context length, BOS/EOS, architecture name) come from
``genai_config.json`` or ``config.json`` in the model's folder; the tokenizer from its
``tokenizer.json`` / ``tokenizer_config.json``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from perfx_compiler.errors import ModelFormatError, UnsupportedModelError
from perfx_compiler.frontend.contrib_ops import NBitsTable, float_attr, int_attr, matmulnbits_table
from perfx_compiler.frontend.decoder_io import DecoderIO, read_genai_config, recognize_io
from perfx_compiler.frontend.rope_fit import fit_rope, rope_inv_freq_of
from perfx_compiler.model.description import ModelConfig, ModelDescription, rope_inv_freq
from perfx_compiler.model.onnx_read import tensor_array

_PASS_THROUGH = ("Cast", "Identity")
_ATTENTION_OPS = ("GroupQueryAttention", "MultiHeadAttention", "Attention", "RotaryEmbedding")
_GENAI_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
QTYPE = "MatMulNBits"  # ModelDescription.quantized type of a MatMulNBits table (GGUF's are ggml type names)


@dataclass
class Linear:
    node: onnx.NodeProto
    x: str  # input activation
    out: str  # output after the bias Add, if any
    weight: np.ndarray  # [out_features, in_features] float32
    bias: np.ndarray | None
    table: NBitsTable | None = None  # MatMulNBits codes/scales/zeros behind ``weight`` (same rows)


class OnnxGraph:
    """Producers, consumers and constant values of a (function-inlined) graph."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.nodes = list(model.graph.node)
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for n in self.nodes:
            for o in n.output:
                if o:
                    self.producer[o] = n
            for i in n.input:
                if i:
                    self.consumers[i].append(n)
        self._inits = {t.name: t for t in model.graph.initializer}
        self._cache: dict[str, np.ndarray] = {}
        self.outputs = {o.name for o in model.graph.output}

    def const(self, name: str) -> np.ndarray | None:
        """The value of an initializer / Constant output (through Cast/Identity), else None."""
        if name in self._cache:
            return self._cache[name]
        val: np.ndarray | None = None
        if name in self._inits:
            val = tensor_array(self._inits[name])
        elif name in self.producer:
            n = self.producer[name]
            if n.op_type == "Constant" and n.attribute:
                a = n.attribute[0]
                if a.name == "value":
                    val = tensor_array(a.t, f"Constant '{n.name}'")
                elif a.name in ("value_float", "value_int"):
                    val = np.array(onnx.helper.get_attribute_value(a))
                elif a.name in ("value_floats", "value_ints"):
                    val = np.array(onnx.helper.get_attribute_value(a))
            elif n.op_type in _PASS_THROUGH:
                inner = self.const(n.input[0])
                if inner is not None and n.op_type == "Cast":
                    val = inner.astype(_cast_dtype(n))
                else:
                    val = inner
        if val is not None:
            self._cache[name] = val
        return val

    def unwrap(self, name: str) -> str:
        """Skip Cast/Identity producers backwards."""
        while name in self.producer and self.producer[name].op_type in _PASS_THROUGH:
            name = self.producer[name].input[0]
        return name

    def node_of(self, name: str) -> onnx.NodeProto | None:
        return self.producer.get(self.unwrap(name))


def _cast_dtype(node: onnx.NodeProto) -> np.dtype:
    """The numpy type of a Cast's ``to`` (an unknown type number: a corrupt file)."""
    to = int_attr(node, "to")
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(to))
    except (KeyError, ValueError, TypeError):
        raise ModelFormatError(f"Cast '{node.name}' casts to unknown type {to}; the file is corrupt, re-export it") from None


def _attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32))


def _linear_at(g: OnnxGraph, node: onnx.NodeProto) -> Linear | None:
    """The linear layer a MatMul/Gemm/MatMulNBits node computes, if its weight is a constant."""
    w: np.ndarray | None = None
    bias: np.ndarray | None = None
    table: NBitsTable | None = None
    if node.op_type in ("MatMul", "Gemm", "MatMulNBits") and len(node.input) < (3 if node.op_type == "MatMulNBits" else 2):
        raise ModelFormatError(f"{node.op_type} '{node.name}' has {len(node.input)} inputs; the file is corrupt, re-export it")
    if node.op_type == "MatMul":
        b = g.const(node.input[1])
        if b is not None and b.ndim == 2:
            w = b.T
        elif node.input[1] in g.producer and g.producer[node.input[1]].op_type == "Transpose":
            t = g.producer[node.input[1]]
            src = g.const(t.input[0])
            if src is not None and src.ndim == 2 and _attr(t, "perm", [1, 0]) == [1, 0]:
                w = src
    elif node.op_type == "Gemm" and float_attr(node, "alpha", 1.0) == 1.0 and not int_attr(node, "transA", 0):
        b = g.const(node.input[1])
        if b is not None and b.ndim == 2:
            w = b if int_attr(node, "transB", 0) else b.T
            if len(node.input) > 2 and node.input[2]:
                c = g.const(node.input[2])
                bias = None if c is None else c.reshape(-1) * float_attr(node, "beta", 1.0)
    elif node.op_type == "MatMulNBits" and node.domain == "com.microsoft":
        t = matmulnbits_table(node, g.const)
        if isinstance(t, NBitsTable):
            table, w = t, t.dequantize()
        else:
            w = t
        if len(node.input) > 5 and node.input[5]:
            bias = g.const(node.input[5])
    if w is None or g.const(node.input[0]) is not None:
        return None
    out = node.output[0]
    users = g.consumers.get(out, [])
    if bias is None and len(users) == 1 and users[0].op_type == "Add":
        add = users[0]
        other = add.input[1] if add.input[0] == out else add.input[0]
        c = g.const(other)
        if c is not None and c.size == w.shape[0] and c.reshape(-1).shape[0] == c.shape[-1]:
            bias, out = c.reshape(-1), add.output[0]
    return Linear(node, node.input[0], out, _f32(w), None if bias is None else _f32(bias), table)


def _reach(g: OnnxGraph, start: str, stop: set[str], limit: int = 400) -> tuple[set[str], set[tuple[str, int]]]:
    """Graph outputs and (attention-op node name, input index) reached from ``start`` without
    passing through a node in ``stop`` (the linears)."""
    outs: set[str] = set()
    sinks: set[tuple[str, int]] = set()
    seen, todo = {start}, [start]
    while todo and len(seen) < limit:
        name = todo.pop()
        if name in g.outputs:
            outs.add(name)
        for n in g.consumers.get(name, []):
            if n.name in stop:
                continue
            if n.op_type in _ATTENTION_OPS:
                sinks.add((n.op_type, list(n.input).index(name)))
                if n.op_type != "RotaryEmbedding":
                    continue
            for o in n.output:
                if o and o not in seen:
                    seen.add(o)
                    todo.append(o)
    return outs, sinks


def _rms_norm(g: OnnxGraph, x: str, where: str) -> tuple[np.ndarray, float]:
    """Weight and epsilon of the RMSNorm producing ``x``."""
    n = g.node_of(x)
    if n is None:
        raise UnsupportedModelError(f"{where}: its input is not produced by a normalization")
    if n.op_type in ("SimplifiedLayerNormalization", "RMSNormalization", "SkipSimplifiedLayerNormalization"):
        scale_idx = 2 if n.op_type.startswith("Skip") else 1
        if n.op_type.startswith("Skip") and len(n.input) > 3 and n.input[3]:
            raise UnsupportedModelError(f"{where}: SkipSimplifiedLayerNormalization with a bias is not supported")
        w = g.const(n.input[scale_idx])
        if w is None:
            raise UnsupportedModelError(f"{where}: {n.op_type} '{n.name}' has a non-constant scale")
        return _f32(w.reshape(-1)), float_attr(n, "epsilon", 1e-5)
    if n.op_type == "Mul":
        consts = [(i, g.const(i)) for i in n.input]
        ws = [(i, c) for i, c in consts if c is not None and c.size > 1]
        other = [i for i, c in consts if c is None]
        if len(ws) == 1 and len(other) == 1:
            eps = _rms_chain_eps(g, other[0])
            if eps is not None:
                return _f32(ws[0][1].reshape(-1)), eps
    raise UnsupportedModelError(
        f"{where}: input comes from {n.op_type} '{n.name}', not an RMSNorm "
        "(LayerNorm models and other norms are not supported)"
    )


def _rms_chain_eps(g: OnnxGraph, normed: str) -> float | None:
    """``normed`` = h * 1/sqrt(mean(h^2) + eps) (any of the usual spellings): return eps."""
    seen: set[str] = set()
    todo = [normed]
    eps, has_mean, has_square = None, False, False
    while todo and len(seen) < 24:
        name = g.unwrap(todo.pop())
        if name in seen or name not in g.producer:
            continue
        seen.add(name)
        n = g.producer[name]
        if n.op_type == "ReduceMean":
            has_mean = True
            src = g.node_of(n.input[0])
            if src is not None and (src.op_type == "Pow" and _scalar(g, src.input[1]) == 2.0
                                    or src.op_type == "Mul" and g.unwrap(src.input[0]) == g.unwrap(src.input[1])):
                has_square = True
            continue
        if n.op_type == "Add":
            c = [_scalar(g, i) for i in n.input]
            if any(v is not None for v in c):
                eps = next(v for v in c if v is not None)
        if n.op_type in ("Mul", "Div", "Reciprocal", "Sqrt", "Add", "Rsqrt"):
            todo.extend(i for i in n.input if i and g.const(i) is None)
    return eps if (eps is not None and has_mean and has_square) else None


def _scalar(g: OnnxGraph, name: str) -> float | None:
    c = g.const(name)
    return float(c.reshape(-1)[0]) if c is not None and c.size == 1 else None


def _folder_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}


def _group_linears(g: OnnxGraph) -> list[list[Linear]]:
    groups: dict[str, list[Linear]] = {}
    for n in g.nodes:
        lin = _linear_at(g, n)
        if lin is not None:
            groups.setdefault(g.unwrap(lin.x), []).append(lin)
    return list(groups.values())


def _split_qkv(group: list[Linear], g: OnnxGraph, stop: set[str], io: DecoderIO, layer: int,
               q_size: int | None, kv_size: int | None, where: str) -> tuple[Linear, ...]:
    if len(group) == 1:
        lin = group[0]
        if not q_size or not kv_size or lin.weight.shape[0] != q_size + 2 * kv_size:
            raise UnsupportedModelError(f"{where}: one packed QKV projection of {lin.weight.shape[0]} rows "
                                        "that the attention's head counts do not explain")
        cuts = [0, q_size, q_size + kv_size, q_size + 2 * kv_size]
        parts = []
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            bias = None if lin.bias is None else lin.bias[a:b]
            table = None if lin.table is None else lin.table.rows(slice(a, b))
            parts.append(Linear(lin.node, lin.x, lin.out, lin.weight[a:b], bias, table))
        return tuple(parts)
    if len(group) != 3:
        raise UnsupportedModelError(f"{where}: {len(group)} projections share the attention input (want q, k, v)")
    role: dict[str, Linear] = {}
    for lin in group:
        outs, sinks = _reach(g, lin.out, stop)
        kinds = set()
        if io.has_cache and io.present_keys[layer] in outs or any(i == 1 for _, i in sinks):
            kinds.add("k")
        if io.has_cache and io.present_values[layer] in outs or any(i == 2 for _, i in sinks):
            kinds.add("v")
        if not kinds:
            kinds.add("q")
        if len(kinds) != 1 or next(iter(kinds)) in role:
            role = {}
            break
        role[next(iter(kinds))] = lin
    if set(role) != {"q", "k", "v"}:
        # No KV outputs to tell them apart: the export order of the module (q, k, v).
        role = dict(zip("qkv", group, strict=True))
    return role["q"], role["k"], role["v"]


def _attention_heads(g: OnnxGraph) -> tuple[int | None, int | None, onnx.NodeProto | None]:
    for n in g.nodes:
        if n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft":
            return int_attr(n, "num_heads"), int_attr(n, "kv_num_heads"), n
    return None, None, None


def graph_to_description(model: onnx.ModelProto, path: str | Path, max_context: int | None = None) -> ModelDescription:
    """Rebuild the ModelDescription of a Llama/Qwen2/Mistral decoder graph (weights loaded);
    ``max_context`` overrides the KV cache length (checked against a sliding window)."""
    path = Path(path)
    source, folder = str(path), path.parent
    genai = read_genai_config(folder)
    hf = _folder_config(folder)
    io = recognize_io(model, genai, source)
    g = OnnxGraph(model)
    heads, kv_heads, gqa = _attention_heads(g)
    if gqa is not None:
        if float_attr(gqa, "softcap", 0.0) != 0.0:
            raise UnsupportedModelError(f"{source}: GroupQueryAttention with softcap is not supported")

    emb = next((n for n in g.nodes if n.op_type == "Gather" and g.unwrap(n.input[1]) == io.input_ids
                and g.const(n.input[0]) is not None), None)
    if emb is None:
        raise UnsupportedModelError(f"{source}: no embedding lookup Gather(table, {io.input_ids}) found")
    embed = _f32(g.const(emb.input[0]))
    if embed.ndim != 2:
        raise ModelFormatError(f"{source}: the embedding table '{emb.input[0]}' has shape {embed.shape}, not [vocab, hidden]; "
                               "the file is corrupt, re-export it")
    vocab, hidden = embed.shape

    groups = _group_linears(g)
    if len(groups) < 5 or (len(groups) - 1) % 4:
        raise UnsupportedModelError(
            f"{source}: found {len(groups)} groups of linear layers; a Llama-style decoder has 4 per layer + lm_head"
        )
    n_layers = (len(groups) - 1) // 4
    if io.has_cache and io.num_layers != n_layers:
        raise UnsupportedModelError(f"{source}: {io.num_layers} KV layers but {n_layers} layers of linears")
    stop = {lin.node.name for grp in groups for lin in grp}

    inv, interleaved = rope_inv_freq_of(g, source)
    head_dim = 2 * len(inv)
    if heads is not None:
        q_rows = sum(lin.weight.shape[0] for lin in groups[0])
        if q_rows != (heads + 2 * kv_heads) * head_dim and len(groups[0]) == 1:  # partial rotary or odd packing
            raise UnsupportedModelError(f"{source}: QKV rows {q_rows} do not match {heads}/{kv_heads} heads x {head_dim}")
    weights: dict[str, np.ndarray] = {"model.embed_tokens.weight": embed}
    # MatMulNBits weights as the file stores them (ModelDescription.quantized, for the int4 passthrough)
    quantized: dict[str, tuple[str, NBitsTable, tuple[int, int]]] = {}
    eps_seen: set[float] = set()
    for i in range(n_layers):
        layer_weights, layer_quantized, layer_eps = _layer(g, groups[4 * i: 4 * i + 4], stop, io, i, heads, kv_heads,
                                                           head_dim, interleaved, f"{source} layer {i}")
        weights.update(layer_weights)
        quantized.update(layer_quantized)
        eps_seen |= layer_eps
    has_bias = any(k.endswith(".bias") for k in weights)
    (head,) = groups[-1] if len(groups[-1]) == 1 else (None,)
    if head is None or head.weight.shape != (vocab, hidden) or io.logits not in _reach(g, head.out, stop)[0]:
        raise UnsupportedModelError(f"{source}: the last linear is not an lm_head producing {io.logits}")
    final_w, eps3 = _rms_norm(g, head.x, f"{source} final norm")
    eps_seen.add(eps3)
    weights["model.norm.weight"] = final_w
    tied = bool(np.array_equal(head.weight, embed))
    if not tied:
        weights["lm_head.weight"] = head.weight
        if head.table is not None and head.table.bits == 4:
            quantized["lm_head.weight"] = (QTYPE, head.table, head.table.shape)
    q_rows = weights["model.layers.0.self_attn.q_proj.weight"].shape[0]
    k_rows = weights["model.layers.0.self_attn.k_proj.weight"].shape[0]
    if q_rows % head_dim or k_rows % head_dim:
        raise UnsupportedModelError(f"{source}: q/k rows {q_rows}/{k_rows} are not multiples of the RoPE head dim {head_dim}")
    window = _sliding_window(hf, gqa, genai)
    cfg = _config(genai, hf, source, vocab=vocab, hidden=hidden, ffn=weights["model.layers.0.mlp.up_proj.weight"].shape[0],
                  layers=n_layers, heads=q_rows // head_dim, kv_heads=k_rows // head_dim, head_dim=head_dim,
                  eps=max(eps_seen), bias=has_bias, tied=tied, inv=inv)
    if cfg.attention_bias:  # qwen2 without biases in the graph: zero biases
        for i in range(n_layers):
            for name in ("q_proj", "k_proj", "v_proj"):
                key = f"model.layers.{i}.self_attn.{name}.bias"
                weights.setdefault(key, np.zeros(weights[key.replace("bias", "weight")].shape[0], np.float32))
    if window is not None:
        # PerfX attention has no sliding-window mask: it is exact while the context fits in the window.
        cfg.max_context = min(cfg.max_context, window)
        if max_context is not None and max_context > window:
            raise UnsupportedModelError(
                f"{source}: a context of {max_context} tokens exceeds the model's sliding window of {window}; "
                f"PerfX attention has no sliding-window mask, so it is exact only up to {window} tokens: "
                f"use --max-context {window} or less"
            )
    if max_context is not None:
        cfg.max_context = int(max_context)
    from perfx_compiler.model.hf import _add_stop_tokens, _tokenizer_files

    tok_json, template = _tokenizer_files(folder, cfg)
    if tok_json is not None:
        _add_stop_tokens(cfg, tok_json)
    desc = ModelDescription(config=cfg, weights=weights, tokenizer_json=tok_json, chat_template=template, source=source,
                            quantized=quantized)
    desc.validate()
    return desc


def _layer(
    g: OnnxGraph, groups: list[list[Linear]], stop: set[str], io: DecoderIO, i: int, heads: int | None,
    kv_heads: int | None, head_dim: int, interleaved: bool, where: str,
) -> tuple[dict[str, np.ndarray], dict[str, tuple[str, NBitsTable, tuple[int, int]]], set[float]]:
    """One decoder layer's weights in HF names (q/k rows un-permuted when RoPE is interleaved), its int4
    MatMulNBits tables, and the RMSNorm epsilons it uses."""
    p = f"model.layers.{i}."
    attn, o, mlp, down = groups
    q_size = heads * head_dim if heads else None
    kv_size = kv_heads * head_dim if kv_heads else None
    q, k, v = _split_qkv(attn, g, stop, io, i, q_size, kv_size, where)
    if len(o) != 1 or len(down) != 1 or len(mlp) != 2:
        raise UnsupportedModelError(f"{where}: linears are not q/k/v -> o -> gate/up -> down (SwiGLU)")
    gate = next((lin for lin in mlp if _feeds_silu(g, lin.out)), None)
    if gate is None:
        raise UnsupportedModelError(f"{where}: the MLP has no SiLU-gated projection (only SwiGLU MLPs are supported)")
    up = mlp[1] if gate is mlp[0] else mlp[0]
    for lin, name in ((o[0], "o_proj"), (gate, "gate_proj"), (up, "up_proj"), (down[0], "down_proj")):
        if lin.bias is not None and np.any(lin.bias):
            raise UnsupportedModelError(f"{where}: {name} has a bias, which Llama/Qwen2 models do not")
    w_in, eps1 = _rms_norm(g, attn[0].x, f"{where} attention")
    w_post, eps2 = _rms_norm(g, mlp[0].x, f"{where} MLP")
    qw, kw = q.weight, k.weight
    qt, kt = q.table, k.table
    if interleaved:
        from perfx_compiler.model.gguf import unpermute_qk

        qw, kw = unpermute_qk(qw, qw.shape[0] // head_dim), unpermute_qk(kw, kw.shape[0] // head_dim)
        # the same row permutation moves whole quantized rows
        qt = None if qt is None else qt.rows(unpermute_qk(np.arange(qw.shape[0]), qw.shape[0] // head_dim))
        kt = None if kt is None else kt.rows(unpermute_qk(np.arange(kw.shape[0]), kw.shape[0] // head_dim))
    quantized: dict[str, tuple[str, NBitsTable, tuple[int, int]]] = {}
    for name, table in (("self_attn.q_proj", qt), ("self_attn.k_proj", kt), ("self_attn.v_proj", v.table),
                        ("self_attn.o_proj", o[0].table), ("mlp.gate_proj", gate.table),
                        ("mlp.up_proj", up.table), ("mlp.down_proj", down[0].table)):
        if table is not None and table.bits == 4:
            quantized[f"{p}{name}.weight"] = (QTYPE, table, table.shape)
    weights = {
        p + "input_layernorm.weight": w_in, p + "post_attention_layernorm.weight": w_post,
        p + "self_attn.q_proj.weight": qw, p + "self_attn.k_proj.weight": kw,
        p + "self_attn.v_proj.weight": v.weight, p + "self_attn.o_proj.weight": o[0].weight,
        p + "mlp.gate_proj.weight": gate.weight, p + "mlp.up_proj.weight": up.weight,
        p + "mlp.down_proj.weight": down[0].weight,
    }
    if any(lin.bias is not None for lin in (q, k, v)):
        for lin, name in ((q, "q_proj"), (k, "k_proj"), (v, "v_proj")):
            b = lin.bias if lin.bias is not None else np.zeros(lin.weight.shape[0], np.float32)
            if interleaved and name != "v_proj":
                from perfx_compiler.model.gguf import unpermute_qk

                b = unpermute_qk(b[:, None], b.shape[0] // head_dim)[:, 0]
            weights[p + f"self_attn.{name}.bias"] = b
    return weights, quantized, {eps1, eps2}


def _sliding_window(hf: dict[str, Any], gqa: onnx.NodeProto | None, genai: dict[str, Any] | None) -> int | None:
    """The attention window in tokens (Mistral's ``sliding_window``, Qwen2's when
    ``use_sliding_window``, GroupQueryAttention's ``local_window_size``, genai_config's
    ``decoder.sliding_window.window_size``), or None."""
    windows = []
    gw = ((genai or {}).get("model", {}).get("decoder", {}).get("sliding_window") or {})
    if isinstance(gw, dict) and isinstance(gw.get("window_size"), int) and gw["window_size"] > 0:
        windows.append(int(gw["window_size"]))
    if gqa is not None and int_attr(gqa, "local_window_size", -1) > 0:
        windows.append(int_attr(gqa, "local_window_size"))
    w = hf.get("sliding_window")
    if isinstance(w, int) and w > 0 and hf.get("use_sliding_window", hf.get("model_type") != "qwen2"):
        windows.append(w)
    return min(windows) if windows else None


def _feeds_silu(g: OnnxGraph, name: str) -> bool:
    for n in g.consumers.get(name, []):
        if n.op_type == "Sigmoid":
            return any(m.op_type == "Mul" and name in m.input for m in g.consumers.get(n.output[0], []))
        if n.op_type in ("Silu", "QuickGelu") and (n.op_type == "Silu" or float_attr(n, "alpha", 1.702) == 1.0):
            return True
    return False


def _config(genai: dict[str, Any] | None, hf: dict[str, Any], source: str, *, vocab: int, hidden: int, ffn: int,
            layers: int, heads: int, kv_heads: int, head_dim: int, eps: float, bias: bool, tied: bool,
            inv: np.ndarray) -> ModelConfig:
    from perfx_compiler.model.families import family_for_hf_class
    from perfx_compiler.model.gguf import DEFAULT_MAX_CONTEXT

    gm = (genai or {}).get("model", {})
    if gm.get("type"):
        arch = _GENAI_TYPES.get(str(gm["type"]))
        if arch is None:
            raise UnsupportedModelError(f"{source}: onnxruntime-genai model type '{gm['type']}' is not supported "
                                        f"(PerfX reads {', '.join(_GENAI_TYPES)})")
    elif hf.get("architectures"):
        family = family_for_hf_class(hf["architectures"][0])
        arch = family.name if family is not None and family.name in ("llama", "mistral", "qwen2") else (
            "qwen2" if bias else "llama")
    else:
        arch = "qwen2" if bias else "llama"
    theta, factor = fit_rope(inv)
    scaling = hf.get("rope_scaling") or None
    if scaling is None and abs(factor - 1.0) > 1e-4:
        scaling = {"rope_type": "linear", "factor": factor}
    if scaling:
        scaling = dict(scaling)
        scaling.setdefault("rope_type", scaling.pop("type", None))
        theta = float(hf.get("rope_theta", theta))
    ctx = int(gm.get("context_length") or hf.get("max_position_embeddings") or DEFAULT_MAX_CONTEXT)
    eos = gm.get("eos_token_id", hf.get("eos_token_id"))
    eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else [])]
    bos = gm.get("bos_token_id", hf.get("bos_token_id"))
    cfg = ModelConfig(
        architecture=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=eps, rope_theta=theta,
        rope_scaling=scaling, max_context=min(ctx, DEFAULT_MAX_CONTEXT), tie_word_embeddings=tied,
        attention_bias=bias or arch == "qwen2", bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_ids, name=str(hf.get("_name_or_path") or Path(source).parent.name or Path(source).stem),
    )
    want = rope_inv_freq(cfg)
    if want.shape != inv.shape or np.max(np.abs(want - inv) / want) > 1e-3:
        raise UnsupportedModelError(
            f"{source}: the graph's RoPE frequencies do not follow theta^(-2i/d) (scaled RoPE?); "
            "put the model's config.json with rope_theta/rope_scaling next to the .onnx file"
        )
    return cfg


def load_foreign_onnx(model: onnx.ModelProto, path: str | Path, max_context: int | None = None) -> ModelDescription:
    """``load_onnx`` for graphs PerfX did not emit: one error naming every operator PerfX cannot
    import (with node names and opset), else the recognised decoder's description."""
    from perfx_compiler.frontend.contrib_ops import CONTRIB_CONVERTERS
    from perfx_compiler.frontend.onnx_import import _unsupported_message, unsupported_ops

    if model.functions:
        import onnx.inliner

        model = onnx.inliner.inline_local_functions(model)
    found = unsupported_ops(model, CONTRIB_CONVERTERS)
    if found:
        raise UnsupportedModelError(_unsupported_message(found, str(path)))
    return graph_to_description(model, path, max_context)
