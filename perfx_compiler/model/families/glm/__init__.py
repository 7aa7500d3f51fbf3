"""GLM-4-9B-chat's Hugging Face layout (``GlmForCausalLM``): QKV bias, partial interleaved RoPE,
fused gate_up_proj, Llama's two norms."""

from perfx_compiler.model.families._family import Family
from perfx_compiler.model.families.glm4 import glm_rotary

FAMILY = Family(
    name="glm",
    hf_classes=("GlmForCausalLM",),
    hf_features=lambda c: {"rotary_dim": glm_rotary(c), "attention_bias": bool(c.get("attention_bias", True))},
    hf_rope_layout="interleaved",
)
