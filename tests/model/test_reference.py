"""The numpy reference forward pass: self-consistency, an independent loop recomputation,
and (when torch + transformers are importable) Hugging Face Llama / Qwen2 logits."""

from __future__ import annotations

import math

import numpy as np
import pytest

from perfx_compiler.errors import ContextLengthError
from perfx_compiler.model.description import (
    ModelConfig,
    ModelDescription,
    expected_weight_shapes,
)
from perfx_compiler.model.reference import ReferenceModel, greedy


def tiny_config(**over) -> ModelConfig:
    base = {
        "architecture": "llama", "vocab_size": 97, "hidden_size": 48, "intermediate_size": 80, "num_layers": 2,
        "num_heads": 6, "num_kv_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_context": 64,
    }
    base.update(over)
    return ModelConfig(**base)


def random_desc(config: ModelConfig, seed: int = 0) -> ModelDescription:
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in expected_weight_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        else:
            weights[name] = (0.3 * rng.standard_normal(shape)).astype(np.float32)
    desc = ModelDescription(config=config, weights=weights, source="random")
    desc.validate()
    return desc


def loop_reference(desc: ModelDescription, ids: list[int]) -> np.ndarray:
    """Deliberately naive recomputation: per position, per head, explicit pair rotation."""
    c = desc.config
    W = {k: v.astype(np.float64) for k, v in desc.weights.items()}
    hd, half = c.head_dim, c.head_dim // 2
    inv = [1.0 / c.rope_theta ** (2 * i / hd) for i in range(half)]

    def rms(x, w):
        return x / math.sqrt(float(np.mean(x * x)) + c.rms_norm_eps) * w

    def rot(vec, pos):
        out = vec.copy()
        for i in range(half):
            a = pos * inv[i]
            out[i] = vec[i] * math.cos(a) - vec[i + half] * math.sin(a)
            out[i + half] = vec[i + half] * math.cos(a) + vec[i] * math.sin(a)
        return out

    xs = [W["model.embed_tokens.weight"][t].copy() for t in ids]
    for li in range(c.num_layers):
        p = f"model.layers.{li}."
        ks, vs, qs = [], [], []
        for pos, x in enumerate(xs):
            h = rms(x, W[p + "input_layernorm.weight"])
            q = W[p + "self_attn.q_proj.weight"] @ h
            k = W[p + "self_attn.k_proj.weight"] @ h
            v = W[p + "self_attn.v_proj.weight"] @ h
            if c.attention_bias:
                q = q + W[p + "self_attn.q_proj.bias"]
                k = k + W[p + "self_attn.k_proj.bias"]
                v = v + W[p + "self_attn.v_proj.bias"]
            qs.append([rot(q[hh * hd:(hh + 1) * hd], pos) for hh in range(c.num_heads)])
            ks.append([rot(k[g * hd:(g + 1) * hd], pos) for g in range(c.num_kv_heads)])
            vs.append([v[g * hd:(g + 1) * hd] for g in range(c.num_kv_heads)])
        new = []
        for pos, x in enumerate(xs):
            heads = []
            for hh in range(c.num_heads):
                g = hh // (c.num_heads // c.num_kv_heads)
                s = [float(qs[pos][hh] @ ks[t][g]) / math.sqrt(hd) for t in range(pos + 1)]
                m = max(s)
                e = [math.exp(z - m) for z in s]
                heads.append(sum(e[t] / sum(e) * vs[t][g] for t in range(pos + 1)))
            x = x + W[p + "self_attn.o_proj.weight"] @ np.concatenate(heads)
            h = rms(x, W[p + "post_attention_layernorm.weight"])
            gate = W[p + "mlp.gate_proj.weight"] @ h
            up = W[p + "mlp.up_proj.weight"] @ h
            x = x + W[p + "mlp.down_proj.weight"] @ (gate / (1 + np.exp(-gate)) * up)
            new.append(x)
        xs = new
    head = desc.lm_head().astype(np.float64)
    return np.stack([head @ rms(x, W["model.norm.weight"]) for x in xs])


