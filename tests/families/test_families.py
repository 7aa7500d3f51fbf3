"""Every decoder family, compiled from its Hugging Face folder and read from the GGUF llama.cpp's own
converter writes, against transformers (float64) on fresh token ids.

The HF folder is compiled for this CPU (float activations): prefill, decode steps and 32 greedy tokens are
held to transformers. The GGUF is read into a description that must equal the HF folder's (same features,
same weights in the canonical layout), so it compiles to the same artifact; one GGUF per RoPE layout and
per fused-projection layout is also compiled and run end to end.
"""

from __future__ import annotations

import family_fixtures as ff
import numpy as np
import pytest

CONTEXT = 64
ATOL_REL = 1e-4


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def _ids(n: int) -> list[int]:
    return np.random.default_rng().integers(0, ff.TOKENIZER_VOCAB, size=n).tolist()


def _compile(desc, tmp_path):
    from perfx_compiler.pipeline import compile_model
    from perfx_compiler.runtime.engine import Engine

    return Engine(compile_model(desc, "host", tmp_path / "artifact", progress=False, activations="f32"))


def _prefill_then_decode(engine, ids: list[int], prefill: int) -> np.ndarray:
    engine.reset()
    rows = [engine.prefill_all(ids[:prefill])]
    rows += [engine.decode(t).reshape(1, -1) for t in ids[prefill:]]
    return np.concatenate(rows)


@pytest.mark.parametrize("family", ff.FAMILIES)
def test_hf_folder_compiles_and_matches_transformers(family, family_artifacts, tmp_path):
    from perfx_compiler.model.loader import load_model

    folder = family_artifacts.checkpoint(family)
    desc = load_model(folder, max_context=CONTEXT)
    assert desc.config.architecture == family
    engine = _compile(desc, tmp_path)
    ids = _ids(16)  # longer than the fixtures' sliding window of 4
    got = _prefill_then_decode(engine, ids, prefill=6)
    assert _rel(got, ff.transformers_logits(folder, ids)) < ATOL_REL
    prompt = ids[:5]
    engine.reset()
    logits, greedy = engine.prefill(prompt)[0], []
    for _ in range(32):
        greedy.append(int(np.argmax(logits)))
        logits = engine.decode(greedy[-1])
    assert greedy == ff.transformers_greedy(folder, prompt, 32)


def _features(cfg) -> dict:
    d = cfg.to_dict()
    for k in ("name", "max_context", "bos_token_id", "eos_token_ids", "add_bos_token", "rope_scaling"):
        d.pop(k)
    # GGUF stores float32: compare every number as the file can hold it
    return {k: float(np.float32(v)) if isinstance(v, float) else v for k, v in d.items()}


