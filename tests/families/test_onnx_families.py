"""Every decoder family's torch.onnx (dynamo) export, read by the foreign-ONNX reader
(``model/foreign_onnx/graph_to_description.py``), against the same family's Hugging Face folder.

The export constant-folds and renames everything, so the reader finds each feature by its structure
(QK-norm, sandwich norms, tanh-GELU, soft-caps, embedding scale, fused projections, interleaved partial
RoPE, two RoPE bases) and takes from config.json only what the graph cannot show (which layers slide, the
window). Its description must equal the HF folder's; two of them are compiled and run against transformers.
What it does not recover, it refuses in one line instead of running a different model.
"""

from __future__ import annotations

import json
import shutil

import family_fixtures as ff
import numpy as np
import onnx
import pytest

from perfx_compiler.errors import UnsupportedModelError
from perfx_compiler.model.loader import load_model

CONTEXT = 64
ATOL_REL = 1e-4


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def _assert_same(onnx_desc, hf_desc) -> None:
    want, got = hf_desc.config.to_dict(), onnx_desc.config.to_dict()
    want.pop("name"), got.pop("name")
    assert got == want
    assert sorted(onnx_desc.weights) == sorted(hf_desc.weights)
    for name, w in hf_desc.weights.items():
        np.testing.assert_array_equal(np.asarray(onnx_desc.weights[name]), w, err_msg=name)
    assert (onnx_desc.tokenizer_json, onnx_desc.chat_template) == (hf_desc.tokenizer_json, hf_desc.chat_template)


@pytest.mark.parametrize("family", ff.FAMILIES)
def test_onnx_reads_as_the_hf_folder(family, family_artifacts):
    hf = load_model(family_artifacts.checkpoint(family), max_context=CONTEXT)
    _assert_same(load_model(family_artifacts.onnx(family), max_context=CONTEXT), hf)


@pytest.mark.parametrize("family", ["gemma3", "glm4", "mistral"])
def test_onnx_compiles_and_matches_transformers(family, family_artifacts, tmp_path):
    """QK-norm, sandwich norms, GeGLU, embedding scale, sliding layers with their own RoPE base (gemma3);
    interleaved partial RoPE, QKV biases, fused gate_up, sandwich norms (glm4); a window on every layer
    (mistral: it used to cap the context at the window)."""
    from perfx_compiler.pipeline import compile_model
    from perfx_compiler.runtime.engine import Engine

    desc = load_model(family_artifacts.onnx(family), max_context=CONTEXT)
    engine = Engine(compile_model(desc, "host", tmp_path / "artifact", progress=False, activations="f32"))
    ids = np.random.default_rng().integers(0, ff.TOKENIZER_VOCAB, size=12).tolist()  # past the window of 4
    got = engine.prefill_all(ids)
    assert _rel(got, ff.transformers_logits(family_artifacts.checkpoint(family), ids)) < ATOL_REL


def test_qk_norm_read_from_the_graph_alone(family_artifacts, tmp_path):
    """No config.json: the Qwen3 graph still shows its QK-norm (it used to load as Llama without it)."""
    folder = tmp_path / "qwen3"
    shutil.copytree(family_artifacts.onnx("qwen3").parent, folder)
    (folder / "config.json").unlink()
    desc = load_model(folder / "model.onnx", max_context=CONTEXT)
    hf = load_model(family_artifacts.checkpoint("qwen3"), max_context=CONTEXT)
    assert desc.config.qk_norm and desc.config.architecture == "llama"
    for name, w in hf.weights.items():
        np.testing.assert_array_equal(desc.weights[name], w, err_msg=name)


def _copy(family_artifacts, family: str, tmp_path, **config) -> tuple:
    folder = tmp_path / family
    shutil.copytree(family_artifacts.onnx(family).parent, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(config)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder / "model.onnx", cfg


def _refused(path, *match: str) -> str:
    with pytest.raises(UnsupportedModelError) as e:
        load_model(path, max_context=CONTEXT)
    msg = str(e.value)
    assert "\n" not in msg
    for m in match:
        assert m in msg, msg
    return msg


def test_refuses_a_family_it_does_not_recover(family_artifacts, tmp_path, monkeypatch):
    """A family with a feature the reader is not (yet) taught is refused by name with the features it would miss."""
    from perfx_compiler.model.foreign_onnx import families as onnx_families

    taught = tuple(f for f in onnx_families.RECOVERED if f not in ("attn_softcap", "final_softcap", "sandwich_norms"))
    monkeypatch.setattr(onnx_families, "RECOVERED", taught)
    _refused(family_artifacts.onnx("gemma2"), "Gemma2ForCausalLM (gemma2)", "attn_softcap", "final_softcap",
             "sandwich_norms", "Hugging Face folder or GGUF")


def test_refuses_a_graph_that_is_not_its_config(family_artifacts, tmp_path):
    """config.json says Llama, the graph has Gemma 2's sandwich norms, GeGLU and soft-caps: not read as Llama."""
    path, _ = _copy(family_artifacts, "gemma2", tmp_path, architectures=["LlamaForCausalLM"], model_type="llama",
                    hidden_act="silu")
    _refused(path, "LlamaForCausalLM", "the graph differs", "attn_softcap (config 0.0, graph 2.0)",
             "Hugging Face folder or GGUF")


def test_refuses_an_unknown_architecture(family_artifacts, tmp_path):
    path, _ = _copy(family_artifacts, "qwen3", tmp_path, architectures=["Qwen3MoeForCausalLM"], num_experts=8)
    _refused(path, "Qwen3MoeForCausalLM", "mixture-of-experts MLP")


def test_refuses_gemma_without_its_config(family_artifacts, tmp_path):
    """Without config.json the sliding layers are unknown: a Gemma 3 graph is refused, not run unwindowed."""
    folder = tmp_path / "gemma3"
    shutil.copytree(family_artifacts.onnx("gemma3").parent, folder)
    (folder / "config.json").unlink()
    _refused(folder / "model.onnx", "no config.json", "sliding window")


def test_refuses_structure_it_does_not_account_for(family_artifacts, tmp_path):
    """A tanh on each attention output (no family has one) is named, not dropped."""
    path, _ = _copy(family_artifacts, "llama", tmp_path)
    model = onnx.load(str(path))
    nodes = list(model.graph.node)
    producer = {o: n for n in nodes for o in n.output}
    # o_proj: the MatMul by a weight whose input is the heads reshaped back to [batch, seq, hidden]
    o_proj = [n for n in nodes if n.op_type == "MatMul" and n.input[0] in producer
              and producer[n.input[0]].op_type == "Reshape"]
    assert len(o_proj) == 2  # one per layer
    for mm in o_proj:
        out = mm.output[0]
        for n in nodes:
            for k, x in enumerate(n.input):
                if x == out:
                    n.input[k] = out + "_tanh"
        model.graph.node.insert(list(model.graph.node).index(mm) + 1, onnx.helper.make_node("Tanh", [out], [out + "_tanh"]))
    onnx.save(model, str(path))
    _refused(path, "does not account for", "Tanh")
