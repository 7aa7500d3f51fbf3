"""int32 index graphs (what vulkan needs, WGSL having no i64) on the host: onnxruntime runs the int32 graph
as the int64 one, and an x86 build with ``"index_dtype": "int32"`` (every PrimFunc narrowed to int32) gives
the int64 build's logits through Engine and BatchEngine, which feed the dtype the manifest records."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from targets_common import MAX_CONTEXT, TOKENS

pytestmark = pytest.mark.targets


def test_onnxruntime_int32_graph_equals_int64(tiny_gguf: Path) -> None:
    import onnxruntime as ort

    from perfx_compiler.model.loader import load_model
    from perfx_compiler.model.onnx_emit import (
        cache_names,
        cache_shape,
        emit_onnx,
        pages_per_sequence,
        pool_names,
        pool_shape,
    )

    desc = load_model(str(tiny_gguf), max_context=MAX_CONTEXT)
    c = desc.config
    rng = np.random.default_rng(0)
    caches = {n: rng.standard_normal(cache_shape(c)).astype(np.float32) for n in cache_names(c.num_layers)}
    npp = pages_per_sequence(c)
    pools = {n: rng.standard_normal(pool_shape(c, 2 * npp)).astype(np.float32) for n in pool_names(c.num_layers)}
    out = {}
    for dt in ("int64", "int32"):
        sess = ort.InferenceSession(emit_onnx(desc, index_dtype=dt).SerializeToString())
        feeds = {"input_ids": np.array([[5, 17, 42]], dt), "past_len": np.array([2], dt), **caches}
        paged = ort.InferenceSession(emit_onnx(desc, index_dtype=dt, kv="paged", batch="batch").SerializeToString())
        table = np.arange(2 * npp).reshape(2, npp)[::-1].astype(dt)
        pfeeds = {"input_ids": np.array([[5], [9]], dt), "positions": np.array([3, 20], dt), "page_table": table}
        out[dt] = sess.run(None, feeds) + paged.run(None, {**pfeeds, **pools})
    for a, b in zip(out["int64"], out["int32"], strict=True):
        assert np.array_equal(a, b)


@pytest.fixture(scope="module")
def int32_host_build(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The host target file with ``"index_dtype": "int32"`` (a private target file, named by its path)."""
    from perfx_compiler.pipeline import compile_model
    from perfx_compiler.targets import load_target, targets_dir

    tdir = tmp_path_factory.mktemp("targets")
    host = load_target("host")
    shutil.copy(targets_dir() / f"{host.name}.json", tdir)
    data = json.loads((tdir / f"{host.name}.json").read_text())
    data.update(name="host-int32", index_dtype="int32")
    (tdir / "host-int32.json").write_text(json.dumps(data))
    out = tmp_path_factory.mktemp("i32") / "a"
    return compile_model(str(tiny_gguf), str(tdir / "host-int32.json"), out, progress=False, max_context=MAX_CONTEXT)


def test_int32_build_engine_matches_int64(int32_host_build: Path, host_logits) -> None:
    from perfx_compiler.runtime.engine import Engine

    assert json.loads((int32_host_build / "perfx-config.json").read_text())["index_dtype"] == "int32"
    engine = Engine(int32_host_build)
    assert engine.index_dtype == np.int32
    got = np.stack([engine.decode(t) for t in TOKENS])
    assert np.abs(got - host_logits).max() < 1e-4


def test_int32_build_batch_engine_matches_int64(int32_host_build: Path, host_logits) -> None:
    from perfx_compiler.runtime.batch_engine import BatchEngine

    batch = BatchEngine(int32_host_build, max_batch=2)
    seqs = [batch.add_sequence(), batch.add_sequence()]
    rows = [np.stack([batch.prefill(s, TOKENS[:1]) for s in seqs])]
    for tok in TOKENS[1:]:
        rows.append(batch.decode(seqs, [tok, tok]))
    got = np.stack(rows, axis=1)  # [2 sequences, steps, vocab]
    for s in range(2):
        assert np.abs(got[s] - host_logits).max() < 1e-4
