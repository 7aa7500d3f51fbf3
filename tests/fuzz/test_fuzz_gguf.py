"""Fuzzing the GGUF reader: 738 mutated tiny GGUF files (F32, Q4_0 and Q8_0), each loaded the way
perfx-compile loads a model. Every case must end in a PerfXError with a message, or a model that
loads and validates; never a crash, a hang or another exception.

``PERFX_FUZZ_SEED=N`` draws another set of mutations (the default is fixed so CI is repeatable);
a failure names each bad case's id, seed and file.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fuzz_harness import case_seed, run_and_check
from gguf_mutate import KINDS, layout, mutate

from perfx_compiler.model.testing import write_tiny_gguf

# What the message of a cut file says (one of).
TRUNCATED = ("past the end of the file", "more than", "shorter than", "is empty", "not a GGUF file")
# name -> write_tiny_gguf arguments: float, and the two quantized types PerfX keeps as raw blocks
BASES = {
    "f32": {},
    "q4_0": {"qtype": "Q4_0"},
    "q8_0": {"qtype": "Q8_0", "embed_qtype": "Q8_0", "tied": False, "layers": 1},
}


def make_cases(root: Path) -> list[dict]:
    """Write every mutated file under ``root``; one case per file."""
    cases = []
    for base, kwargs in BASES.items():
        path, _ = write_tiny_gguf(root / f"{base}.gguf", context_length=64, **kwargs)
        data = path.read_bytes()
        lay = layout(data)
        assert lay.data < len(data) and len(lay.fields["data_offset"]) > 5
        for kind, count in KINDS.items():
            for n in range(count):
                seed = case_seed(base, kind, n)
                out = root / f"{base}-{kind}-{n}.gguf"
                bad = mutate(data, lay, kind, seed)
                out.write_bytes(bad)
                # quantized files: every other case keeps the matrices as lazy mapped blocks
                lazy = bool(n % 2) if base != "f32" else None
                # a moved tensor (two tensors sharing bytes, or a gap) must be refused, as llama.cpp refuses it
                refuse = kind in ("data_offset", "truncate", "truncate_at_field") and bad != data
                cases.append({"id": f"{base}/{kind}/{n}", "seed": seed, "op": "load_model", "path": str(out),
                              "lazy": lazy, "refuse": refuse})
    return cases


@pytest.fixture(scope="module")
def gguf_cases(tmp_path_factory) -> list[dict]:
    return make_cases(tmp_path_factory.mktemp("fuzz_gguf"))


def test_mutated_gguf_files_fail_cleanly(gguf_cases):
    assert len(gguf_cases) >= 500
    results = run_and_check("GGUF", gguf_cases, lambda case, res: "loaded, but must be refused" if case["refuse"] else None)
    # A cut file is named as one, with the field that runs past its end (the header walk, gguf_header.py),
    # not as a numpy error from inside the reader.
    vague = [f"{c['id']} (seed {c['seed']}): {r['message']}" for c, r in zip(gguf_cases, results, strict=True)
             if "/truncate" in c["id"] and not any(w in r["message"] for w in TRUNCATED)]
    assert not vague, f"{len(vague)} cut files without a clear message:\n" + "\n".join(vague[:10])
    # the mutations reach past the header: some files still load (data bytes), most are refused
    statuses = {r["status"] for r in results}
    assert statuses == {"ok", "perfx"}, statuses
