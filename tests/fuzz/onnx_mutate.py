"""Seeded mutations of an ONNX model: bytes (truncate, flip, flips aimed at a node's or metadata
entry's own bytes) and structure (nodes and initializers dropped or renamed, wrong shapes and
element types, operators PerfX does not know, attributes out of range, broken PerfX metadata)."""

from __future__ import annotations

import json

import numpy as np
import onnx

# kind -> cases per base model
KINDS = {
    "truncate": 8, "flip": 8, "flip_structure": 10, "drop_node": 6, "rename_edge": 6, "unsupported_op": 4,
    "drop_initializer": 5, "rename_initializer": 4, "wrong_shape": 6, "wrong_dtype": 5, "attribute": 6,
    "graph_io": 4, "opset": 3, "metadata": 10,
}
_WEIRD_INTS = [0, -1, 1, 3, 7, 1 << 31, -(1 << 40), 1 << 62]


def _pick(rng: np.random.Generator, seq: list) -> object:
    return seq[int(rng.integers(len(seq)))]


def _broken_config(rng: np.random.Generator, text: str) -> str:
    """perfx.config (ModelConfig JSON) with one field broken, or not a JSON object at all."""
    choice = int(rng.integers(6))
    if choice == 0:
        return text[: int(rng.integers(0, len(text)))]  # torn JSON
    if choice == 1:
        return _pick(rng, ["[]", "null", "42", '"llama"', "{}", "{\"vocab_size\": 300}"])  # type: ignore[return-value]
    cfg = json.loads(text)
    key = _pick(rng, sorted(cfg))
    if choice == 2:
        del cfg[key]
    elif choice == 3:
        cfg[key] = _pick(rng, ["x", None, [1, 2], {"a": 1}, True, 1.5])
    else:
        cfg[key] = _pick(rng, _WEIRD_INTS + [1e308, float("nan")])
    return json.dumps(cfg)


def mutate(model: onnx.ModelProto, kind: str, seed: int) -> bytes:
    """Serialized bytes of one mutated copy of ``model``, drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    if kind in ("truncate", "flip", "flip_structure"):
        data = bytearray(m.SerializeToString())
        if kind == "truncate":
            return bytes(data[: int(rng.integers(0, len(data)))])
        if kind == "flip":
            lo, hi = 0, len(data)
        else:  # inside one node's or one metadata entry's bytes (random flips mostly hit weights)
            part = _pick(rng, list(g.node) + list(m.metadata_props) + list(g.input) + list(g.output))
            blob = part.SerializeToString()  # type: ignore[attr-defined]
            lo = bytes(data).find(blob)
            hi = lo + min(len(blob), 4096)
        for _ in range(int(rng.integers(1, 4))):
            data[int(rng.integers(lo, hi))] ^= int(rng.integers(1, 256))
        return bytes(data)
    if kind == "drop_node":
        del g.node[int(rng.integers(len(g.node)))]
    elif kind == "rename_edge":
        node = _pick(rng, [n for n in g.node if n.input])
        slot = int(rng.integers(len(node.input)))  # type: ignore[attr-defined]
        node.input[slot] = _pick(rng, ["nonexistent", "", node.output[0]])  # type: ignore[attr-defined]
    elif kind == "unsupported_op":
        node = _pick(rng, list(g.node))
        if rng.random() < 0.5:
            node.op_type = _pick(rng, ["FancyOp", "Loop", "NonMaxSuppression", "Scan"])  # type: ignore[attr-defined]
        else:
            node.domain = "example.unknown"  # type: ignore[attr-defined]
    elif kind == "drop_initializer":
        del g.initializer[int(rng.integers(len(g.initializer)))]
    elif kind == "rename_initializer":
        _pick(rng, list(g.initializer)).name += "_renamed"  # type: ignore[attr-defined]
    elif kind == "wrong_shape":
        t = _pick(rng, list(g.initializer))
        dims = list(t.dims)  # type: ignore[attr-defined]
        new = _pick(rng, [dims[::-1], dims + [1], dims[:-1], [d * 2 for d in dims], [0] * max(1, len(dims)), [-1, 3]])
        del t.dims[:]  # type: ignore[attr-defined]
        t.dims.extend(new)  # type: ignore[attr-defined]
    elif kind == "wrong_dtype":
        t = _pick(rng, list(g.initializer))
        t.data_type = _pick(rng, [0, 2, 3, 8, 10, 16, 7, 999])  # type: ignore[attr-defined]
    elif kind == "attribute":
        attrs = [a for n in g.node for a in n.attribute if a.type == onnx.AttributeProto.INT]
        if attrs:
            _pick(rng, attrs).i = _pick(rng, _WEIRD_INTS)  # type: ignore[attr-defined]
        else:
            _pick(rng, list(g.node)).attribute.append(onnx.helper.make_attribute("axis", 99))  # type: ignore[attr-defined]
    elif kind == "graph_io":
        io = _pick(rng, [g.input, g.output])
        if rng.random() < 0.5:
            del io[int(rng.integers(len(io)))]  # type: ignore[arg-type]
        else:
            io[int(rng.integers(len(io)))].name = "renamed_io"  # type: ignore[index]
    elif kind == "opset":
        m.opset_import[0].version = _pick(rng, [1, 6, 99, 0])  # type: ignore[assignment]
    elif kind == "metadata":
        props = {p.key: p for p in m.metadata_props}
        if "perfx.config" in props:
            p = props[_pick(rng, ["perfx.config", "perfx.config", "perfx.config", "perfx.tokenizer"])]  # type: ignore[index]
            p.value = _broken_config(rng, p.value) if p.key == "perfx.config" else p.value[: len(p.value) // 3]
        else:  # a foreign graph: metadata a converter wrote, or a PerfX key on a graph PerfX did not emit
            m.metadata_props.add(key="perfx.config", value=_pick(rng, ["{", "{}", "[]", '{"vocab_size": "x"}']))  # type: ignore[arg-type]
    else:
        raise ValueError(kind)
    return m.SerializeToString()
