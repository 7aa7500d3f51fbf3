"""The decoder *features* a torch.onnx graph shows by its structure (``ModelConfig`` features, see
``model/description.py``), each read where the model computes it:

* norms after a tensor: QK-norm (per head, after the q/k projections), sandwich norms (on the
  attention and MLP outputs, before the residual add);
* the MLP gate's activation: SiLU (``Sigmoid`` + ``Mul`` or ``Silu``) or tanh-GELU (the
  ``0.5 x (1 + tanh(0.79788 (x + 0.044715 x^3)))`` chain, ``Gelu(approximate="tanh")``, ``FastGelu``);
* the attention scores between ``MatMul(q, k^T)`` and ``Softmax``: the scale and a soft-cap
  ``c * tanh(s / c)``; the same soft-cap after the lm_head;
* ``Mul(Gather(table, ids), c)``: the embedding scale;
* RoPE on interleaved pairs: ``Slice`` with step 2 (GLM);
* ``unexplained``: operators whose count the recognised features do not explain (an extra norm, a
  tanh, an exact GELU...), so that a decoder with something the reader does not know is refused
  instead of read without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from perfx_compiler.errors import UnsupportedModelError
from perfx_compiler.model.foreign_onnx.nbits import _attr
from perfx_compiler.model.foreign_onnx.onnx_graph import OnnxGraph, rms_norm, scalar

# ops that move or re-view a tensor without changing its values
_SHAPE_OPS = ("Reshape", "Transpose", "Cast", "Identity", "Unsqueeze", "Squeeze")
_NORM_OPS = ("SimplifiedLayerNormalization", "RMSNormalization", "SkipSimplifiedLayerNormalization")
GELU_TANH_C = 0.7978845608  # sqrt(2 / pi)


@dataclass
class Norm:
    weight: np.ndarray
    eps: float
    out: str


def norm_after(g: OnnxGraph, name: str, hops: int = 3) -> Norm | None:
    """The RMSNorm applied to ``name`` (looking through up to ``hops`` reshapes/transposes), if any."""
    frontier = [name]
    for _ in range(hops + 1):
        nxt = []
        for x in frontier:
            for n in g.consumers.get(x, []):
                cands = []
                if n.op_type in _NORM_OPS[:2] and n.input[0] == x:
                    cands = [n.output[0]]
                elif n.op_type == "Mul":  # x * rsqrt(mean(x^2) + eps), then * w
                    cands = [m.output[0] for m in g.consumers.get(n.output[0], []) if m.op_type == "Mul"]
                elif n.op_type in _SHAPE_OPS:
                    nxt.append(n.output[0])
                for out in cands:
                    try:
                        w, eps = rms_norm(g, out, "")
                    except UnsupportedModelError:
                        continue
                    return Norm(w, eps, out)
        frontier = nxt
    return None


def gate_activation(g: OnnxGraph, name: str) -> str | None:
    """The activation applied to the MLP gate ``name``: "silu", "gelu_tanh", "gelu" (exact), or None."""
    for n in g.consumers.get(name, []):
        if n.op_type == "Sigmoid" and any(m.op_type == "Mul" and name in m.input
                                          for m in g.consumers.get(n.output[0], [])):
            return "silu"
        if n.op_type == "Silu" or (n.op_type == "QuickGelu" and _attr(n, "alpha", 1.702) == 1.0):
            return "silu"
        if n.op_type == "FastGelu" or (n.op_type == "Gelu" and _attr(n, "approximate", b"none") in (b"tanh", "tanh")):
            return "gelu_tanh"
        if n.op_type in ("Gelu", "BiasGelu") or n.op_type == "Div" and _downstream(g, n.output[0], "Erf", 2):
            return "gelu"
        if n.op_type == "Pow" and scalar(g, n.input[1]) == 3.0 and _downstream(g, n.output[0], "Tanh", 4):
            return "gelu_tanh"
    return None


def _downstream(g: OnnxGraph, name: str, op: str, depth: int) -> bool:
    frontier = [name]
    for _ in range(depth):
        nodes = [n for x in frontier for n in g.consumers.get(x, [])]
        if any(n.op_type == op for n in nodes):
            return True
        frontier = [o for n in nodes for o in n.output]
    return False


def softcap_after(g: OnnxGraph, name: str) -> tuple[float, str] | None:
    """``c * tanh(name / c)`` applied to ``name``: (c, its output), else None."""
    users = g.consumers.get(name, [])
    if len(users) != 1 or users[0].op_type not in ("Div", "Mul") or users[0].input[0] != name:
        return None
    k = scalar(g, users[0].input[1])
    if k is None or k == 0:
        return None
    cap = k if users[0].op_type == "Div" else 1.0 / k
    tanh = g.consumers.get(users[0].output[0], [])
    if len(tanh) != 1 or tanh[0].op_type != "Tanh":
        return None
    mul = g.consumers.get(tanh[0].output[0], [])
    if len(mul) != 1 or mul[0].op_type != "Mul":
        return None
    other = [scalar(g, i) for i in mul[0].input if i != tanh[0].output[0]]
    if len(other) != 1 or other[0] is None or abs(other[0] - cap) > 1e-6 * abs(cap):
        return None
    return float(np.float32(cap)), mul[0].output[0]


@dataclass
class Scores:
    scale: float  # product of the constant factors on q.k (1.0: none found)
    softcap: float  # 0: none


def attention_scores(g: OnnxGraph) -> list[Scores]:
    """Per attention (graph order): what happens to ``MatMul(q, k^T)`` before its ``Softmax``."""
    found = []
    for mm in (n for n in g.nodes if n.op_type == "MatMul"):
        if any(g.const(i) is not None for i in mm.input):
            continue
        scale, cap, name = 1.0, 0.0, mm.output[0]
        for _ in range(8):
            users = g.consumers.get(name, [])
            if len(users) != 1:
                break
            n = users[0]
            if n.op_type == "Softmax":
                found.append(Scores(scale * _input_scales(g, mm), cap))
                break
            c = [scalar(g, i) for i in n.input if i != name]
            if n.op_type in ("Mul", "Div") and not cap and len(c) == 1 and c[0]:
                sc = softcap_after(g, name)
                if sc is not None:
                    cap, name = sc
                    continue
                scale = scale * c[0] if n.op_type == "Mul" else scale / c[0]
            elif n.op_type not in ("Add", "Cast", "Where") or not all(v is None for v in c):
                break
            name = n.output[0]
    return found


def _input_scales(g: OnnxGraph, mm: onnx.NodeProto) -> float:
    """Constant factors on q and k themselves (SDPA's decomposition scales both by sqrt(scale))."""
    out = 1.0
    for name in mm.input:
        for _ in range(3):
            n = g.producer.get(name)
            if n is None:
                break
            if n.op_type == "Mul":
                c = [scalar(g, i) for i in n.input]
                if sum(v is not None for v in c) == 1:
                    out *= next(v for v in c if v is not None)
                break
            if n.op_type not in _SHAPE_OPS:
                break
            name = n.input[0]
    return out


def embedding_scale(g: OnnxGraph, emb_out: str) -> float:
    """The constant the embedding rows are multiplied by (1.0: none)."""
    users = g.consumers.get(emb_out, [])
    if len(users) == 1 and users[0].op_type == "Mul":
        c = [scalar(g, i) for i in users[0].input if i != emb_out]
        if len(c) == 1 and c[0] is not None:
            return float(np.float32(c[0]))
    return 1.0


def interleaved_rope(g: OnnxGraph) -> bool:
    """Whether RoPE pairs neighbouring dims: the graph takes every other element (``x[..., 0::2]``)."""
    for n in g.nodes:
        if n.op_type == "Slice" and len(n.input) >= 5 and n.input[4]:
            steps = g.const(n.input[4])
            if steps is not None and steps.size == 1 and int(steps.reshape(-1)[0]) == 2:
                return True
    return False


def unexplained(g: OnnxGraph, *, layers: int, norms: int, activation: str, attn_softcap: bool,
                final_softcap: bool) -> list[str]:
    """Structure the recognised decoder does not explain, as phrases naming it (empty: none)."""
    count: dict[str, int] = {}
    for n in g.nodes:
        count[n.op_type] = count.get(n.op_type, 0) + 1
    out = []
    seen_norms = count.get("ReduceMean", 0) + sum(count.get(op, 0) for op in _NORM_OPS)
    if seen_norms > norms:
        out.append(f"{seen_norms - norms} more normalizations than the {norms} RMSNorms it placed")
    tanh = layers * (activation == "gelu_tanh") + layers * attn_softcap + final_softcap
    if count.get("Tanh", 0) != tanh:
        out.append(f"{count.get('Tanh', 0)} Tanh nodes where the recognised GELU/soft-capping explain {tanh} "
                   "(soft-capping or an activation it did not place)")
    for op, what in (("Erf", "exact (erf) GELU"), ("LayerNormalization", "LayerNorm"), ("Gelu", "GELU"),
                     ("Relu", "ReLU"), ("Elu", "ELU")):
        if count.get(op, 0) and not (op == "Gelu" and activation == "gelu_tanh"):
            out.append(f"{count[op]} {op} nodes ({what})")
    if count.get("Softmax", 0) > layers:
        out.append(f"{count['Softmax']} Softmax nodes for {layers} layers")
    return out
