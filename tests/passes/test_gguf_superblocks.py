"""GGUF files as llama.cpp's own quantizer makes them (K-quant mixes, IQ4, Q5_1, Q5_0) compiled with int8
activations: every block type stays blocks (``formats/ggml`` unpacked, ``formats/vnni`` packed, no
float32 matrix in the artifact) and the logits follow the float64 reference on the same file's weights
(gguf-py's dequantization) up to the int8 activations: bound 8e-2 of max |logit|. Over runs the nine
files gave 1.5e-2 to 3.1e-2, with a tail: Q6_K once reached 5.01e-2 (PERFX_TEST_SEED=1330581447), so
test_quantize_kquant.py's 5e-2 sits in this test's noise; a wrong superblock scale or sub-block order
gives order 1. All passes run, the decode GEMVs' fused prologues included."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from tests._cpu import needs_vnni

from .conftest import compile_options

# llama.cpp ftypes: each a different mix (Q4_K_M: Q4_K + Q6_K; Q3_K_M: Q3_K + Q4_K + Q5_K; Q2_K: Q2_K + Q3_K/Q4_K ...)
FTYPES = ["Q4_K_M", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K", "IQ4_XS", "IQ4_NL", "Q5_1", "Q5_0"]


@pytest.fixture(scope="module")
def f32_file(tmp_path_factory):
    from perfx_compiler.model.testing import write_tiny_gguf

    path, _ = write_tiny_gguf(tmp_path_factory.mktemp("sb") / "f32.gguf", qtype="F32", hidden=256, ffn=512,
                              heads=4, kv_heads=2, vocab=320, tied=False,
                              seed=int(np.random.default_rng().integers(1 << 30)))
    return path


@needs_vnni
@pytest.mark.parametrize("ftype", FTYPES)
def test_llamacpp_file_runs_as_blocks(f32_file, ftype, tmp_path):
    from perfx_compiler.bench.models import llama_quantize
    from perfx_compiler.model.gguf import load_gguf
    from perfx_compiler.model.gguf_header import read_gguf_header
    from perfx_compiler.model.reference import ReferenceModel
    from perfx_compiler.pipeline import compile_model
    from perfx_compiler.runtime.engine import Engine

    gguf = llama_quantize(f32_file, tmp_path / f"{ftype}.gguf", ftype)
    types = {t.tensor_type.name for t in read_gguf_header(gguf).tensors if len(t.shape) == 2}
    desc = load_gguf(gguf, lazy=False)
    art = tmp_path / "art"
    compile_model(desc, "host", art, **compile_options(progress=False, activations="int8"))
    manifest = json.loads((art / "perfx-config.json").read_text())
    assert manifest["quantization"] == "gguf"
    stored = manifest["weights"]
    floats = [w["name"] for w in stored if w["dtype"] == "float32" and len(w["shape"]) == 2
              and not w["name"].startswith("rope_")]
    assert not floats, (types, floats)
    packed = sum(w["nbytes"] for w in stored if len(w["shape"]) == 2 and not w["name"].startswith("rope_"))
    file_bytes = sum(int(t.n_bytes) for t in read_gguf_header(gguf).tensors if len(t.shape) == 2)
    print(f"{ftype} {sorted(types)}: artifact matrices {packed / file_bytes:.3f}x the file's")
    # prefill linears (every N here a multiple of 16) run the int8 GEMM: no block type is dequantized for a
    # float GEMM (Q6_K's row quads once were: 2.4x slower prefill)
    so = (art / "model.so").read_bytes()
    assert re.search(rb"_matmul_\d+_\d+_\w+v_1xn", so) and not re.search(rb"_dequant_\d+_\d+_", so), (
        types, sorted(set(re.findall(rb"q\d_dequant_\d+_\d+_\w+v", so))))

    ref = ReferenceModel(desc)
    eng = Engine(art)
    ids = np.random.default_rng().integers(0, desc.config.vocab_size, size=12).tolist()

    def rel(a, r) -> float:
        return float(np.abs(np.asarray(a).reshape(-1) - r).max() / np.abs(r).max())

    errs = [rel(eng.prefill(ids), ref.forward(ids)[-1])]
    for tok in ids[:3]:  # both continue from their caches
        errs.append(rel(eng.decode(tok), ref.forward([tok])[-1]))
    print(f"{ftype}: max rel logit error vs the float64 reference: {max(errs):.2e}")
    assert max(errs) < 8e-2, (types, errs)
