"""The decoder-family fixtures themselves: each family's checkpoint reloads with its features switched
on (and each feature changes the logits), its transformers-4 style config.json is the same model,
llama.cpp's conversion agrees with transformers (f32; Q8_0 and Q4_K_M coarsely), and the ONNX export
agrees with transformers under onnxruntime, through prefill and cached decode steps. ``-rA`` or the
end-of-run section "decoder-family fixtures" prints the measured errors.

Measured on this suite's checkpoints (llama-cpp-python 0.3.36, f32 GGUF, f32 KV cache): max |diff| /
max |logit| ~2e-7 for every family but the Gemmas (~7e-4: ggml evaluates GELU through an fp16 lookup
table); onnxruntime ~1e-6. Mistral: llama.cpp has no sliding window for it (arch llama), so it is exact
only on the first SLIDING_WINDOW positions.
"""

from __future__ import annotations

import copy
import json

import family_fixtures as ff
import numpy as np
import pytest

PROMPT = "The old fisherman walked down to the harbour and mended the nets in the morning."
N_IDS = 16  # four sliding windows
GGUF_TOL = {"gemma2": 3e-3, "gemma3": 3e-3}  # ggml's GELU: fp16 lookup table
GGUF_TOL_DEFAULT = 1e-5
ONNX_TOL = 1e-5

pytest.importorskip("onnxruntime")


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def ids(family_artifacts) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(family_artifacts.checkpoint("llama"))
    return [ff.BOS_ID, *tok.encode(PROMPT, add_special_tokens=False)[: N_IDS - 1]]


# family -> (parameter names that must exist, config checks)
FEATURES = {
    "llama": (["lm_head.weight"], lambda c: c.rope_parameters["rope_type"] == "llama3"
              and c.rope_parameters["original_max_position_embeddings"] == 32 and not c.tie_word_embeddings),
    "mistral": ([], lambda c: c.sliding_window == ff.SLIDING_WINDOW),
    "qwen2": (["q_proj.bias", "k_proj.bias", "v_proj.bias"], lambda c: c.tie_word_embeddings),
    "qwen3": (["q_norm.weight", "k_norm.weight"], lambda c: c.head_dim * c.num_attention_heads != c.hidden_size),
    "gemma2": (["post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"],
               lambda c: c.attn_logit_softcapping and c.final_logit_softcapping
               and c.query_pre_attn_scalar != c.head_dim and c.sliding_window == ff.SLIDING_WINDOW
               and set(c.layer_types) == {"sliding_attention", "full_attention"}),
    "gemma3": (["q_norm.weight", "k_norm.weight", "post_attention_layernorm", "post_feedforward_layernorm"],
               lambda c: c.sliding_window == ff.SLIDING_WINDOW
               and set(c.layer_types) == {"sliding_attention", "full_attention"}
               and c.rope_parameters["sliding_attention"]["rope_theta"]
               != c.rope_parameters["full_attention"]["rope_theta"]),
    "phi3": (["qkv_proj.weight", "gate_up_proj.weight"], lambda c: c.rope_parameters["partial_rotary_factor"] == 0.5),
    "glm4": (["q_proj.bias", "post_self_attn_layernorm", "post_mlp_layernorm", "gate_up_proj.weight"],
             lambda c: c.rope_parameters["partial_rotary_factor"] == 0.5),
    "glm": (["q_proj.bias", "gate_up_proj.weight"], lambda c: c.rope_parameters["partial_rotary_factor"] == 0.5),
}


