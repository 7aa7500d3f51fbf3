"""Recognise a decoder (any family in ``model/families/``) in a third-party ONNX graph and rebuild
its ModelDescription, equal to the one the model's Hugging Face folder gives.

The graph's *structure* is matched, not its names (``torch.onnx`` dynamo exports constant-fold
every linear weight into an anonymous pre-transposed initializer):

* embedding: ``Gather(table, input_ids)``;
* linears: ``MatMul(x, W)``, ``MatMul(x, Transpose(W))``, ``Gemm``, or com.microsoft
  ``MatMulNBits`` (blocks dequantized exactly, see ``contrib_ops``; int4 ones are also kept as
  ``NBitsTable``s in ``ModelDescription.quantized`` for ``passes/onnx_int4_passthrough``), each with an
  optional bias ``Add``; linears sharing one input form a group, and a layer is four groups
  in graph order: q/k/v (or one packed qkv) -> o -> gate/up -> down; the last linear is lm_head;
* q vs k vs v: which KV output (``present.N.key`` / ``.value``) or attention-op input a
  linear's result reaches without passing another linear; gate vs up: which one feeds the activation
  (a fused gate_up: which half of its Split does);
* RMSNorms feeding each group: ``SimplifiedLayerNormalization``, ``SkipSimplifiedLayerNormalization``,
  ``RMSNormalization`` or the ``Pow -> ReduceMean -> Add(eps) -> Sqrt -> Reciprocal -> Mul -> Mul(w)``
  chain (its weight and epsilon);
* RoPE: the ``inv_freq`` constant (torch) or the cos/sin caches of ``GroupQueryAttention`` /
  ``RotaryEmbedding`` (genai), fitted to ``theta^(-2i/d)`` (optionally / a linear factor);
  interleaved and partial rotary are brought to the kernels' layout by reordering Q/K rows (and
  their int4 tables' rows; ``families._family.qk_row_order``); a partial rotary's head dim comes from
  the KV cache inputs' shape;
* features (``graph_features``): QK-norm, sandwich norms, tanh-GELU, soft-caps, embedding and
  query scales, fused qkv / gate_up projections; ``onnx_families`` checks them against the family
  config.json names and takes from it what a graph cannot show (sliding layers, window, the local
  RoPE base); anything the reader cannot place is refused in one line;
* sliding windows: a family's (Mistral, Qwen2, Phi-3, Gemma) from its config.json, per layer as the
  HF reader has them; an onnxruntime-genai model's (``decoder.sliding_window``, GQA
  ``local_window_size``) cap the context at the window, and a longer ``max_context`` is refused.

Config values the graph cannot give (context length, BOS/EOS, architecture name) come from
``genai_config.json`` or ``config.json`` in the model's folder; the tokenizer from its
``tokenizer.json`` / ``tokenizer_config.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from perfx_compiler.errors import ModelFormatError, UnsupportedModelError
from perfx_compiler.model.description import ModelConfig, ModelDescription, rope_inv_freq
from perfx_compiler.model.families._family import Family, HFConfig, qk_row_order
from perfx_compiler.model.foreign_onnx.decoder_io import DecoderIO, read_genai_config, recognize_io
from perfx_compiler.model.foreign_onnx.families import check_without_config, hf_family, reconcile
from perfx_compiler.model.foreign_onnx.graph_features import (
    attention_scores,
    embedding_scale,
    gate_activation,
    interleaved_rope,
    norm_after,
    softcap_after,
    unexplained,
)
from perfx_compiler.model.foreign_onnx.nbits import NBitsTable, float_attr, int_attr
from perfx_compiler.model.foreign_onnx.onnx_graph import Linear, OnnxGraph, f32, linear_at, reach, rms_norm
from perfx_compiler.model.foreign_onnx.rope_fit import fit_rope, local_inv_freq_of, rope_inv_freq_of

_GENAI_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
QTYPE = "MatMulNBits"  # ModelDescription.quantized type of a MatMulNBits table (GGUF's are ggml type names)


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
        lin = linear_at(g, n)
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
        outs, sinks = reach(g, lin.out, stop)
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


def _kv_shape(model: onnx.ModelProto, io: DecoderIO) -> tuple[int | None, int | None]:
    """(kv heads, head dim) from the past key input's static shape [batch, kv_heads, past, head_dim]."""
    if not io.has_cache:
        return None, None
    for v in model.graph.input:
        if v.name == io.past_keys[0]:
            dims = v.type.tensor_type.shape.dim
            if len(dims) == 4 and dims[1].HasField("dim_value") and dims[3].HasField("dim_value"):
                return int(dims[1].dim_value), int(dims[3].dim_value)
    return None, None


