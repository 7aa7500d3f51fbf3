"""GLM-4-9B-chat's Hugging Face layout (``GlmForCausalLM``): QKV bias, partial interleaved RoPE,
fused gate_up_proj, Llama's two norms."""

from perfx_compiler.model.families._family import Family
from perfx_compiler.model.families.glm4 import glm_rotary

FAMILY = Family(
    name="glm",
    hf_classes=("GlmForCausalLM",),
    gguf_archs=("chatglm",),  # what llama.cpp's converter writes for it
    gguf_features=lambda m: {"rotary_dim": int(m.get("rope.dimension_count", 0) or 0)},
    gguf_rope_layout="interleaved",
    hf_features=lambda c: {"rotary_dim": glm_rotary(c), "attention_bias": bool(c.get("attention_bias", True))},
    hf_rope_layout="interleaved",
)
