"""Fuzzing the ONNX readers: 170 mutated ONNX files, half from a graph PerfX emitted
(``--emit-onnx``: config and tokenizer in its metadata, read by ``model/onnx_read.py``), half from
an onnxruntime-genai-style int4 decoder (recognised by ``model/foreign_onnx/graph_to_description.py``).
Every case must end in a PerfXError with a message or a description that validates.

``PERFX_FUZZ_SEED=N`` draws another set; a failure names each bad case's id, seed and file.
"""

from __future__ import annotations

import sys
from pathlib import Path

import onnx
import pytest
from fuzz_harness import case_seed, run_and_check
from onnx_mutate import KINDS, mutate

from perfx_compiler.model.loader import load_model
from perfx_compiler.model.onnx_emit import save_onnx
from perfx_compiler.model.testing import write_tiny_gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frontend"))
from genai_testgraph import GenaiSpec, build_genai_model  # noqa: E402


def make_cases(root: Path) -> list[dict]:
    """Write every mutated file under ``root``: the genai mutants sit next to the base's genai_config.json."""
    gguf, _ = write_tiny_gguf(root / "tiny.gguf", context_length=64)
    emitted = save_onnx(load_model(gguf), root / "emitted" / "model.onnx") if (root / "emitted").mkdir() is None else None
    genai, _ = build_genai_model(root / "genai", GenaiSpec(layers=2, hidden=64, ffn=128, vocab=300, context=64))
    cases = []
    for base, path in (("emitted", emitted), ("genai", genai)):
        model = onnx.load(str(path))
        for kind, count in KINDS.items():
            for n in range(count):
                seed = case_seed(base, kind, n)
                out = path.parent / f"mut-{kind}-{n}.onnx"
                out.write_bytes(mutate(model, kind, seed))
                cases.append({"id": f"{base}/{kind}/{n}", "seed": seed, "op": "load_model", "path": str(out)})
    return cases


@pytest.fixture(scope="module")
def onnx_cases(tmp_path_factory) -> list[dict]:
    return make_cases(tmp_path_factory.mktemp("fuzz_onnx"))


def test_mutated_onnx_files_fail_cleanly(onnx_cases):
    assert len(onnx_cases) >= 100
    results = run_and_check("ONNX", onnx_cases)
    assert {r["status"] for r in results} == {"ok", "perfx"}
