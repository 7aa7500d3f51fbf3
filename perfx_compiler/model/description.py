"""The one internal model description every reader produces.

A decoder is described by a ``ModelConfig`` (sizes plus *features*: QK-norm, sandwich
norms, GeGLU, sliding windows, soft-capping, partial RoPE, ...) and float weights under
canonical Hugging Face Llama names in the HF layout (``[out_features, in_features]``).
Every family reader (``model/families/<family>/``) brings its weights to this one form:

* Q/K rows are in the kernels' RoPE layout: rotate-half over the whole head, pairs
  ``(i, i + head_dim/2)``. Interleaved (llama.cpp's permutation, GLM) and partial
  rotary layouts are reordered at load; the dims RoPE leaves alone sit at the end of
  each half, where the tables hold cos=1, sin=0 (``rope_inv_freq``). The q.k product
  is unchanged by applying one permutation to both.
* Norm weights are the factors applied (Gemma's ``1 + w`` already added).
* Fused projections (Phi-3's ``qkv_proj``/``gate_up_proj``) are split.

Canonical names beyond Llama's: ``self_attn.q_norm``/``k_norm`` (per-head RMSNorm),
``attn_output_layernorm``/``mlp_output_layernorm`` (sandwich norms before the residual
add); ``post_attention_layernorm`` is always the norm in front of the MLP.
"""

from __future__ import annotations

import re
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

import numpy as np

from perfx_compiler.errors import UnsupportedModelError

