"""``CompileOptions.activations``: int8 activations for quantized linears on AVX-512 VNNI targets.

The int8 path changes the numbers by design (x rounded to int8 per weight group, as llama.cpp
does), so its model-level checks are against the same model compiled with float activations
(which the other tests hold to the float64 reference at 1e-3):

* tiny random models: logits within a relative bound (each linear's input moves by at most
  amax/254 per group: ~0.4% of a group's largest entry; the bound leaves a few times the
  observed error and is far below what a wrong kernel gives, ~1);
* SmolLM2-135M (GGUF, slow): the greedy 32-token continuation of the README prompt is the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from perfx_compiler.errors import PerfXError
from perfx_compiler.pipeline import resolve_activations
from perfx_compiler.targets import load_target

from .conftest import ALL_PASSES, tiny_desc


def _has_vnni() -> bool:
    try:
        return " avx512_vnni" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


needs_vnni = pytest.mark.skipif(not _has_vnni(), reason="this CPU has no AVX-512 VNNI")
PROMPT = "Once upon a time, there was a little girl named"


def test_resolution() -> None:
    avx512, avx2, arm = load_target("x86-avx512"), load_target("x86-avx2"), load_target("arm64-neon")
    assert resolve_activations("auto", "gguf", avx512) == "int8"
    assert resolve_activations("auto", "q4_g128", avx512) == "int8"
    assert resolve_activations("auto", "f32", avx512) == "f32"
    assert resolve_activations("auto", "gguf", avx2) == "f32"
    assert resolve_activations("auto", "gguf", arm) == "f32"
    assert resolve_activations("f32", "gguf", avx512) == "f32"
    with pytest.raises(PerfXError, match="needs an x86 target with AVX-512 VNNI"):
        resolve_activations("int8", "gguf", avx2)
    with pytest.raises(PerfXError, match="unknown activations"):
        resolve_activations("int4", "gguf", avx512)


def _logits(art: Path, ids: list[int]) -> np.ndarray:
    from perfx_compiler.runtime.engine import Engine

    eng = Engine(art)
    out = [eng.prefill(ids[:5])[0]] + [eng.decode(t) for t in ids[5:]]
    return np.stack(out)


@needs_vnni
@pytest.mark.parametrize("quantization", ["q4_g32", "q4_sym_g64", "q8"])
def test_tiny_int8_activations_close_to_f32(compiled, quantization: str) -> None:
    desc = tiny_desc(tied=True, seed=5)
    f32 = compiled(f"act-f32-{quantization}", desc, ALL_PASSES, quantization)
    from perfx_compiler.pipeline import compile_model

    from .conftest import compile_options

    int8 = f32.parent.parent / f"int8-{quantization}"
    if not (int8 / "perfx-config.json").exists():
        compile_model(desc, "host", int8, **compile_options(progress=False, passes=ALL_PASSES,
                                                            quantization=quantization, activations="int8"))
    manifest = json.loads((int8 / "perfx-config.json").read_text())
    assert manifest["activations"] == "int8"
    assert json.loads((f32 / "perfx-config.json").read_text())["activations"] == "f32"
    ids = np.random.default_rng().integers(0, desc.config.vocab_size, size=16).tolist()
    a, b = _logits(f32, ids), _logits(int8, ids)
    err = float(np.abs(a - b).max() / np.abs(a).max())
    assert 0 < err < 3e-2, err


@pytest.mark.slow
@needs_vnni
def test_smollm2_gguf_int8_greedy_equals_f32(smol_desc, smol_artifact, tmp_path_factory) -> None:
    from tokenizers import Tokenizer

    from perfx_compiler.pipeline import compile_model
    from perfx_compiler.runtime.engine import Engine

    assert json.loads((Path(smol_artifact) / "perfx-config.json").read_text())["activations"] == "f32"
    out = tmp_path_factory.mktemp("smol-int8") / "artifact"
    art = compile_model(smol_desc, "host", out, progress=False, activations="int8", batching=False)
    assert json.loads((Path(art) / "perfx-config.json").read_text())["activations"] == "int8"
    ids = Tokenizer.from_str(smol_desc.tokenizer_json).encode(PROMPT).ids

    def greedy(path: Path) -> tuple[list[int], np.ndarray]:
        eng = Engine(path)
        logits = eng.prefill(ids)[0]
        first = logits.copy()
        toks = []
        for _ in range(32):
            toks.append(int(np.argmax(logits)))
            logits = eng.decode(toks[-1])
        return toks, first

    t32, l32 = greedy(Path(smol_artifact))
    t8, l8 = greedy(Path(art))
    assert t8 == t32
    assert 0 < np.abs(l8 - l32).max() / np.abs(l32).max() < 3e-2