@pytest.mark.parametrize("bias,tied", [(False, False), (True, True)])
def test_incremental_decode_matches_full_forward(bias, tied):
    desc = random_desc(tiny_config(attention_bias=bias, tie_word_embeddings=tied,
                                   architecture="qwen2" if bias else "llama"), seed=1)
    ids = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    m = ReferenceModel(desc)
    full = m.forward(ids)
    assert full.shape == (len(ids), desc.config.vocab_size)
    m.reset()
    parts = [m.forward(ids[:4])] + [m.forward([t]) for t in ids[4:7]] + [m.forward(ids[7:])]
    assert m.position == len(ids)
    np.testing.assert_allclose(np.concatenate(parts), full, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bias", [False, True])
def test_matches_independent_loop_recomputation(bias):
    cfg = tiny_config(attention_bias=bias, architecture="qwen2" if bias else "llama",
                      tie_word_embeddings=bias, num_heads=4, num_kv_heads=2, head_dim=12)
    desc = random_desc(cfg, seed=2)
    ids = [5, 0, 96, 17, 17, 42, 8]
    np.testing.assert_allclose(ReferenceModel(desc).forward(ids), loop_reference(desc, ids),
                               rtol=1e-10, atol=1e-10)


def test_greedy_and_errors():
    desc = random_desc(tiny_config(), seed=3)
    m = ReferenceModel(desc)
    out = greedy(m, [1, 2, 3], 5)
    assert len(out) == 5 and all(0 <= t < desc.config.vocab_size for t in out)
    assert greedy(desc, [1, 2, 3], 5) == out  # fresh model, same tokens
    # Greedy's last token is argmax of the decode logits of the full sequence.
    logits = ReferenceModel(desc).forward([1, 2, 3] + out[:-1])
    assert int(np.argmax(logits[-1])) == out[-1]
    with pytest.raises(ContextLengthError):
        ReferenceModel(desc).forward(list(range(desc.config.max_context + 1)))
    with pytest.raises(ValueError):
        m.forward([desc.config.vocab_size])
    with pytest.raises(ValueError):
        greedy(m, [], 2)


def test_float32_mode_close_to_float64():
    desc = random_desc(tiny_config(), seed=4)
    ids = [7, 8, 9, 10]
    a = ReferenceModel(desc, dtype=np.float32).forward(ids)
    assert a.dtype == np.float32
    np.testing.assert_allclose(a, ReferenceModel(desc).forward(ids), rtol=1e-3, atol=1e-3)


# --- Hugging Face transformers comparison ------------------------------------------------------

def _import_hf():
    try:
        import torch
        import transformers
    except Exception as e:  # noqa: BLE001 - any import failure means "skip"
        print(f"skipping transformers comparison: {e}")
        pytest.skip(f"torch/transformers not importable ({e}); pip install -r tests/requirements-export.txt")
    return torch, transformers


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_matches_transformers(arch):
    torch, transformers = _import_hf()
    torch.manual_seed(0)
    common = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
                  "max_position_embeddings": 256}
    if arch == "llama":
        # llama3 rope scaling with a short original context so all three frequency bands occur.
        rope = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        hf_cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_parameters=rope)
        model = transformers.LlamaForCausalLM(hf_cfg)
    else:
        hf_cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True,
                                          rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        model = transformers.Qwen2ForCausalLM(hf_cfg)
    with torch.no_grad():  # HF zero-inits biases and one-inits norms: randomize so they matter
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model = model.to(torch.float64).eval()
    theta = hf_cfg.rope_parameters["rope_theta"]
    cfg = ModelConfig(architecture=arch, vocab_size=128, hidden_size=64, intermediate_size=96,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                      rope_theta=theta, max_context=256,
                      rope_scaling=dict(hf_cfg.rope_parameters) if arch == "llama" else None, tie_word_embeddings=hf_cfg.tie_word_embeddings,
                      attention_bias=arch == "qwen2")
    sd = {k: v.detach().to(torch.float32).numpy() for k, v in model.state_dict().items()}
    weights = {k: sd[k] for k in expected_weight_shapes(cfg)}
    desc = ModelDescription(config=cfg, weights=weights, source="transformers")
    desc.validate()
    # The float64 torch model must see exactly the float32 values the description holds.
    with torch.no_grad():
        for k, v in model.state_dict().items():
            v.copy_(torch.from_numpy(sd[k].astype(np.float64)))
    ids = [1, 5, 99, 23, 64, 7, 127, 0, 42]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    got = ReferenceModel(desc).forward(ids)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-5, err