MLP_ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Hugging Face style rope_scaling dict ({"rope_type": "linear"|"llama3", "factor": ...}) or None.
    rope_scaling: dict[str, Any] | None = None
    max_context: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2: Q/K/V projections carry biases
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    add_bos_token: bool = False
    name: str = ""
    # --- features: what the graph builder, the reference and the kernels read (defaults: Llama) ---
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # norms on the attention and MLP outputs before the residual add (Gemma 2/3, GLM-4)
    mlp_activation: str = "silu"  # gate activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embedding_scale: float = 1.0  # the embedding rows are multiplied by this (Gemma: sqrt(hidden))
    query_scale: float = 0.0  # attention score scale; 0: 1/sqrt(head_dim)
    attn_softcap: float = 0.0  # scores become c*tanh(s/c) (Gemma 2); 0: none
    final_softcap: float = 0.0  # logits become c*tanh(l/c) (Gemma 2); 0: none
    sliding_window: int = 0  # window of the layers in sliding_layers
    sliding_layers: list[int] = field(default_factory=list)
    rope_local_theta: float = 0.0  # RoPE base of the sliding layers (Gemma 3); 0: rope_theta
    rotary_dim: int = 0  # head dims RoPE rotates (partial rotary: GLM-4, Phi-4-mini); 0: head_dim

    def __post_init__(self) -> None:
        self._check_values()
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    def _check_values(self) -> None:
        """Types and ranges of every field: a corrupt file's config (a count of 0 or 2^62, a NaN
        epsilon, a string where a number belongs) is refused here, in one line, instead of failing
        somewhere in the compiler or the runtime."""
        from perfx_compiler.errors import ModelFormatError

        def bad(name: str, value: Any, want: str) -> ModelFormatError:
            return ModelFormatError(f"model config {name}={value!r} is not {want}; the model file is corrupt or not a decoder PerfX reads")

        if not isinstance(self.architecture, str):
            raise bad("architecture", self.architecture, "a name")
        for name in _COUNTS:
            v, top = getattr(self, name), _MAX_CONTEXT if name == "max_context" else _MAX_COUNT
            if not _is_int(v) or not 1 <= int(v) <= top:
                raise bad(name, v, f"an integer in 1..{top}")
            setattr(self, name, int(v))
        for name, low in (("rms_norm_eps", 0.0), ("rope_theta", None)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not np.isfinite(float(v)) \
                    or (low is None and float(v) <= 0) or (low is not None and float(v) < low):
                raise bad(name, v, "a finite number" + (" > 0" if low is None else " >= 0"))
            setattr(self, name, float(v))
        for name in ("tie_word_embeddings", "attention_bias", "add_bos_token"):
            v = getattr(self, name)
            if not isinstance(v, (bool, np.bool_)) and v not in (0, 1):
                raise bad(name, v, "true or false")
            setattr(self, name, bool(v))
        for name in ("qk_norm", "sandwich_norms"):
            v = getattr(self, name)
            if not isinstance(v, (bool, np.bool_)) and v not in (0, 1):
                raise bad(name, v, "true or false")
            setattr(self, name, bool(v))
        for name in ("embedding_scale", "query_scale", "attn_softcap", "final_softcap", "rope_local_theta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not np.isfinite(float(v)) \
                    or float(v) < 0:
                raise bad(name, v, "a finite number >= 0")
            setattr(self, name, float(v))
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise bad("mlp_activation", self.mlp_activation, f"one of {', '.join(MLP_ACTIVATIONS)}")
        for name in ("sliding_window", "rotary_dim"):
            v = getattr(self, name)
            if not _is_int(v) or not 0 <= int(v) <= _MAX_COUNT:
                raise bad(name, v, "an integer >= 0")
            setattr(self, name, int(v))
        if self.rotary_dim > self.head_dim or self.rotary_dim % 2:
            raise bad("rotary_dim", self.rotary_dim, f"an even number <= head_dim {self.head_dim}")
        layers = self.sliding_layers
        if not isinstance(layers, (list, tuple)) or not all(_is_int(i) and 0 <= i < self.num_layers for i in layers):
            raise bad("sliding_layers", layers, f"a list of layer indices in 0..{self.num_layers - 1}")
        self.sliding_layers = sorted({int(i) for i in layers})
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise bad("rope_scaling", self.rope_scaling, "an object or null")
        if self.bos_token_id is not None and (not _is_int(self.bos_token_id) or not 0 <= self.bos_token_id < self.vocab_size):
            raise bad("bos_token_id", self.bos_token_id, f"a token id in 0..{self.vocab_size - 1}")
        eos = self.eos_token_ids
        if not isinstance(eos, (list, tuple)) or not all(_is_int(t) and 0 <= t < self.vocab_size for t in eos):
            raise bad("eos_token_ids", eos, f"a list of token ids in 0..{self.vocab_size - 1}")
        self.bos_token_id = None if self.bos_token_id is None else int(self.bos_token_id)
        self.eos_token_ids = [int(t) for t in eos]
        self.name = str(self.name)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotated_dims(self) -> int:
        """Head dims RoPE rotates (all unless the model uses partial rotary)."""
        return self.rotary_dim or self.head_dim

    def attention_scale(self) -> float:
        return self.query_scale or 1.0 / float(np.sqrt(self.head_dim))

    def layer_window(self, layer: int) -> int:
        """Sliding-window length of ``layer``'s attention; 0 when it attends to the whole context
        (also when the window covers every position the cache holds: the mask would be a no-op)."""
        if layer in self.sliding_layers and 0 < self.sliding_window < self.max_context:
            return self.sliding_window
        return 0

    def layer_rope_local(self, layer: int) -> bool:
        """Whether ``layer`` uses the local RoPE tables (a sliding layer of a two-base model)."""
        return bool(self.rope_local_theta) and layer in self.sliding_layers

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        """The config of a dict (unknown keys ignored); a non-dict or missing fields: ModelFormatError."""
        from perfx_compiler.errors import ModelFormatError

        if not isinstance(data, dict):
            raise ModelFormatError(f"model config is a {type(data).__name__}, not an object; the model file is corrupt")
        known = {f for f in cls.__dataclass_fields__}
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [k for k in required if k not in data]
        if missing:
            raise ModelFormatError(f"model config lacks {', '.join(missing)}; the model file is corrupt or incomplete")
        return cls(**{k: v for k, v in data.items() if k in known})


# ModelConfig's feature fields (every field after ``name``: what a family declares beyond sizes; readers
# that recover only some refuse the rest) and their defaults (a Llama decoder)
_FIELDS = [f.name for f in fields(ModelConfig)]
FEATURES = tuple(_FIELDS[_FIELDS.index("name") + 1:])
FEATURE_DEFAULTS: dict[str, Any] = {
    f.name: f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
    for f in fields(ModelConfig) if f.name in FEATURES
}
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
# Sizes and counts of a config: positive, and within int32 (index arithmetic in the kernels).
_COUNTS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
           "max_context")
_MAX_COUNT = (1 << 31) - 1
_MAX_CONTEXT = 1 << 24  # the KV cache and RoPE tables are allocated for this many positions


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical weight name with its shape (HF layout)."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "self_attn.q_proj.weight"] = (c.q_size, c.hidden_size)
        shapes[p + "self_attn.k_proj.weight"] = (c.kv_size, c.hidden_size)
        shapes[p + "self_attn.v_proj.weight"] = (c.kv_size, c.hidden_size)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, c.q_size)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
        if c.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (c.q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (c.kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (c.kv_size,)
        if c.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (c.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (c.head_dim,)
        if c.sandwich_norms:
            shapes[p + "attn_output_layernorm.weight"] = (c.hidden_size,)
            shapes[p + "mlp_output_layernorm.weight"] = (c.hidden_size,)
    shapes["model.norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


@dataclass
class ModelDescription:
    """Architecture + float32 weights + tokenizer: what the compiler consumes."""

    config: ModelConfig
    weights: dict[str, np.ndarray]
    tokenizer_json: str | None = None  # serialized `tokenizers` JSON
    chat_template: str | None = None  # Jinja template from the model, if any
    source: str = ""
    # Quantized source tensors kept as they are (GGUF passthrough); name -> (ggml type name, raw bytes array)
    quantized: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """Check every expected weight is present with the right shape."""
        from perfx_compiler.errors import ModelFormatError

        # The layer count first, from the names alone: a corrupt count (a billion layers) must not
        # be walked layer by layer below.
        layers = {int(m.group(1)) for n in self.weights if (m := _LAYER_NAME.match(n))}
        if len(layers) != self.config.num_layers or (layers and max(layers) != len(layers) - 1):
            raise ModelFormatError(
                f"model weights do not match its config ({self.source}): the config has {self.config.num_layers} "
                f"layers, the weights have {len(layers)} (indices {min(layers, default=0)}..{max(layers, default=-1)})"
            )
        missing, wrong = [], []
        for name, shape in expected_weight_shapes(self.config).items():
            if name not in self.weights:
                missing.append(name)
            elif tuple(self.weights[name].shape) != shape:
                wrong.append(f"{name} {tuple(self.weights[name].shape)} != {shape}")
        if missing or wrong:
            detail = "; ".join((["missing " + ", ".join(missing[:5])] if missing else []) + wrong[:5])
            raise ModelFormatError(f"model weights do not match its config ({self.source}): {detail}")

    def lm_head(self) -> np.ndarray:
        if self.config.tie_word_embeddings:
            return self.weights["model.embed_tokens.weight"]
        return self.weights["lm_head.weight"]

    def parameter_count(self) -> int:
        return int(sum(w.size for w in self.weights.values()))


def rope_inv_freq(config: ModelConfig, local: bool = False) -> np.ndarray:
    """Inverse RoPE frequencies [head_dim/2] (float64), with HF's linear/llama3 scaling applied.

    Partial rotary: the first rotary_dim/2 entries are the model's frequencies, the rest 0
    (angle 0: cos 1, sin 0, the dims pass through; see the module docstring for the layout).
    ``local``: the sliding layers' tables of a two-base model (their own base, no scaling)."""
    d, r = config.head_dim, config.rotated_dims
    theta = config.rope_local_theta if local and config.rope_local_theta else config.rope_theta
    inv = 1.0 / (theta ** (np.arange(0, r, 2, dtype=np.float64) / r))
    if not local:
        inv = _scaled(inv, config.rope_scaling or {})
    return np.concatenate([inv, np.zeros((d - r) // 2)])


def _scaled(inv: np.ndarray, sc: dict[str, Any]) -> np.ndarray:
    """HF's rope_scaling applied to the inverse frequencies."""
    kind = sc.get("rope_type", sc.get("type"))
    if kind == "linear":
        inv = inv / float(sc["factor"])
    elif kind == "llama3":
        factor = float(sc["factor"])
        low = float(sc.get("low_freq_factor", 1.0))
        high = float(sc.get("high_freq_factor", 4.0))
        old_ctx = float(sc.get("original_max_position_embeddings", 8192))
        wavelen = 2 * np.pi / inv
        low_wl, high_wl = old_ctx / low, old_ctx / high
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = np.where(wavelen > low_wl, inv / factor, inv)
        mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind not in (None, "default"):
        raise UnsupportedModelError(f"rope scaling '{kind}' is not supported (linear, llama3 are)")
    return inv


def rope_tables(config: ModelConfig, length: int, local: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables [length, head_dim/2] in float64 for rotate-half RoPE (``local``: see rope_inv_freq)."""
    pos = np.arange(length, dtype=np.float64)[:, None]
    ang = pos * rope_inv_freq(config, local)[None, :]
    return np.cos(ang), np.sin(ang)
