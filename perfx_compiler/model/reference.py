"""Float64 numpy reference forward pass over a ``ModelDescription`` (llama2.c style).

The ground truth every compiled path is checked against: no TVM, no torch, just
numpy. Rotate-half RoPE (the HF layout ``ModelDescription`` guarantees), GQA causal
attention with a KV cache, SiLU-gated MLP, RMSNorm, tied or separate lm_head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from perfx_compiler.errors import ContextLengthError
from perfx_compiler.model.description import ModelConfig, ModelDescription, rope_tables


@dataclass
class _Layer:
    attn_norm: np.ndarray
    wq: np.ndarray  # stored transposed ([in, out]) so x @ w needs no per-call transpose
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    bq: np.ndarray | None
    bk: np.ndarray | None
    bv: np.ndarray | None
    mlp_norm: np.ndarray
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE. x: [heads, seq, head_dim]; cos/sin: [seq, head_dim/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class ReferenceModel:
    """Stateful reference model: ``forward`` appends to an internal KV cache."""

    def __init__(self, desc: ModelDescription, dtype: type = np.float64) -> None:
        self.desc = desc
        self.config: ModelConfig = desc.config
        self.dtype = np.dtype(dtype)
        w = desc.weights

        def get(name: str, transpose: bool = False) -> np.ndarray:
            a = np.asarray(w[name], dtype=self.dtype)
            return np.ascontiguousarray(a.T) if transpose else a

        def opt(name: str) -> np.ndarray | None:
            return get(name) if self.config.attention_bias and name in w else None

        self.embed = get("model.embed_tokens.weight")
        self.layers: list[_Layer] = []
        for i in range(self.config.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                _Layer(
                    attn_norm=get(p + "input_layernorm.weight"),
                    wq=get(p + "self_attn.q_proj.weight", True),
                    wk=get(p + "self_attn.k_proj.weight", True),
                    wv=get(p + "self_attn.v_proj.weight", True),
                    wo=get(p + "self_attn.o_proj.weight", True),
                    bq=opt(p + "self_attn.q_proj.bias"),
                    bk=opt(p + "self_attn.k_proj.bias"),
                    bv=opt(p + "self_attn.v_proj.bias"),
                    mlp_norm=get(p + "post_attention_layernorm.weight"),
                    w_gate=get(p + "mlp.gate_proj.weight", True),
                    w_up=get(p + "mlp.up_proj.weight", True),
                    w_down=get(p + "mlp.down_proj.weight", True),
                )
            )
        self.final_norm = get("model.norm.weight")
        # Tied heads share the embedding array; transposing once keeps logits a plain matmul.
        self.lm_head = np.ascontiguousarray(np.asarray(desc.lm_head(), dtype=self.dtype).T)
        self._cos = np.zeros((0, self.config.head_dim // 2), self.dtype)
        self._sin = self._cos
        self.reset()

    # -- state -------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every cached token."""
        c = self.config
        empty = np.zeros((c.num_kv_heads, 0, c.head_dim), self.dtype)
        self.k_cache: list[np.ndarray] = [empty] * c.num_layers
        self.v_cache: list[np.ndarray] = [empty] * c.num_layers

    @property
    def position(self) -> int:
        """Number of tokens already in the KV cache."""
        return int(self.k_cache[0].shape[1]) if self.k_cache else 0

    def _rope(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        if end > self._cos.shape[0]:
            # Grow geometrically so token-by-token decode does not recompute the tables each step.
            n = max(end, 2 * self._cos.shape[0], 64)
            cos, sin = rope_tables(self.config, n)
            self._cos, self._sin = cos.astype(self.dtype), sin.astype(self.dtype)
        return self._cos[start:end], self._sin[start:end]

    # -- forward -----------------------------------------------------------------------------
    def forward(self, token_ids: Sequence[int]) -> np.ndarray:
        """Run ``token_ids`` after the cached tokens; returns logits ``[len(token_ids), vocab]``."""
        c = self.config
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        seq = ids.shape[0]
        if seq == 0:
            return np.zeros((0, c.vocab_size), self.dtype)
        if ids.min() < 0 or ids.max() >= c.vocab_size:
            raise ValueError(f"token id out of range [0, {c.vocab_size}): {ids.min()}..{ids.max()}")
        start = self.position
        end = start + seq
        if end > c.max_context:
            raise ContextLengthError(
                f"{end} tokens do not fit the model's context of {c.max_context}; shorten the prompt"
            )
        cos, sin = self._rope(start, end)
        nh, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        group = nh // nkv
        scale = 1.0 / float(np.sqrt(hd))  # Python float: keeps float32 mode in float32
        # Causal mask over [new tokens, all tokens]: new token j sees cached + new[: j + 1].
        mask = np.arange(end)[None, :] > (start + np.arange(seq))[:, None]

        x = self.embed[ids]
        for li, L in enumerate(self.layers):
            h = _rms_norm(x, L.attn_norm, c.rms_norm_eps)
            q, k, v = h @ L.wq, h @ L.wk, h @ L.wv
            if L.bq is not None:
                q, k, v = q + L.bq, k + L.bk, v + L.bv
            q = q.reshape(seq, nh, hd).transpose(1, 0, 2)
            k = k.reshape(seq, nkv, hd).transpose(1, 0, 2)
            v = v.reshape(seq, nkv, hd).transpose(1, 0, 2)
            q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
            K = np.concatenate([self.k_cache[li], k], axis=1)
            V = np.concatenate([self.v_cache[li], v], axis=1)
            self.k_cache[li], self.v_cache[li] = K, V
            # GQA: query head g*group + r reads KV head g.
            qg = q.reshape(nkv, group, seq, hd)
            scores = np.einsum("grsd,gtd->grst", qg, K) * scale
            scores = np.where(mask, -np.inf, scores)
            scores = scores - scores.max(axis=-1, keepdims=True)
            p = np.exp(scores)
            p /= p.sum(axis=-1, keepdims=True)
            o = np.einsum("grst,gtd->grsd", p, V).reshape(nh, seq, hd).transpose(1, 0, 2)
            x = x + o.reshape(seq, nh * hd) @ L.wo

            h = _rms_norm(x, L.mlp_norm, c.rms_norm_eps)
            x = x + (_silu(h @ L.w_gate) * (h @ L.w_up)) @ L.w_down

        return _rms_norm(x, self.final_norm, c.rms_norm_eps) @ self.lm_head

    __call__ = forward


def greedy(
    desc_or_model: ModelDescription | ReferenceModel, prompt_ids: Sequence[int], n_tokens: int
) -> list[int]:
    """Greedy-decode ``n_tokens`` after ``prompt_ids`` (fresh cache); returns only the new ids."""
    model = desc_or_model if isinstance(desc_or_model, ReferenceModel) else ReferenceModel(desc_or_model)
    if len(prompt_ids) == 0:
        raise ValueError("greedy decoding needs at least one prompt token")
    model.reset()
    out: list[int] = []
    if n_tokens <= 0:
        return out
    logits = model.forward(list(prompt_ids))
    for i in range(n_tokens):
        tok = int(np.argmax(logits[-1]))
        out.append(tok)
        if i + 1 < n_tokens:
            logits = model.forward([tok])
    return out
