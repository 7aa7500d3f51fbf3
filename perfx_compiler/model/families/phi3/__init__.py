"""Phi-3 / Phi-4-mini: fused qkv_proj and gate_up_proj (split at load), optional partial rotary
and sliding window on every layer."""

from typing import Any

from perfx_compiler.model.families._family import Family, GGUFMeta, HFConfig


def _hf(c: HFConfig) -> dict[str, Any]:
    n, hidden, heads = int(c.get("num_hidden_layers")), int(c.get("hidden_size")), int(c.get("num_attention_heads"))
    head_dim = int(c.get("head_dim", hidden // heads))
    out: dict[str, Any] = {"rotary_dim": int(head_dim * float(c.rope().get("partial_rotary_factor", 1.0)))}
    if c.get("sliding_window"):
        out.update(sliding_window=int(c.get("sliding_window")), sliding_layers=list(range(n)))
    return out


def _gguf(m: GGUFMeta) -> dict[str, Any]:
    out: dict[str, Any] = {"rotary_dim": int(m.get("rope.dimension_count", 0) or 0)}
    window = int(m.get("attention.sliding_window", 0) or 0)
    if window:
        out.update(sliding_window=window, sliding_layers=list(range(int(m.get("block_count")))))
    return out


FAMILY = Family(name="phi3", hf_classes=("Phi3ForCausalLM",), gguf_archs=("phi3",), hf_features=_hf, gguf_features=_gguf)
