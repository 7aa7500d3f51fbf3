"""What a model family declares, and the shared readers that apply a declaration.

A family folder (``families/<name>/__init__.py``) holds one ``FAMILY = Family(...)``: the
Hugging Face classes and GGUF architectures it reads, how its config maps onto
``ModelConfig`` features, how its tensor names map onto the canonical names, and the
layout its Q/K rows arrive in. Everything after the reader sees only ``ModelConfig``
features and canonical weights (see ``model/description.py``), never the family name.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

RopeLayout = Literal["rotate_half", "interleaved"]


class HFConfig:
    """A config.json with the lookups every family needs (old and new transformers spellings)."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data

    def get(self, key: str, default: Any = None) -> Any:
        v = self.data.get(key)
        return default if v is None else v

    def rope(self, layer_type: str = "full_attention") -> dict[str, Any]:
        """RoPE parameters: transformers 5's ``rope_parameters`` (flat, or one dict per layer type)
        or the older top-level ``rope_theta`` / ``rope_scaling`` / ``partial_rotary_factor``."""
        params = self.data.get("rope_parameters")
        if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
            params = params[layer_type]
        out: dict[str, Any] = dict(params) if isinstance(params, dict) else {}
        scaling = self.data.get("rope_scaling")
        if isinstance(scaling, dict):
            out = {**scaling, **out}
        for key in ("rope_theta", "partial_rotary_factor"):
            if key not in out and self.data.get(key) is not None:
                out[key] = self.data[key]
        if "type" in out:
            out.setdefault("rope_type", out.pop("type"))
        return out

    def rope_scaling(self, layer_type: str = "full_attention") -> dict[str, Any] | None:
        """The scaling part of ``rope`` (None for plain RoPE)."""
        rope = self.rope(layer_type)
        kind = rope.get("rope_type")
        if kind in (None, "default"):
            return None
        return {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}

    def sliding_layers(self, num_layers: int) -> list[int]:
        """Layers whose ``layer_types`` entry is sliding attention."""
        types = self.data.get("layer_types")
        if isinstance(types, list):
            return [i for i, t in enumerate(types[:num_layers]) if t == "sliding_attention"]
        return []


class GGUFMeta:
    """GGUF metadata of one architecture: ``get("attention.sliding_window")`` reads ``<arch>.attention...``."""

    def __init__(self, getter: Callable[[str, Any], Any], arch: str) -> None:
        self._get = getter
        self.arch = arch

    def get(self, key: str, default: Any = None) -> Any:
        return self._get(f"{self.arch}.{key}", default)


def _no_features(_: Any) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Family:
    """One decoder family: its names in each format and what its config means."""

    name: str
    hf_classes: tuple[str, ...] = ()
    gguf_archs: tuple[str, ...] = ()
    # ModelConfig feature fields (and any base field the family sets its own way) from each format
    hf_features: Callable[[HFConfig], dict[str, Any]] = _no_features
    gguf_features: Callable[[GGUFMeta], dict[str, Any]] = _no_features
    # layer-name suffix renames from the HF checkpoint to the canonical names (applied once per name)
    hf_renames: Mapping[str, str] = field(default_factory=dict)
    # how the Q/K rows of each head arrive: llama.cpp permutes Llama's to interleaved; GLM's are
    hf_rope_layout: RopeLayout = "rotate_half"
    gguf_rope_layout: RopeLayout = "rotate_half"
    # HF stores norm weights w applied as (offset + w) (Gemma: 1); llama.cpp's converter adds it
    hf_norm_offset: float = 0.0
    # the family's chat format, for files that carry no template (llama.cpp knows these by name)
    chat_template: str | None = None


