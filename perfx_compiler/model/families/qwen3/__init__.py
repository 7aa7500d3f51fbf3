"""Qwen3 (dense): Llama with RMSNorm over each head's q and k, no biases."""

from perfx_compiler.model.families._family import Family

FAMILY = Family(
    name="qwen3",
    hf_classes=("Qwen3ForCausalLM",),
    gguf_archs=("qwen3",),
    hf_features=lambda c: {"qk_norm": True},
    gguf_features=lambda m: {"qk_norm": True},
)
