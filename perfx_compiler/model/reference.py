"""Float64 numpy reference forward pass over a ``ModelDescription`` (llama2.c style).

The ground truth every compiled path is checked against: no TVM, no torch, just
numpy. Rotate-half RoPE (the layout ``ModelDescription`` guarantees), GQA causal
attention with a KV cache, gated MLP, RMSNorm, tied or separate lm_head, and every
feature a family declares (QK-norm, sandwich norms, GeGLU, sliding windows,
soft-capping, scaled embeddings, a second RoPE base for sliding layers).
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
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    attn_out_norm: np.ndarray | None = None
    mlp_out_norm: np.ndarray | None = None


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


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

        def feature(name: str, on: bool) -> np.ndarray | None:
            return get(name) if on else None

        c = self.config

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
                    q_norm=feature(p + "self_attn.q_norm.weight", c.qk_norm),
                    k_norm=feature(p + "self_attn.k_norm.weight", c.qk_norm),
                    attn_out_norm=feature(p + "attn_output_layernorm.weight", c.sandwich_norms),
                    mlp_out_norm=feature(p + "mlp_output_layernorm.weight", c.sandwich_norms),
                )
            )
        self.final_norm = get("model.norm.weight")
        # Tied heads share the embedding array; transposing once keeps logits a plain matmul.
        self.lm_head = np.ascontiguousarray(np.asarray(desc.lm_head(), dtype=self.dtype).T)
        self._tables: dict[bool, tuple[np.ndarray, np.ndarray]] = {}
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

    def _rope(self, start: int, end: int, local: bool = False) -> tuple[np.ndarray, np.ndarray]:
        cos, sin = self._tables.get(local, (np.zeros((0, 1)), None))
        if end > cos.shape[0]:
            # Grow geometrically so token-by-token decode does not recompute the tables each step.
            n = max(end, 2 * cos.shape[0], 64)
            cos, sin = (t.astype(self.dtype) for t in rope_tables(self.config, n, local))
            self._tables[local] = (cos, sin)
        return cos[start:end], sin[start:end]  # type: ignore[index]

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
        nh, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        group = nh // nkv
        scale = float(c.attention_scale())  # Python float: keeps float32 mode in float32
        eps = c.rms_norm_eps
        # Causal mask over [new tokens, all tokens]: new token j sees cached + new[: j + 1].
        key_pos, query_pos = np.arange(end)[None, :], (start + np.arange(seq))[:, None]
        causal = key_pos > query_pos

        x = self.embed[ids]
        if c.embedding_scale != 1.0:
            x = x * self.dtype.type(c.embedding_scale)
        for li, L in enumerate(self.layers):
            cos, sin = self._rope(start, end, c.layer_rope_local(li))
            window = c.layer_window(li)
            mask = causal | (key_pos <= query_pos - window) if window else causal
            h = _rms_norm(x, L.attn_norm, eps)
            q, k, v = h @ L.wq, h @ L.wk, h @ L.wv
            if L.bq is not None:
                q, k, v = q + L.bq, k + L.bk, v + L.bv
            q = q.reshape(seq, nh, hd).transpose(1, 0, 2)
            k = k.reshape(seq, nkv, hd).transpose(1, 0, 2)
            v = v.reshape(seq, nkv, hd).transpose(1, 0, 2)
            if L.q_norm is not None:
                q, k = _rms_norm(q, L.q_norm, eps), _rms_norm(k, L.k_norm, eps)
            q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
            K = np.concatenate([self.k_cache[li], k], axis=1)
            V = np.concatenate([self.v_cache[li], v], axis=1)
            self.k_cache[li], self.v_cache[li] = K, V
            # GQA: query head g*group + r reads KV head g.
            qg = q.reshape(nkv, group, seq, hd)
            scores = np.einsum("grsd,gtd->grst", qg, K) * scale
            if c.attn_softcap:
                scores = np.tanh(scores / c.attn_softcap) * c.attn_softcap
            scores = np.where(mask, -np.inf, scores)
            scores = scores - scores.max(axis=-1, keepdims=True)
            p = np.exp(scores)
            p /= p.sum(axis=-1, keepdims=True)
            o = np.einsum("grst,gtd->grsd", p, V).reshape(nh, seq, hd).transpose(1, 0, 2)
            o = o.reshape(seq, nh * hd) @ L.wo
            x = x + (_rms_norm(o, L.attn_out_norm, eps) if L.attn_out_norm is not None else o)

            h = _rms_norm(x, L.mlp_norm, eps)
            act = _gelu_tanh if c.mlp_activation == "gelu_tanh" else _silu
            m = (act(h @ L.w_gate) * (h @ L.w_up)) @ L.w_down
            x = x + (_rms_norm(m, L.mlp_out_norm, eps) if L.mlp_out_norm is not None else m)

        logits = _rms_norm(x, self.final_norm, eps) @ self.lm_head
        if c.final_softcap:
            logits = np.tanh(logits / c.final_softcap) * c.final_softcap
        return logits

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
