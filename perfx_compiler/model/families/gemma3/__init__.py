"""Gemma 3 (text): QK-norm, sandwich norms, GeGLU, scaled embeddings, (1 + w) norms, and five
sliding-window layers (local RoPE base) for every global one."""

from typing import Any

from perfx_compiler.model.families._family import Family, GGUFMeta, HFConfig, gemma_embedding_scale

GEMMA_RENAMES = {
    "post_attention_layernorm": "attn_output_layernorm",
    "pre_feedforward_layernorm": "post_attention_layernorm",
    "post_feedforward_layernorm": "mlp_output_layernorm",
}
# llama.cpp's constants for Gemma 3 (llama-model.cpp): the local RoPE base and the layer pattern
LOCAL_ROPE_BASE = 10000.0
PATTERN = 6
# Gemma's turn format (no system role: a system message is prefixed to the next user turn)
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\n\n' %}{% else %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (ns.system if role == 'user' else '') + message['content'] | trim"
    " + '<end_of_turn>\n' }}{% if role == 'user' %}{% set ns.system = '' %}{% endif %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def _hf(c: HFConfig) -> dict[str, Any]:
    n = int(c.get("num_hidden_layers"))
    layers = c.sliding_layers(n)
    if not layers and c.get("layer_types") is None:
        pattern = int(c.get("sliding_window_pattern", c.get("_sliding_window_pattern", PATTERN)))
        layers = [i for i in range(n) if (i + 1) % pattern]
    local = c.rope("sliding_attention").get("rope_theta") or c.get("rope_local_base_freq", LOCAL_ROPE_BASE)
    return {
        "qk_norm": True,
        "sandwich_norms": True,
        "mlp_activation": "gelu_tanh",
        "embedding_scale": gemma_embedding_scale(int(c.get("hidden_size"))),
        "query_scale": float(c.get("query_pre_attn_scalar", c.get("head_dim"))) ** -0.5,
        "attn_softcap": float(c.get("attn_logit_softcapping", 0.0)),
        "final_softcap": float(c.get("final_logit_softcapping", 0.0)),
        "sliding_window": int(c.get("sliding_window", 0)),
        "sliding_layers": layers,
        "rope_local_theta": float(local),
        "tie_word_embeddings": bool(c.get("tie_word_embeddings", True)),
    }


def gemma_gguf_features(m: GGUFMeta, layers_27b: int) -> dict[str, Any]:
    """What Gemma 2 and 3 GGUFs share: sandwich norms, GeGLU, scaled embeddings, and llama.cpp's query
    scale (the 27B model, recognised by its layer count, scales by hidden/heads; the others by head size)."""
    n, hidden, heads = int(m.get("block_count")), int(m.get("embedding_length")), int(m.get("attention.head_count"))
    head_dim = int(m.get("attention.key_length", hidden // heads))
    return {
        "sandwich_norms": True,
        "mlp_activation": "gelu_tanh",
        "embedding_scale": gemma_embedding_scale(hidden),
        "query_scale": (hidden / heads) ** -0.5 if n == layers_27b else head_dim ** -0.5,
        "sliding_window": int(m.get("attention.sliding_window", 0) or 0),
    }


def _gguf(m: GGUFMeta) -> dict[str, Any]:
    n = int(m.get("block_count"))
    pattern = m.get("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # newer files: one flag per layer
        layers = [i for i, sliding in enumerate(pattern) if sliding]
    else:
        layers = [i for i in range(n) if (i + 1) % PATTERN]
    return {**gemma_gguf_features(m, layers_27b=62), "qk_norm": True, "sliding_layers": layers,
            "rope_local_theta": LOCAL_ROPE_BASE}


FAMILY = Family(
    name="gemma3",
    hf_classes=("Gemma3ForCausalLM",),
    gguf_archs=("gemma3",),
    hf_features=_hf,
    gguf_features=_gguf,
    hf_renames=GEMMA_RENAMES,
    hf_norm_offset=1.0,
    chat_template=GEMMA_CHAT_TEMPLATE,
)
