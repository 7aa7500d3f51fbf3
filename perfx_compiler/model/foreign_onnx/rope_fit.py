"""RoPE parameters of a decoder graph: the inverse frequencies (from contrib ops' cos/sin caches,
an ``inv_freq`` constant, or an anonymous one before a Cos, as fp16 exports leave it) and the
``theta`` / linear factor that explain them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from perfx_compiler.errors import ModelFormatError, UnsupportedModelError
from perfx_compiler.model.foreign_onnx.nbits import _attr

if TYPE_CHECKING:
    from perfx_compiler.model.foreign_onnx.onnx_graph import OnnxGraph


def fit_rope(inv: np.ndarray) -> tuple[float, float]:
    """(theta, linear factor) with inv[i] = theta^(-2i/d) / factor, d = 2 * len(inv)."""
    d = 2 * len(inv)
    i = np.arange(len(inv), dtype=np.float64)
    slope, intercept = np.polyfit(2 * i / d, np.log(inv.astype(np.float64)), 1)
    theta, factor = float(np.exp(-slope)), float(np.exp(-intercept))
    # A round theta that explains the table to float16 precision (an fp16 export rounds inv_freq): take it.
    for digits in (1, 2, 3):
        nice = float(f"{theta:.{digits}g}")
        if np.max(np.abs(nice ** (-2 * i / d) - inv) / inv) <= 2.0 ** -10:
            return nice, 1.0
    for digits in (0, 1, 2):
        if abs(round(theta, digits) - theta) < 1e-4 * theta:
            theta = round(theta, digits)
            break
    if abs(factor - round(factor, 3)) < 1e-4 * factor:
        factor = round(factor, 3)
    return theta, factor


def inv_freq_from_tables(cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Per-column angular speed of cos/sin tables [positions, d/2]: slope of the unwrapped angle."""
    n = min(cos.shape[0], 64)
    ang = np.unwrap(np.arctan2(sin[:n].astype(np.float64), cos[:n].astype(np.float64)), axis=0)
    pos = np.arange(n, dtype=np.float64)
    return (pos @ ang) / (pos @ pos)


def rope_inv_freq_of(g: OnnxGraph, source: str) -> tuple[np.ndarray, bool]:
    """(inverse frequencies, interleaved?) from cos/sin caches of contrib ops or an inv_freq constant."""
    for n in g.nodes:
        if n.op_type in ("GroupQueryAttention", "RotaryEmbedding") and n.domain == "com.microsoft":
            if n.op_type == "GroupQueryAttention" and not _attr(n, "do_rotary", 0):
                continue
            idx = (7, 8) if n.op_type == "GroupQueryAttention" else (2, 3)
            if len(n.input) <= idx[1]:
                raise ModelFormatError(f"{source}: {n.op_type} '{n.name}' has {len(n.input)} inputs, no cos/sin "
                                       "caches; the file is corrupt, re-export it")
            cos, sin = g.const(n.input[idx[0]]), g.const(n.input[idx[1]])
            if cos is None or sin is None:
                raise UnsupportedModelError(f"{source}: {n.op_type} '{n.name}' has non-constant cos/sin caches")
            if cos.ndim != 2 or cos.shape != sin.shape or cos.shape[0] < 2 or cos.shape[1] < 1:
                raise ModelFormatError(f"{source}: {n.op_type} '{n.name}' cos/sin caches have shapes {cos.shape} and "
                                       f"{sin.shape} (want equal [positions, head_dim / 2]); the file is corrupt")
            return inv_freq_from_tables(cos, sin), bool(_attr(n, "interleaved" if n.op_type == "RotaryEmbedding"
                                                                 else "rotary_interleaved", 0))
    for name in _inv_freq_names(g, local=False):
        c = g.const(name)
        if c is not None and c.size > 1:
            return c.reshape(-1).astype(np.float64), False
    found = inv_freq_before_cos(g)
    if found is not None:
        return found, False
    raise UnsupportedModelError(f"{source}: no RoPE found (no inv_freq constant, no rotary cos/sin caches)")


def _inv_freq_names(g: OnnxGraph, local: bool) -> list[str]:
    """Names of ``inv_freq`` constants: the global ones, or (``local``) the sliding layers' (Gemma 3's
    ``sliding_attention_inv_freq``)."""
    names = [t.name for t in g.model.graph.initializer if "inv_freq" in t.name]
    names += [n.output[0] for n in g.nodes if n.op_type == "Constant" and "inv_freq" in n.output[0]]
    return [n for n in names if any(w in n for w in _LOCAL_WORDS) == local]


_LOCAL_WORDS = ("sliding", "local")


def local_inv_freq_of(g: OnnxGraph) -> np.ndarray | None:
    """The sliding layers' own inverse frequencies (a two-base model), else None."""
    for name in _inv_freq_names(g, local=True):
        c = g.const(name)
        if c is not None and c.size > 1:
            return c.reshape(-1).astype(np.float64)
    return None


def inv_freq_before_cos(g: OnnxGraph) -> np.ndarray | None:
    """An anonymous inverse-frequency constant (an fp16 export keeps it as ``_to_copy_N``): the
    positive, decreasing float vector starting at 1 a few nodes upstream of a Cos."""
    for cos in (n for n in g.nodes if n.op_type == "Cos"):
        seen, todo = set(), list(cos.input)
        while todo and len(seen) < 32:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            c = g.const(name)
            if c is not None:
                v = c.reshape(-1).astype(np.float64)
                if (c.dtype.kind == "f" and v.size > 1 and abs(v[0] - 1.0) < 1e-6 and np.all(v > 0)
                        and np.all(np.diff(v) < 0)):
                    return v
                continue
            if name in g.producer:
                todo.extend(i for i in g.producer[name].input if i)
    return None
