"""GLM-4 (``Glm4ForCausalLM``, GLM-4-0414): QKV bias, partial interleaved RoPE, fused gate_up_proj,
norms on the attention and MLP outputs."""

from typing import Any

from perfx_compiler.model.families._family import Family, GGUFMeta, HFConfig


def glm_rotary(c: HFConfig) -> int:
    hidden, heads = int(c.get("hidden_size")), int(c.get("num_attention_heads"))
    head_dim = int(c.get("head_dim", hidden // heads))
    return int(head_dim * float(c.rope().get("partial_rotary_factor", 0.5)))


def _hf(c: HFConfig) -> dict[str, Any]:
    return {"sandwich_norms": True, "rotary_dim": glm_rotary(c), "attention_bias": bool(c.get("attention_bias", True))}


def _gguf(m: GGUFMeta) -> dict[str, Any]:
    return {"sandwich_norms": True, "rotary_dim": int(m.get("rope.dimension_count", 0) or 0)}


FAMILY = Family(
    name="glm4",
    hf_classes=("Glm4ForCausalLM",),
    gguf_archs=("glm4",),
    hf_features=_hf,
    gguf_features=_gguf,
    hf_renames={"post_self_attn_layernorm": "attn_output_layernorm", "post_mlp_layernorm": "mlp_output_layernorm"},
    hf_rope_layout="interleaved",
    gguf_rope_layout="interleaved",
)
