"""CPU codegen one kernel per module (``codegen_parts``), in threads: every PrimFunc becomes its own object file, the
artifact linked from them computes what one ``tvm.compile`` of the whole module computes (bit for bit:
the same LLVM code per kernel), and the object files are gone after the compile, a failed one included."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import tvm

from perfx_compiler import codegen_parts, pipeline
from perfx_compiler.errors import PerfXError
from perfx_compiler.model.gguf import load_gguf
from perfx_compiler.model.testing import write_tiny_gguf
from perfx_compiler.runtime.engine import Engine


def _whole_module_build(mod, target, relax_pipeline, tir_pipeline, object_dir, progress=False):
    return tvm.compile(mod, target=target, relax_pipeline=relax_pipeline, tir_pipeline=tir_pipeline)


def test_kernels_built_one_by_one_equal_one_module_and_leave_no_objects(tmp_path, monkeypatch):
    gguf, _ = write_tiny_gguf(tmp_path / "m.gguf", qtype="Q4_K", vocab=320, hidden=256, ffn=512, context_length=64,
                              seed=int(np.random.default_rng().integers(1 << 30)))
    desc = load_gguf(gguf)
    seen = {"modules": [], "threads": set()}
    build = codegen_parts.build_in_parts
    tir_build = tvm.tirx.build

    def spy(mod, *args, **kwargs):
        ex = build(mod, *args, **kwargs)
        seen["dir"] = args[3]
        seen["objects"] = sorted(p.name for p in args[3].iterdir())
        return ex

    def count(mod, *args, **kwargs):
        seen["modules"].append(len(mod.functions))
        seen["threads"].add(threading.get_ident())
        return tir_build(mod, *args, **kwargs)

    monkeypatch.setattr(codegen_parts, "build_in_parts", spy)
    monkeypatch.setattr(tvm.tirx, "build", count)
    parts = pipeline.compile_model(desc, "host", tmp_path / "parts", progress=False)
    # one LLVM module per kernel; all but the first (which stays in memory: see build_in_parts) as objects
    assert len(seen["modules"]) > 10 and set(seen["modules"]) == {1}
    assert len(seen["objects"]) == len(seen["modules"]) - 1
    # in threads, one per CPU up to the bound
    assert len(seen["threads"]) == min(codegen_parts.CODEGEN_THREADS, len(os.sched_getaffinity(0)))
    assert not seen["dir"].exists()

    monkeypatch.setattr(codegen_parts, "build_in_parts", _whole_module_build)
    whole = pipeline.compile_model(desc, "host", tmp_path / "whole", progress=False)
    ids = np.random.default_rng().integers(0, desc.config.vocab_size, size=12).tolist()
    got = []
    for art in (parts, whole):
        eng = Engine(art)
        got.append(np.concatenate([eng.prefill_all(ids[:9]), eng.decode(ids[9])[None], eng.decode(ids[10])[None]]))
    assert np.array_equal(got[0], got[1])

    def fail(state):
        raise PerfXError("packaging failed")

    monkeypatch.setattr(codegen_parts, "build_in_parts", spy)
    seen["objects"] = []
    monkeypatch.setattr(pipeline, "PHASES", [(n, fail if n == "package" else f) for n, f in pipeline.PHASES])
    with pytest.raises(PerfXError, match="packaging failed"):
        pipeline.compile_model(desc, "host", tmp_path / "failed", progress=False)
    assert seen["objects"] and not seen["dir"].exists()
