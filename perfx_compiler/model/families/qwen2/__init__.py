"""Qwen2 / Qwen2.5: Llama with Q/K/V biases (and, when enabled, sliding windows on the top layers)."""

from typing import Any

from perfx_compiler.model.families._family import Family, HFConfig


def _hf(c: HFConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"attention_bias": True}
    n = int(c.get("num_hidden_layers"))
    if c.get("use_sliding_window") and c.get("sliding_window"):
        layers = c.sliding_layers(n) or list(range(int(c.get("max_window_layers", 0)), n))
        out.update(sliding_window=int(c.get("sliding_window")), sliding_layers=layers)
    return out


FAMILY = Family(name="qwen2", hf_classes=("Qwen2ForCausalLM",), gguf_archs=("qwen2",), hf_features=_hf)
