"""Activation-aware int4 weight quantization (AWQ; quantization ``q4_awq_g128`` / ``_g64`` / ``_g32``).

Salient input channels (large mean |activation|) lose less to rounding when their weight columns
are scaled up before quantization and their activations scaled down by the same factor. Per
layer and per linear input, with ``a`` the mean |x| per input channel over a calibration text:

    s = a ** alpha (normalized to geometric mean 1), alpha searched on a grid, minimizing
    || X W^T - X (Q(W diag(s)) diag(1/s))^T ||^2 over the calibration activations X.

The scales cost nothing at inference: they are folded into what produces the input,

* QKV (merged): columns scaled by s, ``input_layernorm`` weight divided by s;
* gate+up (merged): columns scaled by s, ``post_attention_layernorm`` weight divided by s;
* down: columns scaled by s, the *up* half of gate+up divided by s row-wise (SwiGLU is linear
  in up: silu(g) * (u / s) = h / s).

Then every linear is quantized round-to-nearest, asymmetric int4 in groups of G (the kernels of
``quantize_int4``). Statistics come from the float reference (``model/reference.py``, float32)
on ``perfx_compiler/data/kjv_genesis_1-3.txt`` (public domain), tokenized with the model's own
tokenizer; a model without one gets fixed pseudo-random ids.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import tvm

from perfx_compiler.errors import PerfXError
from perfx_compiler.formats.int4 import Int4Format, dequantize_int4, quantize_int4
from perfx_compiler.passes.quantize_int4 import quantize_linears

NAME = "awq"

CALIBRATION = Path(__file__).resolve().parents[1] / "data" / "kjv_genesis_1-3.txt"
CALIBRATION_TOKENS = 512
ALPHAS = tuple(np.linspace(0.0, 1.0, 11))
_AWQ = re.compile(r"^q4_awq_g(32|64|128)$")


def parse(quantization: str) -> Int4Format | None:
    m = _AWQ.match(quantization)
    return Int4Format(int(m.group(1)), symmetric=False) if m else None


def calibration_ids(desc: Any, n: int = CALIBRATION_TOKENS) -> list[int]:
    vocab = desc.config.vocab_size
    if desc.tokenizer_json:
        from tokenizers import Tokenizer

        ids = Tokenizer.from_str(desc.tokenizer_json).encode(CALIBRATION.read_text()).ids
        ids = [i for i in ids if 0 <= i < vocab]
        if len(ids) >= 16:
            return ids[:n]
    return [int(i) for i in np.random.default_rng(0).integers(0, vocab, size=min(n, desc.config.max_context))]


class _Recorder:
    """Stands in for a weight in the reference model's ``h @ W``: keeps h, returns the product."""

    __array_ufunc__ = None  # numpy defers ``ndarray @ self`` to __rmatmul__

    def __init__(self, w: np.ndarray, store: list[np.ndarray]) -> None:
        self.w, self.store = w, store

    def __rmatmul__(self, h: np.ndarray) -> np.ndarray:
        self.store.append(np.asarray(h, dtype=np.float32).reshape(-1, h.shape[-1]))
        return h @ self.w


def collect_inputs(desc: Any, ids: list[int]) -> list[dict[str, np.ndarray]]:
    """Per layer, the calibration inputs [T, K] of the attention (qkv), mlp (gate_up) and down linears."""
    from perfx_compiler.model.reference import ReferenceModel

    ref = ReferenceModel(desc, dtype=np.float32)
    stores: list[dict[str, list[np.ndarray]]] = []
    for layer in ref.layers:
        st: dict[str, list[np.ndarray]] = {"qkv": [], "gate_up": [], "down": []}
        layer.wq = _Recorder(layer.wq, st["qkv"])
        layer.w_gate = _Recorder(layer.w_gate, st["gate_up"])
        layer.w_down = _Recorder(layer.w_down, st["down"])
        stores.append(st)
    ids = ids[: desc.config.max_context]
    ref.forward(ids)
    return [{k: np.concatenate(v, axis=0) for k, v in st.items()} for st in stores]


def search_scale(w: np.ndarray, x: np.ndarray, fmt: Int4Format) -> tuple[np.ndarray, float]:
    """(per-input-channel scale s, alpha) minimizing the output error of quantizing W diag(s)."""
    a = np.abs(x).mean(axis=0).astype(np.float64) + 1e-8
    xs = x[:: max(1, x.shape[0] // 256)].astype(np.float32)  # error measured on <= 256 rows
    ref = xs @ w.T
    best: tuple[float, np.ndarray, float] | None = None
    for alpha in ALPHAS:
        s = a**alpha
        s = s / np.sqrt(s.max() * s.min())
        ws = (w * s[None, :]).astype(np.float32)
        wq = dequantize_int4(*quantize_int4(ws, fmt), fmt.group) / s[None, :].astype(np.float32)
        err = float(np.square(xs @ wq.T - ref).mean())
        if best is None or err < best[0]:
            best = (err, s, float(alpha))
    assert best is not None
    return best[1].astype(np.float32), best[2]


def awq_weights(weights: dict[str, Any], desc: Any, fmt: Int4Format) -> tuple[dict[str, Any], dict[str, float]]:
    """The weight table with AWQ scales folded in (linears scaled, norms / up rows divided)."""
    cfg = desc.config
    acts = collect_inputs(desc, calibration_ids(desc))
    out = dict(weights)
    alphas: dict[str, float] = {}
    f = cfg.intermediate_size
    for i, act in enumerate(acts):
        p = f"model_layers_{i}_"
        names = {
            "norm1": p + "input_layernorm_weight", "qkv": p + "self_attn_qkv_proj_weight",
            "norm2": p + "post_attention_layernorm_weight", "gate_up": p + "mlp_gate_up_proj_weight",
            "down": p + "mlp_down_proj_weight",
        }
        missing = [n for n in names.values() if n not in weights]
        if missing:
            raise PerfXError(f"AWQ needs the merged projections (merge_projections pass); missing {missing[0]}")
        for key, norm in (("qkv", "norm1"), ("gate_up", "norm2")):
            w = np.asarray(out[names[key]], dtype=np.float32)
            s, alphas[f"{i}.{key}"] = search_scale(w, act[key], fmt)
            out[names[key]] = np.ascontiguousarray(w * s[None, :])
            out[names[norm]] = np.ascontiguousarray(np.asarray(out[names[norm]], dtype=np.float32) / s)
        w = np.asarray(out[names["down"]], dtype=np.float32)
        s, alphas[f"{i}.down"] = search_scale(w, act["down"], fmt)
        out[names["down"]] = np.ascontiguousarray(w * s[None, :])
        gu = np.array(out[names["gate_up"]], dtype=np.float32)
        gu[f:] /= s[:, None]  # the up rows: SwiGLU's output scales with them
        out[names["gate_up"]] = np.ascontiguousarray(gu)
    return out, alphas


def apply(mod: tvm.IRModule, weights: dict[str, Any], ctx: Any) -> tuple[tvm.IRModule, dict[str, Any]]:
    fmt = parse(getattr(ctx.options, "quantization", "f32") or "f32")
    if fmt is None:
        return mod, weights
    if ctx.desc is None:
        raise PerfXError("AWQ needs the model description (calibration runs the float reference)")
    if ctx.desc.config.attention_bias:
        raise PerfXError("AWQ is not supported for models with Q/K/V biases yet; use q4_g128 or q8")
    new, _ = awq_weights(weights, ctx.desc, fmt)
    # Replace the weight values (parameters keep their names), then quantize round-to-nearest.
    return quantize_linears(mod, new, fmt, ctx)