@pytest.mark.parametrize("family", ff.FAMILIES)
def test_gguf_reads_as_the_hf_folder(family, family_artifacts):
    """llama.cpp's converter permutes, fuses, renames and offsets (Gemma's 1 + w) differently per family;
    the reader must undo all of it: the same features and the same canonical weights as the HF folder."""
    from perfx_compiler.model.loader import load_model

    hf = load_model(family_artifacts.checkpoint(family), max_context=CONTEXT)
    gg = load_model(family_artifacts.gguf(family), max_context=CONTEXT)
    want, got = _features(hf.config), _features(gg.config)
    if family == "mistral":  # llama.cpp runs Mistral as arch 'llama': its converter drops the window
        assert (got["architecture"], got["sliding_window"]) == ("llama", 0)
        want.update(architecture="llama", sliding_window=0, sliding_layers=[])
    if family == "glm":  # llama.cpp's converter writes GlmForCausalLM as arch 'chatglm'
        want["architecture"] = got["architecture"]
    hf_weights = dict(hf.weights)
    if family == "gemma2":  # the fixture's converter folds query_pre_attn_scalar into attn_q (GGUF has no field)
        for name in [n for n in hf_weights if n.endswith("q_proj.weight")]:
            hf_weights[name] = hf_weights[name] * np.float32(want["query_scale"] / got["query_scale"])
        want["query_scale"] = got["query_scale"]
    assert got == want
    assert sorted(gg.weights) == sorted(hf_weights)
    for name, w in hf_weights.items():
        np.testing.assert_allclose(np.asarray(gg.weights[name]), w, rtol=1e-6, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("family", ff.FAMILIES)
def test_lazy_hf_folder_reads_as_the_eager_one(family, family_artifacts):
    """Every family's matrices loaded lazily (model/lazy.py: the mapped safetensors rows, split and reordered
    where they are read, as phi3's fused QKV and the RoPE layouts need) are the eager load's float32 weights."""
    from perfx_compiler.model.lazy import is_lazy
    from perfx_compiler.model.loader import load_model

    eager = load_model(family_artifacts.checkpoint(family), max_context=CONTEXT, lazy=False)
    lazy = load_model(family_artifacts.checkpoint(family), max_context=CONTEXT, lazy=True)
    assert sorted(lazy.weights) == sorted(eager.weights)
    assert all(is_lazy(lazy.weights[n]) for n, w in eager.weights.items() if w.ndim == 2)
    for name, w in eager.weights.items():
        assert np.array_equal(np.asarray(lazy.weights[name]), w), name


@pytest.mark.parametrize("family", ["gemma3", "phi3", "glm4"])
def test_gguf_compiles_and_matches_transformers(family, family_artifacts, tmp_path):
    """End to end from llama.cpp's file: rotate-half with QK-norm and two RoPE bases (gemma3), fused
    qkv/gate_up rows (phi3), interleaved partial RoPE with fused gate_up (glm4)."""
    from perfx_compiler.model.loader import load_model

    engine = _compile(load_model(family_artifacts.gguf(family), max_context=CONTEXT), tmp_path)
    ids = _ids(16)
    got = _prefill_then_decode(engine, ids, prefill=7)
    # llama.cpp's converter stores Gemma's (1 + w) norms in float32 as we do: same tolerance
    assert _rel(got, ff.transformers_logits(family_artifacts.checkpoint(family), ids)) < ATOL_REL


def test_unknown_architecture_names_its_missing_features(tmp_path, family_artifacts):
    import json
    import shutil

    from perfx_compiler.errors import UnsupportedModelError
    from perfx_compiler.model.loader import load_model

    folder = tmp_path / "moe"
    shutil.copytree(family_artifacts.checkpoint("qwen3"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(architectures=["Qwen3MoeForCausalLM"], num_experts=8, moe_intermediate_size=32)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts MLP") as e:
        load_model(folder)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_batched_serving_matches_offline(family, family_artifacts, tmp_path):
    """The serving path (paged KV cache, continuous batching, chunked prefill) on windowed, soft-capped,
    two-RoPE-base models: every request's greedy tokens equal the offline single-sequence run."""
    from perfx_compiler.llm import LLM
    from perfx_compiler.pipeline import compile_model
    from perfx_compiler.runtime.api import SamplingParams
    from perfx_compiler.runtime.batch_engine import BatchEngine
    from perfx_compiler.serve.scheduler import Scheduler

    art = compile_model(str(family_artifacts.checkpoint(family)), "host", tmp_path / "art", progress=False,
                        max_context=CONTEXT, activations="f32", batching=True)
    llm = LLM(str(art))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [_ids(n) for n in (3, 9, 17)]  # shorter and longer than the window of 4
    offline = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    engine = BatchEngine(art, max_batch=4)
    sched = Scheduler(engine, llm.get_tokenizer(), prefill_chunk=5)
    sched.start()
    try:
        served = [h.result(timeout=120)[0].token_ids for h in [sched.submit(p, params) for p in prompts]]
    finally:
        sched.shutdown()
    assert served == offline
