"""Mistral: Llama with a sliding window on every layer (when its config sets one)."""

from typing import Any

from perfx_compiler.model.families._family import Family, GGUFMeta, HFConfig


def _hf(c: HFConfig) -> dict[str, Any]:
    window = int(c.get("sliding_window", 0))
    if not window or c.get("use_sliding_window") is False:
        return {}
    layers = c.sliding_layers(int(c.get("num_hidden_layers")))
    return {"sliding_window": window, "sliding_layers": layers or list(range(int(c.get("num_hidden_layers"))))}


def _gguf(m: GGUFMeta) -> dict[str, Any]:
    window = int(m.get("attention.sliding_window", 0) or 0)
    return {"sliding_window": window, "sliding_layers": list(range(int(m.get("block_count"))))} if window else {}


FAMILY = Family(
    name="mistral",
    hf_classes=("MistralForCausalLM",),
    gguf_archs=("mistral",),
    hf_features=_hf,
    gguf_features=_gguf,
    gguf_rope_layout="interleaved",
)
