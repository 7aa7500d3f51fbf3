"""A (function-inlined) ONNX graph as producers, consumers and constants, and the building blocks
of a decoder found in it by structure: linear layers (``MatMul``/``Gemm``/``MatMulNBits`` + bias)
and RMSNorms (contrib ops or the ``Pow -> ReduceMean -> Add(eps) -> Sqrt -> Reciprocal -> Mul`` chain)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from perfx_compiler.errors import ModelFormatError, UnsupportedModelError
from perfx_compiler.model.foreign_onnx.nbits import NBitsTable, float_attr, int_attr, matmulnbits_table
from perfx_compiler.model.onnx_read import tensor_array

_PASS_THROUGH = ("Cast", "Identity")
_FOLDED = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide}
_ATTENTION_OPS = ("GroupQueryAttention", "MultiHeadAttention", "Attention", "RotaryEmbedding")


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
        """The value of an initializer / Constant output (through Cast/Identity and elementwise
        arithmetic on constants), else None."""
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
                    val = inner.astype(cast_dtype(n))
                else:
                    val = inner
            elif n.op_type in _FOLDED and len(n.input) == 2:
                # an export that did not fold (1 + w) norm weights and the like: evaluate it here
                a, b = self.const(n.input[0]), self.const(n.input[1])
                if a is not None and b is not None and a.dtype.kind == "f" and b.dtype.kind == "f":
                    val = _FOLDED[n.op_type](a, b).astype(np.result_type(a.dtype, b.dtype))
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


def cast_dtype(node: onnx.NodeProto) -> np.dtype:
    """The numpy type of a Cast's ``to`` (an unknown type number: a corrupt file)."""
    to = int_attr(node, "to")
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(to))
    except (KeyError, ValueError, TypeError):
        raise ModelFormatError(f"Cast '{node.name}' casts to unknown type {to}; the file is corrupt, re-export it") from None


def attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32))


def linear_at(g: OnnxGraph, node: onnx.NodeProto) -> Linear | None:
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
            if src is not None and src.ndim == 2 and attr(t, "perm", [1, 0]) == [1, 0]:
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
    return Linear(node, node.input[0], out, f32(w), None if bias is None else f32(bias), table)


def reach(g: OnnxGraph, start: str, stop: set[str], limit: int = 400) -> tuple[set[str], set[tuple[str, int]]]:
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


def rms_norm(g: OnnxGraph, x: str, where: str) -> tuple[np.ndarray, float]:
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
        return f32(w.reshape(-1)), float_attr(n, "epsilon", 1e-5)
    if n.op_type == "Mul":
        consts = [(i, g.const(i)) for i in n.input]
        ws = [(i, c) for i, c in consts if c is not None and c.size > 1]
        other = [i for i, c in consts if c is None]
        if len(ws) == 1 and len(other) == 1:
            eps = rms_chain_eps(g, other[0])
            if eps is not None:
                return f32(ws[0][1].reshape(-1)), eps
    raise UnsupportedModelError(
        f"{where}: input comes from {n.op_type} '{n.name}', not an RMSNorm "
        "(LayerNorm models and other norms are not supported)"
    )


def rms_chain_eps(g: OnnxGraph, normed: str) -> float | None:
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
            if src is not None and (src.op_type == "Pow" and scalar(g, src.input[1]) == 2.0
                                    or src.op_type == "Mul" and g.unwrap(src.input[0]) == g.unwrap(src.input[1])):
                has_square = True
            continue
        if n.op_type == "Add":
            c = [scalar(g, i) for i in n.input]
            if any(v is not None for v in c):
                eps = next(v for v in c if v is not None)
        if n.op_type in ("Mul", "Div", "Reciprocal", "Sqrt", "Add", "Rsqrt"):
            todo.extend(i for i in n.input if i and g.const(i) is None)
    return eps if (eps is not None and has_mean and has_square) else None


def scalar(g: OnnxGraph, name: str) -> float | None:
    c = g.const(name)
    return float(c.reshape(-1)[0]) if c is not None and c.size == 1 else None