# llama.cpp layer tensor names -> canonical names (every family llama.cpp writes uses these)
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "attn_output_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "mlp_output_layernorm",
}
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def qk_row_order(num_heads: int, head_dim: int, rotary_dim: int, layout: RopeLayout) -> np.ndarray | None:
    """Row order that brings a Q or K projection's rows into the kernels' RoPE layout.

    Per head, the new rows are [rotated first halves, pass-through first half, rotated second
    halves, pass-through second half], so the kernels' rotate-half pairs ``(i, i + D/2)`` are the
    model's rotation pairs and the tables' cos=1/sin=0 tail leaves the rest alone. None: already so."""
    d, r = head_dim, rotary_dim or head_dim
    if layout == "rotate_half" and r == d:
        return None
    old = np.arange(d)
    if layout == "interleaved":
        rot_a, rot_b = old[0:r:2], old[1:r:2]
    else:
        rot_a, rot_b = old[: r // 2], old[r // 2: r]
    passing = old[r:]
    half = (d - r) // 2
    head = np.concatenate([rot_a, passing[:half], rot_b, passing[half:]])
    return (np.arange(num_heads)[:, None] * d + head[None, :]).reshape(-1)


def split_sizes(suffix: str, q: int, kv: int, ff: int) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
    """Canonical parts of a fused projection (``self_attn.qkv_proj.weight`` ...) and their row counts."""
    base, _, kind = suffix.rpartition(".")
    if base == "self_attn.qkv_proj":
        return tuple(f"self_attn.{p}_proj.{kind}" for p in "qkv"), (q, kv, kv)
    if base == "mlp.gate_up_proj":
        return (f"mlp.gate_proj.{kind}", f"mlp.up_proj.{kind}"), (ff, ff)
    return None


def gemma_embedding_scale(hidden: int) -> float:
    """Gemma multiplies embeddings by sqrt(hidden), rounded to the weights' float32 as HF does."""
    return float(np.float32(math.sqrt(hidden)))


# Config keys that name a feature PerfX does not run; an unknown architecture gets them listed.
_UNKNOWN_FEATURES = (
    (("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size"), "mixture-of-experts MLP"),
    (("kv_lora_rank", "q_lora_rank"), "multi-head latent attention"),
    (("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"), "LayerNorm"),
    (("ssm_cfg", "mamba_d_state", "state_size", "linear_attn_config", "linear_num_value_heads"), "state-space / linear attention layers"),
    (("alibi", "use_alibi", "alibi_bias_max"), "ALiBi position biases"),
    (("vision_config", "audio_config"), "a multimodal encoder"),
    (("parallel_attn", "use_parallel_residual"), "parallel attention/MLP residuals"),
)


def missing_features(data: dict[str, Any]) -> list[str]:
    """Features of an unknown config.json that no PerfX family provides."""
    found = [name for keys, name in _UNKNOWN_FEATURES if any(data.get(k) not in (None, False, 0) for k in keys)]
    act = data.get("hidden_act") or data.get("hidden_activation")
    if isinstance(act, str) and act not in ("silu", "swish", "gelu_pytorch_tanh", "gelu_new"):
        found.append(f"MLP activation '{act}'")
    return found


_LAYER = "model.layers."


def row_plan(name: str, rows: int, config: Any, layout: RopeLayout) -> list[tuple[str, slice, np.ndarray | None]]:
    """How one tensor's rows become canonical tensors: ``[(name, row slice, row order in it)]``.

    Fused projections split into their parts; Q/K projections (weights and biases) and QK-norm
    weights get the row order of ``qk_row_order``. Works alike on float arrays and raw GGUF rows."""
    if not name.startswith(_LAYER):
        return [(name, slice(None), None)]
    prefix, _, rest = name[len(_LAYER):].partition(".")
    head = f"{_LAYER}{prefix}."
    c = config
    if rest == "mlp.up_proj.weight" and rows == 2 * c.intermediate_size:
        rest = "mlp.gate_up_proj.weight"  # llama.cpp stores Phi-3's and GLM's gate+up as one ffn_up
    parts = split_sizes(rest, c.q_size, c.kv_size, c.intermediate_size)
    plan: list[tuple[str, slice, np.ndarray | None]] = []
    if parts is None:
        plan = [(name, slice(None), None)]
    else:
        start = 0
        for part, n in zip(*parts, strict=True):
            plan.append((head + part, slice(start, start + n), None))
            start += n
    out = []
    for canon, rows_slice, _ in plan:
        tail = canon[len(head):]
        order = None
        if tail.startswith(("self_attn.q_proj.", "self_attn.k_proj.")):
            heads = c.num_heads if tail.startswith("self_attn.q_proj.") else c.num_kv_heads
            order = qk_row_order(heads, c.head_dim, c.rotary_dim, layout)
        elif tail in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
            order = qk_row_order(1, c.head_dim, c.rotary_dim, layout)
        out.append((canon, rows_slice, order))
    return out