@pytest.mark.parametrize("family", ff.FAMILIES)
def test_checkpoint_reloads_with_its_features(family, family_artifacts):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = family_artifacts.checkpoint(family)
    assert {p.name for p in folder.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                                  "tokenizer_config.json", "generation_config.json"}
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert type(model).__name__ == ff.ARCHITECTURES[family]
    assert not info["missing_keys"] and not info["unexpected_keys"]
    cfg = model.config
    names, check = FEATURES[family]
    params = dict(model.named_parameters())
    for want in names:
        assert any(want in n for n in params), f"{family}: no parameter named *{want}*"
    assert check(cfg), f"{family}: config lacks its features: {cfg}"
    for name, p in params.items():  # every parameter random (no zero biases, no unit norms)
        assert p.dtype == torch.float32
        assert float(p.detach().std()) > 0.05 and abs(float(p.detach().mean())) < 0.2, name
    tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok) == cfg.vocab_size
    assert (tok.bos_token_id, tok.eos_token_id, cfg.bos_token_id, cfg.eos_token_id) == (ff.BOS_ID, ff.EOS_ID) * 2
    assert tok.decode(tok.encode(PROMPT, add_special_tokens=False)) == PROMPT


@pytest.mark.parametrize("family", ff.FAMILIES)
def test_v4_style_config_is_the_same_model(family, family_artifacts, ids):
    """config_style="v4" (rope_theta / rope_scaling / partial_rotary_factor / rope_local_base_freq, as
    checkpoints saved by transformers 4 carry them) loads to the same logits as the v5 file."""
    v4 = family_artifacts.checkpoint(family, config_style="v4")
    cfg = json.loads((v4 / "config.json").read_text())
    assert "rope_parameters" not in cfg and "rope_theta" in cfg
    assert (family == "llama") == (cfg["rope_scaling"] is not None)
    assert (family == "gemma3") == ("rope_local_base_freq" in cfg)
    ref = ff.transformers_logits(family_artifacts.checkpoint(family), ids)
    assert np.array_equal(ff.transformers_logits(v4, ids), ref)


def _without(family: str, feature: str, cfg):
    cfg = copy.deepcopy(cfg)
    if feature == "sliding window":
        cfg.sliding_window = 10_000
    elif feature == "llama3 rope scaling":
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_parameters["rope_theta"]}
    elif feature == "attention softcap":
        cfg.attn_logit_softcapping = None
    elif feature == "final softcap":
        cfg.final_logit_softcapping = None
    elif feature == "query_pre_attn_scalar":
        cfg.query_pre_attn_scalar = cfg.head_dim
    elif feature == "local rope base":
        cfg.rope_parameters["sliding_attention"]["rope_theta"] = cfg.rope_parameters["full_attention"]["rope_theta"]
    elif feature == "partial rotary":
        cfg.rope_parameters["partial_rotary_factor"] = 1.0
    else:
        raise AssertionError(feature)
    return cfg