@dataclass
class _Layer:
    weights: dict[str, np.ndarray]
    quantized: dict[str, tuple[str, NBitsTable, tuple[int, int]]]
    eps: set[float]
    qk_norm: bool
    sandwich: bool
    activation: str

    @property
    def norms(self) -> int:
        return 2 + 2 * self.qk_norm + 2 * self.sandwich


def graph_to_description(model: onnx.ModelProto, path: str | Path, max_context: int | None = None) -> ModelDescription:
    """Rebuild the ModelDescription of a decoder graph (weights loaded); ``max_context`` overrides
    the KV cache length (checked against a Llama-family sliding window)."""
    path = Path(path)
    source, folder = str(path), path.parent
    genai = read_genai_config(folder)
    hf = _folder_config(folder)
    family = None if genai else hf_family(hf, source)  # refuses a family the reader does not recover
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
    embed = f32(g.const(emb.input[0]))
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
    interleaved = interleaved or interleaved_rope(g)
    kv_from_io, head_dim = _kv_shape(model, io)
    head_dim = head_dim or 2 * len(inv)
    kv_heads = kv_heads or kv_from_io
    if 2 * len(inv) > head_dim:
        raise UnsupportedModelError(f"{source}: RoPE rotates {2 * len(inv)} dims of a {head_dim}-dim head")
    rotary = 2 * len(inv) if 2 * len(inv) < head_dim else 0
    if heads is None and kv_heads and len(groups[0]) == 1:  # packed QKV: the q rows are what k and v leave
        heads = (groups[0][0].weight.shape[0] - 2 * kv_heads * head_dim) // head_dim
    if heads is not None:
        q_rows = sum(lin.weight.shape[0] for lin in groups[0])
        if q_rows != (heads + 2 * kv_heads) * head_dim and len(groups[0]) == 1:  # partial rotary or odd packing
            raise UnsupportedModelError(f"{source}: QKV rows {q_rows} do not match {heads}/{kv_heads} heads x {head_dim}")
    weights: dict[str, np.ndarray] = {"model.embed_tokens.weight": embed}
    # MatMulNBits weights as the file stores them (ModelDescription.quantized, for the int4 passthrough)
    quantized: dict[str, tuple[str, NBitsTable, tuple[int, int]]] = {}
    eps_seen: set[float] = set()
    layers: list[_Layer] = []
    for i in range(n_layers):
        layer = _layer(g, groups[4 * i: 4 * i + 4], stop, io, i, heads, kv_heads, head_dim, rotary, interleaved,
                       f"{source} layer {i}")
        weights.update(layer.weights)
        quantized.update(layer.quantized)
        eps_seen |= layer.eps
        layers.append(layer)
    has_bias = any(k.endswith(".bias") for k in weights)
    (head,) = groups[-1] if len(groups[-1]) == 1 else (None,)
    if head is None or head.weight.shape != (vocab, hidden) or io.logits not in reach(g, head.out, stop)[0]:
        raise UnsupportedModelError(f"{source}: the last linear is not an lm_head producing {io.logits}")
    final_w, eps3 = rms_norm(g, head.x, f"{source} final norm")
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
        raise UnsupportedModelError(f"{source}: q/k rows {q_rows}/{k_rows} are not multiples of the head dim {head_dim}")
    gqa_scale = float_attr(gqa, "scale", 0.0) if gqa is not None else 0.0
    features = _graph_features(g, layers, emb.output[0], head.out, head_dim, rotary, gqa_scale, source)
    features["attention_bias"] = has_bias
    local = local_inv_freq_of(g)
    features["rope_local_theta"] = fit_rope(local)[0] if local is not None else 0.0
    if family is not None:
        features = reconcile(family, hf, {**features, "interleaved": interleaved}, head_dim, source)
    elif not genai:
        check_without_config(features, source)
    # a family's windows come from its config.json (reconcile); genai's and GroupQueryAttention's cap the context
    window = _sliding_window(gqa, genai) if family is None else None
    cfg = _config(genai, hf, family, source, vocab=vocab, hidden=hidden,
                  ffn=weights["model.layers.0.mlp.up_proj.weight"].shape[0], layers=n_layers, heads=q_rows // head_dim,
                  kv_heads=k_rows // head_dim, head_dim=head_dim, eps=max(eps_seen), tied=tied, inv=inv,
                  features=features)
    if cfg.attention_bias:  # qwen2 without biases in the graph: zero biases
        for i in range(n_layers):
            for name in ("q_proj", "k_proj", "v_proj"):
                key = f"model.layers.{i}.self_attn.{name}.bias"
                weights.setdefault(key, np.zeros(weights[key.replace("bias", "weight")].shape[0], np.float32))
    if window is not None:
        # read as before per-layer windows existed: exact while the context fits in the window
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
    template = template or (family.chat_template if family is not None else None)
    if tok_json is not None:
        _add_stop_tokens(cfg, tok_json)
    desc = ModelDescription(config=cfg, weights=weights, tokenizer_json=tok_json, chat_template=template, source=source,
                            quantized=quantized)
    desc.validate()
    return desc


