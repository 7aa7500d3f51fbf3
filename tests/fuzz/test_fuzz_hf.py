"""Fuzzing the Hugging Face folder reader: 106 folders with one mutated file each (the safetensors
header length, header JSON, each tensor's dtype / shape / offsets / name, the data, cuts; config.json
values, keys and text; tokenizer.json). Every case must end in a PerfXError with a message or a
description that validates; the kinds in ``MUST_REFUSE`` never leave a loadable model.

``PERFX_FUZZ_SEED=N`` draws another set; a failure names each bad case's id, seed and file.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fuzz_harness import case_seed, run_and_check
from hf_mutate import KINDS, file_of, mutate

from perfx_compiler.model.gguf import load_gguf
from perfx_compiler.model.hf import write_hf_folder
from perfx_compiler.model.testing import write_tiny_gguf

# Mutations that always break the folder: a missing, renamed, cut or mistyped tensor, a wrong header
# length, an unreadable config or tokenizer. (Flipped data bytes, one config value or a dropped optional
# key, a shape that happens to equal the old one, and a flipped header byte that lands on whitespace can
# leave a loadable model.)
MUST_REFUSE = ("st_header_len", "st_dtype", "st_offsets", "st_drop_tensor", "st_rename_tensor", "st_truncate",
               "config_text", "tokenizer")


def make_cases(root: Path) -> list[dict]:
    """One folder per case: the mutated file written, the other files hard links to the valid ones."""
    gguf, _ = write_tiny_gguf(root / "tiny.gguf", qtype="F32", tied=False, context_length=64)
    base = write_hf_folder(load_gguf(gguf), root / "base")
    cases = []
    for kind, count in KINDS.items():
        for n in range(count):
            seed = case_seed("hf", kind, n)
            folder = root / f"{kind}-{n}"
            folder.mkdir()
            for f in base.iterdir():
                if f.name != file_of(kind):
                    os.link(f, folder / f.name)
            (folder / file_of(kind)).write_bytes(mutate(kind, (base / file_of(kind)).read_bytes(), seed))
            cases.append({"id": f"hf/{kind}/{n}", "seed": seed, "op": "load_model", "path": str(folder)})
    return cases


@pytest.fixture(scope="module")
def hf_cases(tmp_path_factory) -> list[dict]:
    return make_cases(tmp_path_factory.mktemp("fuzz_hf"))


def test_mutated_hf_folders_fail_cleanly(hf_cases):
    assert len(hf_cases) >= 100
    results = run_and_check(
        "HF folder", hf_cases,
        lambda case, res: "loaded, but must be refused" if case["id"].split("/")[1] in MUST_REFUSE else None,
    )
    # most mutations must be refused; flipped data bytes (and some config values) still load
    statuses = {r["status"] for r in results}
    assert statuses == {"ok", "perfx"}, statuses