@pytest.mark.parametrize("family,feature", [
    ("llama", "llama3 rope scaling"), ("mistral", "sliding window"), ("gemma2", "sliding window"),
    ("gemma2", "attention softcap"), ("gemma2", "final softcap"), ("gemma2", "query_pre_attn_scalar"),
    ("gemma3", "sliding window"), ("gemma3", "local rope base"), ("phi3", "partial rotary"),
    ("glm4", "partial rotary"), ("glm", "partial rotary"),
])
def test_feature_changes_logits(family, feature, family_artifacts, ids):
    """Each config-level feature matters numerically on these weights and this prompt."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = family_artifacts.checkpoint(family)
    cfg = _without(family, feature, AutoConfig.from_pretrained(folder))
    model = AutoModelForCausalLM.from_pretrained(folder, config=cfg, dtype=torch.float64,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        other = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].numpy()
    assert _rel(other, ff.transformers_logits(folder, ids)) > 1e-2


@pytest.mark.parametrize("family", ff.FAMILIES)
def test_transformers_greedy_follows_logits(family, family_artifacts, ids):
    folder = family_artifacts.checkpoint(family)
    got = ff.transformers_greedy(folder, ids[:8], 6)
    seq = ids[:8] + got
    want = ff.transformers_logits(folder, seq)[7:-1].argmax(axis=1).tolist()
    assert got == want


@pytest.mark.parametrize("family", ff.FAMILIES)
def test_gguf_f32_matches_transformers(family, family_artifacts, ids, family_report):
    from perfx_compiler.model.gguf_header import read_gguf_header

    gguf = family_artifacts.gguf(family)
    arch = read_gguf_header(gguf).fields["general.architecture"]
    ref = ff.transformers_logits(family_artifacts.checkpoint(family), ids)
    got = ff.llamacpp_logits(gguf, ids)
    exact_upto, why = ff.GGUF_NOTES.get(family, (None, ""))
    n = len(ids) if exact_upto is None else exact_upto
    err = _rel(got[:n], ref[:n])
    top1 = float((got[:n].argmax(1) == ref[:n].argmax(1)).mean())
    note = f"; positions >= {n}: rel {_rel(got[n:], ref[n:]):.1e} ({why})" if n < len(ids) else ""
    family_report(family, "gguf f32", f"arch {arch}: rel {err:.1e}, top-1 {top1:.0%} on {n} positions{note}")
    assert top1 >= 0.9 and err < GGUF_TOL.get(family, GGUF_TOL_DEFAULT), (family, err, top1)
    if n < len(ids):  # the documented gap is real: if llama.cpp gains it, update GGUF_NOTES
        assert _rel(got[n:], ref[n:]) > 1e-2, f"{family}: llama.cpp now agrees past position {n}: {why}"


@pytest.mark.parametrize("family", ff.FAMILIES)
def test_gguf_q8_0_runs_close(family, family_artifacts, ids, family_report):
    """Q8_0 (llama.cpp also rounds the activations to 8 bits): measured rel 1-6e-2 on these models."""
    gguf = family_artifacts.gguf(family, "Q8_0")
    ref = ff.transformers_logits(family_artifacts.checkpoint(family), ids)
    n = ff.GGUF_NOTES.get(family, (None, ""))[0] or len(ids)
    got = ff.llamacpp_logits(gguf, ids)[:n]
    err, top1 = _rel(got, ref[:n]), float((got.argmax(1) == ref[:n].argmax(1)).mean())
    family_report(family, "gguf Q8_0", f"rel {err:.1e}, top-1 {top1:.0%}")
    assert err < 0.15 and top1 >= 0.75


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama"])
def test_gguf_q4_k_m_real_k_blocks(family, family_artifacts, ids, family_report):
    """At KQUANT_SIZES every row is 256-wide, so Q4_K_M holds real Q4_K / Q6_K blocks (at the default
    sizes llama.cpp falls back to Q5_0 / Q8_0)."""
    from perfx_compiler.model.gguf_header import read_gguf_header

    gguf = family_artifacts.gguf(family, "Q4_K_M", **ff.KQUANT_SIZES)
    types = {t.tensor_type.name for t in read_gguf_header(gguf).tensors}
    assert {"Q4_K", "Q6_K"} <= types, types
    ref = ff.transformers_logits(family_artifacts.checkpoint(family, **ff.KQUANT_SIZES), ids)
    got = ff.llamacpp_logits(gguf, ids)
    err = _rel(got, ref)
    family_report(family, "gguf Q4_K_M", f"{sorted(types)} at {ff.KQUANT_SIZES}: rel {err:.1e}")
    assert np.isfinite(got).all() and err < 1.0


@pytest.mark.parametrize("family", ff.FAMILIES)
def test_onnx_matches_transformers(family, family_artifacts, ids, family_report):
    import onnx
    from transformers import AutoConfig

    graph = family_artifacts.onnx(family)
    m = onnx.load(str(graph), load_external_data=False)
    n_layers = AutoConfig.from_pretrained(graph.parent).num_hidden_layers
    assert [i.name for i in m.graph.input][:3] == ["input_ids", "attention_mask", "position_ids"]
    assert len(m.graph.input) == 3 + 2 * n_layers and m.graph.output[0].name == "logits"
    ref = ff.transformers_logits(family_artifacts.checkpoint(family), ids)
    got = ff.onnx_logits(graph, ids, prefill=6)  # 6 tokens at once, then 10 cached decode steps
    err = _rel(got, ref)
    family_report(family, "onnx", f"rel {err:.1e} (prefill 6 + {len(ids) - 6} decode steps)")
    assert err < ONNX_TOL
