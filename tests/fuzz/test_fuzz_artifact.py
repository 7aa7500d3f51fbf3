"""Fuzzing compiled artifacts: a tiny model's artifact with seeded flipped bytes in each of its
files (model.so, weights.bin, tokenizer.json, perfx-config.json, ...) and each file cut short,
loaded and run through ``LLM`` as perfx-run does. Each case must end in one PerfXError (the
checksums are checked before the shared library is loaded, so a corrupt model.so is refused, not
loaded into the process) or in exactly the unmodified artifact's tokens.

``PERFX_FUZZ_SEED=N`` draws another set; a failure names each bad case's id, seed and folder.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fuzz_harness import SEED, assert_clean, case_seed, run_cases, summary

from perfx_compiler.artifact_hash import MANIFEST_DIGEST_KEY
from perfx_compiler.model.testing import write_tiny_gguf

FLIPS_PER_FILE = 5
MANIFEST_VALUES = 8  # manifests with one number changed (model sizes, cache shapes, weight offsets)
PROMPT = "hello there"
MANIFEST = "perfx-config.json"
# The first run of an artifact on a fresh machine may build the decode replay's C++ loop (ninja).
CASE_S = 300.0


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzz_art")
    gguf, _ = write_tiny_gguf(root / "tiny.gguf", context_length=32)
    out = root / "art"
    res = subprocess.run([sys.executable, "-m", "perfx_compiler.cli.compile", str(gguf), "--target", "host",
                          "-o", str(out), "--quiet"], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def _flip(path: Path, rng: np.random.Generator, n: int, near_start: bool) -> None:
    data = bytearray(path.read_bytes())
    span = min(len(data), 4096) if near_start else len(data)  # ELF / JSON headers, or anywhere
    for _ in range(n):
        data[int(rng.integers(span))] ^= int(rng.integers(1, 256))
    path.write_bytes(bytes(data))


def make_cases(art: Path, root: Path) -> list[dict]:
    """The controls (unchanged; manifest re-indented; a format-1 manifest without its own checksum),
    manifests with a number changed, then per file: FLIPS_PER_FILE flipped copies and one cut short."""
    cases = []

    def variant(name: str, seed: int, change) -> None:
        d = root / name.replace("/", "-")
        shutil.copytree(art, d)
        change(d, np.random.default_rng(seed))
        cases.append({"id": name, "seed": seed, "op": "artifact", "path": str(d), "prompt": PROMPT, "max_tokens": 4})

    def reindent(d: Path, rng: np.random.Generator) -> None:
        (d / MANIFEST).write_text(json.dumps(json.loads((d / MANIFEST).read_text()), indent=4))

    def legacy(d: Path, rng: np.random.Generator) -> None:
        m = json.loads((d / MANIFEST).read_text())
        del m[MANIFEST_DIGEST_KEY]
        m["format"] = 1
        (d / MANIFEST).write_text(json.dumps(m))

    def change_number(d: Path, rng: np.random.Generator) -> None:
        """One number of the manifest changed, the JSON still valid (a shape, an offset, a size)."""
        m = json.loads((d / MANIFEST).read_text())
        leaves: list[tuple[object, object]] = []

        def walk(node: object) -> None:
            items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
            for k, v in items:
                if isinstance(v, int) and not isinstance(v, bool):
                    leaves.append((node, k))
                walk(v)

        walk({k: v for k, v in m.items() if k in ("model", "kv_cache", "paged_kv", "weights")})
        node, key = leaves[int(rng.integers(len(leaves)))]
        old = node[key]  # type: ignore[index]
        new = [v for v in (0, 1, old + 1, old * 2, max(0, old - 1), 1 << 40) if v != old]
        node[key] = new[int(rng.integers(len(new)))]  # type: ignore[index]
        (d / MANIFEST).write_text(json.dumps(m, indent=1))

    variant("control/clean", 0, lambda d, rng: None)
    variant("control/reindented_manifest", 0, reindent)
    variant("control/format1_manifest", 0, legacy)
    for n in range(MANIFEST_VALUES):
        variant(f"{MANIFEST}/value/{n}", case_seed("value", n), change_number)
    for f in sorted(p.name for p in art.iterdir()):
        for n in range(FLIPS_PER_FILE):
            seed = case_seed(f, n)
            variant(f"{f}/flip/{n}", seed, lambda d, rng, f=f, n=n: _flip(d / f, rng, 1 + n % 3, near_start=n % 2 == 0))
        seed = case_seed(f, "cut")
        variant(f"{f}/cut", seed, lambda d, rng, f=f: (d / f).write_bytes((d / f).read_bytes()[: int(rng.integers((d / f).stat().st_size))]))
    return cases


def test_corrupt_artifacts_are_refused_before_loading(tiny_artifact, tmp_path):
    files = sorted(p.name for p in tiny_artifact.iterdir())
    assert {"model.so", "weights.bin", "tokenizer.json", MANIFEST} <= set(files)
    cases = make_cases(tiny_artifact, tmp_path)
    results = run_cases(cases, case_s=CASE_S)
    print(f"PERFX_FUZZ_SEED={SEED}: {len(cases)} artifact cases over {files}: {summary(results)}")
    clean = results[0]
    assert clean["status"] == "ok", clean
    expected = clean["detail"]["token_ids"]
    assert len(expected) == 4

    def same_tokens(case: dict, res: dict) -> str | None:
        got = res["detail"]["token_ids"]
        return None if got == expected else f"ran, but generated {got} instead of {expected}"

    assert_clean(cases, results, same_tokens)
    # Every byte is covered by a checksum: a changed file is refused even where it would still run.
    accepted = [c["id"] for c, r in zip(cases, results, strict=True) if not c["id"].startswith("control/")
                and not (r["status"] == "perfx" and ("checksum mismatch" in r["message"] or "not valid JSON" in r["message"]))]
    assert not accepted, f"changed artifacts not refused by a checksum: {accepted}"


def test_perfx_run_refuses_a_corrupt_shared_library(tiny_artifact, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    _flip(art / "model.so", np.random.default_rng(case_seed("cli")), 1, near_start=True)  # the ELF header
    res = subprocess.run([sys.executable, "-m", "perfx_compiler.cli.run", str(art), "--prompt", PROMPT,
                          "--max-tokens", "2"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    lines = res.stderr.strip().splitlines()
    assert lines == ["perfx-run: error: artifact file model.so is corrupt (sha256 checksum mismatch); "
                     "recompile with perfx-compile"], res.stderr[-2000:]