def _graph_features(g: OnnxGraph, layers: list[_Layer], emb_out: str, head_out: str, head_dim: int, rotary: int,
                    gqa_scale: float, source: str) -> dict[str, Any]:
    """The ModelConfig features the graph's structure shows; structure it cannot place: refused."""
    first = layers[0]
    for i, layer in enumerate(layers):
        if (layer.qk_norm, layer.sandwich, layer.activation) != (first.qk_norm, first.sandwich, first.activation):
            raise UnsupportedModelError(f"{source}: layer {i} differs from layer 0 in its norms or activation; "
                                        "PerfX runs decoders whose layers share one structure")
    scores = attention_scores(g)
    softmax = sum(n.op_type == "Softmax" for n in g.nodes)
    if (scores or softmax) and not len(scores) == softmax == len(layers):
        raise UnsupportedModelError(f"{source}: {len(scores)} recognised attention score blocks, {softmax} Softmax "
                                    f"nodes, {len(layers)} layers: the attention is not the MatMul -> scale -> "
                                    "Softmax the reader knows; compile the model's Hugging Face folder or GGUF instead")
    # genai's attention op carries its scale (0: 1/sqrt(head_dim))
    scales = {round(s.scale, 9) for s in scores} or {gqa_scale or head_dim ** -0.5}
    caps = {s.softcap for s in scores} or {0.0}
    if len(scales) != 1 or len(caps) != 1:
        raise UnsupportedModelError(f"{source}: the layers scale or soft-cap their attention scores differently")
    scale = float(next(iter(scales)))
    if not 0 < scale < float("inf"):
        raise UnsupportedModelError(f"{source}: the attention scores are scaled by {scale}; the file is not a decoder "
                                    "PerfX reads")
    power = 1.0 / scale ** 2  # the scale is 1/sqrt(n) for a round n (head_dim, Gemma's query_pre_attn_scalar)
    if abs(power - round(power)) < 1e-4 * power:
        scale = float(round(power)) ** -0.5
    final = softcap_after(g, head_out)
    features: dict[str, Any] = {
        "qk_norm": first.qk_norm, "sandwich_norms": first.sandwich, "mlp_activation": first.activation,
        "embedding_scale": embedding_scale(g, emb_out), "query_scale": 0.0 if scale == head_dim ** -0.5 else scale,
        "attn_softcap": next(iter(caps)), "final_softcap": final[0] if final else 0.0, "rotary_dim": rotary,
    }
    odd = unexplained(g, layers=len(layers), norms=1 + sum(x.norms for x in layers), activation=first.activation,
                      attn_softcap=bool(features["attn_softcap"]), final_softcap=bool(features["final_softcap"]))
    if odd:
        raise UnsupportedModelError(f"{source}: the graph has structure the ONNX reader does not account for "
                                    f"({'; '.join(odd)}); compile the model's Hugging Face folder or GGUF instead")
    return features


