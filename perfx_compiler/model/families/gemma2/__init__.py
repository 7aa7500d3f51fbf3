"""Gemma 2: sandwich norms, GeGLU, scaled embeddings, (1 + w) norms, attention and final-logit
soft-capping, sliding-window attention on every other layer."""

from typing import Any

from perfx_compiler.model.families._family import Family, GGUFMeta, HFConfig, gemma_embedding_scale
from perfx_compiler.model.families.gemma3 import GEMMA_CHAT_TEMPLATE, GEMMA_RENAMES, gemma_gguf_features


def _hf(c: HFConfig) -> dict[str, Any]:
    n = int(c.get("num_hidden_layers"))
    layers = c.sliding_layers(n) if c.get("layer_types") is not None else list(range(0, n, 2))
    return {
        "sandwich_norms": True,
        "mlp_activation": "gelu_tanh",
        "embedding_scale": gemma_embedding_scale(int(c.get("hidden_size"))),
        "query_scale": float(c.get("query_pre_attn_scalar", c.get("head_dim"))) ** -0.5,
        "attn_softcap": float(c.get("attn_logit_softcapping", 0.0)),
        "final_softcap": float(c.get("final_logit_softcapping", 0.0)),
        "sliding_window": int(c.get("sliding_window", 0)),
        "sliding_layers": layers,
        "tie_word_embeddings": bool(c.get("tie_word_embeddings", True)),
    }


def _gguf(m: GGUFMeta) -> dict[str, Any]:
    return {
        **gemma_gguf_features(m, layers_27b=46),
        "attn_softcap": float(m.get("attn_logit_softcapping", 0.0) or 0.0),
        "final_softcap": float(m.get("final_logit_softcapping", 0.0) or 0.0),
        "sliding_layers": list(range(0, int(m.get("block_count")), 2)),
    }


FAMILY = Family(
    name="gemma2",
    hf_classes=("Gemma2ForCausalLM",),
    gguf_archs=("gemma2",),
    hf_features=_hf,
    gguf_features=_gguf,
    hf_renames=GEMMA_RENAMES,
    hf_norm_offset=1.0,
    chat_template=GEMMA_CHAT_TEMPLATE,
)
