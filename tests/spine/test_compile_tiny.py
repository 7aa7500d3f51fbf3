"""Tiny random models through the whole spine: GGUF -> ONNX -> Relax -> artifact -> runtime."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest

from perfx_compiler.model.gguf import load_gguf
from perfx_compiler.model.onnx_emit import cache_names, cache_shape, emit_onnx
from perfx_compiler.model.reference import ReferenceModel
from perfx_compiler.model.testing import write_tiny_gguf
from perfx_compiler.pipeline import compile_model
from perfx_compiler.runtime.engine import Engine

VARIANTS = {
    "llama-gqa-tied": dict(arch="llama", heads=4, kv_heads=2, tied=True),
    "qwen2-bias-untied": dict(arch="qwen2", heads=4, kv_heads=1, tied=False, with_bias=True),
    "llama-mha-q8": dict(arch="llama", heads=4, kv_heads=4, qtype="Q8_0", seed=3),
}


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    path, _ = write_tiny_gguf(root / "m.gguf", context_length=96, **VARIANTS[request.param])
    desc = load_gguf(path)
    art = compile_model(desc, "host", root / "art", progress=False, activations="f32")  # 1e-3 checks
    return desc, art


def test_prefill_and_32_decode_steps_match_reference(tiny):
    desc, art = tiny
    rng = np.random.default_rng()  # fresh inputs every run
    ids = rng.integers(0, desc.config.vocab_size, size=7 + 32).tolist()
    ref = ReferenceModel(desc).forward(ids)
    eng = Engine(art)
    got = [eng.prefill(ids[:7])[0]]
    for t in ids[7:]:
        got.append(eng.decode(t))
    # prefill returns the last prompt position; decode steps follow
    assert rel_err(np.stack(got), ref[6:]) < 1e-3
    eng.reset()
    assert rel_err(eng.prefill_all(ids[:20]), ref[:20]) < 1e-3


def test_chunked_prefill_equals_one_shot(tiny):
    desc, art = tiny
    ids = np.random.default_rng().integers(0, desc.config.vocab_size, size=24).tolist()
    eng = Engine(art)
    whole = eng.prefill_all(ids)
    eng.reset()
    parts = np.concatenate([eng.prefill_all(ids[:5]), eng.prefill_all(ids[5:17]), eng.prefill_all(ids[17:])])
    assert rel_err(parts, whole) < 1e-5


def test_emitted_onnx_runs_in_onnxruntime(tiny):
    desc, _ = tiny
    c = desc.config
    sess = ort.InferenceSession(emit_onnx(desc).SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.random.default_rng().integers(0, c.vocab_size, size=9)
    caches = {n: np.zeros(cache_shape(c), np.float32) for n in cache_names(c.num_layers)}
    out = sess.run(None, {"input_ids": ids[None, :6], "past_len": np.array([0]), **caches})
    logits = [out[0][0]]
    for t in range(6, 9):
        caches = dict(zip(cache_names(c.num_layers), out[1:], strict=True))
        out = sess.run(None, {"input_ids": ids[None, t : t + 1], "past_len": np.array([t]), **caches})
        logits.append(out[0][0])
    assert rel_err(np.concatenate(logits), ReferenceModel(desc).forward(ids.tolist())) < 1e-4


def test_artifact_layout_and_manifest(tiny):
    desc, art = tiny
    manifest = json.loads((art / "perfx-config.json").read_text())
    assert {"model.so", "weights.bin", "tokenizer.json"} <= set(manifest["files"])
    assert all(len(h) == 64 for h in manifest["files"].values())
    assert manifest["model"]["num_layers"] == desc.config.num_layers
    assert manifest["target"]["name"].startswith("x86")
    assert manifest["tvm_version"].startswith("0.27")
    assert manifest["kv_cache"]["count"] == 2 * desc.config.num_layers


def test_kv_cache_is_updated_in_place(tiny):
    """The cache tensors allocated at load are the ones the kernel writes (no per-step copies)."""
    desc, art = tiny
    eng = Engine(art)
    before = [id(c) for c in eng._caches]
    eng.prefill([1, 2, 3])
    k0 = eng._caches[0].numpy()
    assert np.abs(k0[0, :, :3]).sum() > 0 and np.abs(k0[0, :, 3:]).sum() == 0
    eng.decode(4)
    assert np.abs(eng._caches[0].numpy()[0, :, 3]).sum() > 0
    assert [id(c) for c in eng._caches] == before


def test_compile_graphs_leave_out_the_metadata(tiny, tmp_path, monkeypatch):
    """The graphs the compile imports (``emit_onnx(..., metadata=False)``) carry no model props (a large
    vocabulary's tokenizer would be tens of MB in each); the emitted model keeps config and tokenizer, and
    the artifact has its tokenizer."""
    from perfx_compiler.frontend import onnx_import

    desc, art = tiny
    imported = []

    class Enough(Exception):
        pass

    def spy(graph, *args, **kwargs):  # the compile's first import: its graph is what the pipeline emitted
        imported.append(graph)
        raise Enough

    monkeypatch.setattr(onnx_import, "import_onnx", spy)
    with pytest.raises(Exception):  # noqa: B017  (Enough, or the compile's wrapping of it)
        compile_model(desc, "host", tmp_path / "stopped", progress=False)
    assert len(imported) == 1 and not imported[0].metadata_props
    assert desc.tokenizer_json
    props = {p.key: p.value for p in emit_onnx(desc).metadata_props}
    assert props["perfx.tokenizer"] == desc.tokenizer_json and "perfx.config" in props
    assert not emit_onnx(desc, weights="inputs", metadata=False).metadata_props
    assert (art / "tokenizer.json").read_text() == desc.tokenizer_json