def _layer(
    g: OnnxGraph, groups: list[list[Linear]], stop: set[str], io: DecoderIO, i: int, heads: int | None,
    kv_heads: int | None, head_dim: int, rotary: int, interleaved: bool, where: str,
) -> _Layer:
    """One decoder layer's weights in canonical names and layout (Q/K rows in the kernels' RoPE order),
    its int4 MatMulNBits tables, the RMSNorm epsilons it uses and its structure."""
    p = f"model.layers.{i}."
    attn, o, mlp, down = groups
    q_size = heads * head_dim if heads else None
    kv_size = kv_heads * head_dim if kv_heads else None
    q, k, v = _split_qkv(attn, g, stop, io, i, q_size, kv_size, where)
    if len(o) != 1 or len(down) != 1 or len(mlp) not in (1, 2):
        raise UnsupportedModelError(f"{where}: linears are not q/k/v -> o -> gate/up -> down (a gated MLP)")
    gate, up, activation = _gate_up(g, mlp, where)
    for lin, name in ((o[0], "o_proj"), (gate, "gate_proj"), (up, "up_proj"), (down[0], "down_proj")):
        if lin.bias is not None and np.any(lin.bias):
            raise UnsupportedModelError(f"{where}: {name} has a bias, which PerfX's decoders do not")
    w_in, eps1 = rms_norm(g, attn[0].x, f"{where} attention")
    w_post, eps2 = rms_norm(g, mlp[0].x, f"{where} MLP")
    eps = {eps1, eps2}
    layout = "interleaved" if interleaved else "rotate_half"
    q_order = qk_row_order(q.weight.shape[0] // head_dim, head_dim, rotary, layout)
    k_order = qk_row_order(k.weight.shape[0] // head_dim, head_dim, rotary, layout)
    norm_order = qk_row_order(1, head_dim, rotary, layout)

    def rows(a: np.ndarray | None, order: np.ndarray | None) -> np.ndarray | None:
        return a if a is None or order is None else np.ascontiguousarray(a[order])

    qt = q.table if q.table is None or q_order is None else q.table.rows(q_order)  # moves whole quantized rows
    kt = k.table if k.table is None or k_order is None else k.table.rows(k_order)
    quantized: dict[str, tuple[str, NBitsTable, tuple[int, int]]] = {}
    for name, table in (("self_attn.q_proj", qt), ("self_attn.k_proj", kt), ("self_attn.v_proj", v.table),
                        ("self_attn.o_proj", o[0].table), ("mlp.gate_proj", gate.table),
                        ("mlp.up_proj", up.table), ("mlp.down_proj", down[0].table)):
        if table is not None and table.bits == 4:
            quantized[f"{p}{name}.weight"] = (QTYPE, table, table.shape)
    weights = {
        p + "input_layernorm.weight": w_in, p + "post_attention_layernorm.weight": w_post,
        p + "self_attn.q_proj.weight": rows(q.weight, q_order), p + "self_attn.k_proj.weight": rows(k.weight, k_order),
        p + "self_attn.v_proj.weight": v.weight, p + "self_attn.o_proj.weight": o[0].weight,
        p + "mlp.gate_proj.weight": gate.weight, p + "mlp.up_proj.weight": up.weight,
        p + "mlp.down_proj.weight": down[0].weight,
    }
    if any(lin.bias is not None for lin in (q, k, v)):
        for lin, name, order in ((q, "q_proj", q_order), (k, "k_proj", k_order), (v, "v_proj", None)):
            b = lin.bias if lin.bias is not None else np.zeros(lin.weight.shape[0], np.float32)
            weights[p + f"self_attn.{name}.bias"] = rows(b, order)
    # per-head norms on q and k (not for a packed QKV: its outputs are sliced apart first)
    qn, kn = (norm_after(g, q.out), norm_after(g, k.out)) if len(attn) == 3 else (None, None)
    qk_norm = qn is not None and kn is not None and qn.weight.size == kn.weight.size == head_dim
    if (qn is not None or kn is not None) and not qk_norm:
        raise UnsupportedModelError(f"{where}: a norm on q or k that is not a per-head RMSNorm on both")
    if qk_norm:
        weights[p + "self_attn.q_norm.weight"] = rows(qn.weight, norm_order)
        weights[p + "self_attn.k_norm.weight"] = rows(kn.weight, norm_order)
        eps |= {qn.eps, kn.eps}
    # sandwich norms: on the attention and MLP outputs, before the residual add
    after_o, after_down = norm_after(g, o[0].out, hops=0), norm_after(g, down[0].out, hops=0)
    sandwich = after_o is not None and after_down is not None
    if (after_o is not None or after_down is not None) and not sandwich:
        raise UnsupportedModelError(f"{where}: a norm on only one of the attention and MLP outputs")
    if sandwich:
        weights[p + "attn_output_layernorm.weight"] = after_o.weight
        weights[p + "mlp_output_layernorm.weight"] = after_down.weight
        eps |= {after_o.eps, after_down.eps}
    return _Layer(weights, quantized, eps, qk_norm, sandwich, activation)


def _gate_up(g: OnnxGraph, mlp: list[Linear], where: str) -> tuple[Linear, Linear, str]:
    """(gate, up, activation) of a gated MLP: two linears, or one fused [gate; up] split in two halves."""
    if len(mlp) == 2:
        acts = [gate_activation(g, lin.out) for lin in mlp]
        if sum(a is not None for a in acts) != 1:
            raise UnsupportedModelError(f"{where}: the MLP has no single gated projection (SwiGLU/GeGLU)")
        gi = 0 if acts[0] is not None else 1
        gate, up, act = mlp[gi], mlp[1 - gi], acts[gi]
    else:
        lin = mlp[0]
        half = lin.weight.shape[0] // 2
        split = next((n for n in g.consumers.get(lin.out, []) if n.op_type == "Split" and len(n.output) == 2), None)
        acts = [gate_activation(g, o) for o in split.output] if split is not None else [None, None]
        if lin.weight.shape[0] % 2 or sum(a is not None for a in acts) != 1:
            raise UnsupportedModelError(f"{where}: the one MLP input projection is not a fused gate/up in two halves")
        gi = 0 if acts[0] is not None else 1
        act = acts[gi]
        parts = []
        for a in (gi * half, (1 - gi) * half):
            s = slice(a, a + half)
            parts.append(Linear(lin.node, lin.x, lin.out, lin.weight[s], None if lin.bias is None else lin.bias[s],
                                None if lin.table is None else lin.table.rows(s)))
        gate, up = parts
    if act not in ("silu", "gelu_tanh"):
        raise UnsupportedModelError(f"{where}: the MLP gate's activation is {act}; PerfX runs SiLU and tanh-GELU gates")
    return gate, up, act


def _sliding_window(gqa: onnx.NodeProto | None, genai: dict[str, Any] | None) -> int | None:
    """The attention window in tokens of an onnxruntime-genai model (GroupQueryAttention's
    ``local_window_size``, genai_config's ``decoder.sliding_window.window_size``), or None."""
    windows = []
    gw = ((genai or {}).get("model", {}).get("decoder", {}).get("sliding_window") or {})
    if isinstance(gw, dict) and isinstance(gw.get("window_size"), int) and gw["window_size"] > 0:
        windows.append(int(gw["window_size"]))
    if gqa is not None and int_attr(gqa, "local_window_size", -1) > 0:
        windows.append(int_attr(gqa, "local_window_size"))
    return min(windows) if windows else None


def _nice(x: float) -> float:
    """The shortest decimal with the same float32 (an epsilon the graph stores as float32)."""
    for digits in range(1, 10):
        v = float(f"{x:.{digits}g}")
        if np.float32(v) == np.float32(x):
            return v
    return x


def _config(genai: dict[str, Any] | None, hf: dict[str, Any], family: Family | None, source: str, *, vocab: int,
            hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, head_dim: int, eps: float, tied: bool,
            inv: np.ndarray, features: dict[str, Any]) -> ModelConfig:
    from perfx_compiler.model.gguf import DEFAULT_MAX_CONTEXT

    gm = (genai or {}).get("model", {})
    bias = bool(features.get("attention_bias"))
    if gm.get("type"):
        arch = _GENAI_TYPES.get(str(gm["type"]))
        if arch is None:
            raise UnsupportedModelError(f"{source}: onnxruntime-genai model type '{gm['type']}' is not supported "
                                        f"(PerfX reads {', '.join(_GENAI_TYPES)})")
    elif family is not None:
        arch = family.name
    else:
        arch = "qwen2" if bias else "llama"
    theta, factor = fit_rope(inv)
    c = HFConfig(hf)
    scaling = c.rope_scaling() if hf else None
    if scaling is None and abs(factor - 1.0) > 1e-4:
        scaling = {"rope_type": "linear", "factor": factor}
    if scaling:
        theta = float(c.rope().get("rope_theta", theta))
    elif "rope_theta" in c.rope() and abs(float(c.rope()["rope_theta"]) - theta) <= 1e-3 * theta:
        theta = float(c.rope()["rope_theta"])
    if isinstance(hf.get("rms_norm_eps"), float) and np.float32(hf["rms_norm_eps"]) == np.float32(eps):
        eps = float(hf["rms_norm_eps"])
    ctx = int(gm.get("context_length") or hf.get("max_position_embeddings") or DEFAULT_MAX_CONTEXT)
    eos = gm.get("eos_token_id", hf.get("eos_token_id"))
    eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else [])]
    bos = gm.get("bos_token_id", hf.get("bos_token_id"))
    cfg = ModelConfig(
        architecture=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=_nice(eps), rope_theta=theta,
        rope_scaling=scaling, max_context=min(ctx, DEFAULT_MAX_CONTEXT), tie_word_embeddings=tied,
        bos_token_id=int(bos) if bos is not None else None, eos_token_ids=eos_ids,
        name=str(hf.get("_name_or_path") or Path(source).parent.name or Path(source).stem),
        **{**features, "attention_bias": bias or arch == "qwen2"},
    )
    want = rope_inv_freq(cfg)[: len(inv)]
    if np.max(np.abs(want - inv) / want) > 1e-3:
        raise UnsupportedModelError(
            f"{source}: the graph's RoPE frequencies do not follow theta^(-2i/d) (scaled RoPE?); "
            "put the model's config.json with rope_theta/rope_scaling next to the .onnx file"
        )
    return cfg


def load_foreign_onnx(model: onnx.ModelProto, path: str | Path, max_context: int | None = None) -> ModelDescription:
    """``load_onnx`` for graphs PerfX did not emit: one error naming every operator PerfX cannot
    import (with node names and opset), else the recognised decoder's description."""
    from perfx_compiler.model.onnx_ops import unsupported_message, unsupported_ops

    if model.functions:
        import onnx.inliner

        model = onnx.inliner.inline_local_functions(model)
    found = unsupported_ops(model)
    if found:
        raise UnsupportedModelError(unsupported_message(found, str(path)))
    return graph_to_description(model, path, max_context)
