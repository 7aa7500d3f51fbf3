"""Batched decode over the paged KV pool matches the reference per sequence."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from perfx_compiler.errors import ContextLengthError, KVCacheFullError
from perfx_compiler.model.gguf import load_gguf
from perfx_compiler.model.onnx_emit import emit_onnx, pages_per_sequence, pool_names, pool_shape
from perfx_compiler.model.reference import ReferenceModel
from perfx_compiler.model.testing import write_tiny_gguf
from perfx_compiler.pipeline import compile_model
from perfx_compiler.runtime.batch_engine import BatchEngine


def rel_err(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    path, _ = write_tiny_gguf(root / "m.gguf", context_length=64, heads=4, kv_heads=2)
    desc = load_gguf(path)
    art = compile_model(desc, "host", root / "art", progress=False, batching=True)
    return desc, art


def test_batched_decode_matches_reference_per_sequence(tiny):
    desc, art = tiny
    eng = BatchEngine(art, max_batch=4)
    rng = np.random.default_rng()
    prompts = [5, 17, 9]  # crossing page boundaries (page size 16) at different steps
    seqs = [rng.integers(0, desc.config.vocab_size, 40) for _ in prompts]
    ids = [eng.add_sequence() for _ in prompts]
    got = [[eng.prefill(i, s[:n])] for i, s, n in zip(ids, seqs, prompts, strict=True)]
    pos = list(prompts)
    for _ in range(12):
        logits = eng.decode(ids, [s[p] for s, p in zip(seqs, pos, strict=True)])
        for r in range(len(ids)):
            got[r].append(logits[r])
            pos[r] += 1
    for r, n in enumerate(prompts):
        ref = ReferenceModel(desc).forward(seqs[r][: n + 12].tolist())
        assert rel_err(np.stack(got[r]), ref[n - 1 : n + 12]) < 1e-3


def test_pages_are_freed_and_pool_exhaustion_is_an_error(tiny):
    desc, art = tiny
    eng = BatchEngine(art, max_batch=2, num_pages=3)
    a = eng.add_sequence()
    eng.prefill(a, list(range(20)))  # 2 pages
    assert eng.pages_in_use() == 2
    b = eng.add_sequence()
    with pytest.raises(KVCacheFullError):
        eng.prefill(b, list(range(20)))
    eng.remove_sequence(a)
    assert eng.pages_in_use() == 0
    eng.prefill(b, list(range(20)))
    with pytest.raises(ContextLengthError):
        eng.prefill(b, list(range(60)))


def test_paged_onnx_graph_runs_in_onnxruntime(tiny):
    desc, _ = tiny
    c = desc.config
    sess = ort.InferenceSession(emit_onnx(desc, kv="paged", batch="B").SerializeToString(), providers=["CPUExecutionProvider"])
    pools = {n: np.zeros(pool_shape(c, 6), np.float32) for n in pool_names(c.num_layers)}
    table = np.zeros((1, pages_per_sequence(c)), np.int64)
    table[0, :2] = [4, 1]
    ids = np.random.default_rng().integers(0, c.vocab_size, 20)
    out = sess.run(None, {"input_ids": ids[None], "positions": np.array([0]), "page_table": table, **pools})
    assert rel_err(out[0][0, -1], ReferenceModel(desc).forward(ids.tolist())[-1]) < 1e-4
