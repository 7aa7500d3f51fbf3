"""Batched serving over quantized / half weights: ``paged_decode`` (a symbolic batch of single rows)
calls the kernels that read the packed weights, and each sequence's logits equal the
single-sequence Engine's on the same artifact.

Models: tiny GGUF checkpoints (random weights, fresh random prompts each run) in GGUF Q4_1 and
Q8_0 (passthrough), F32 quantized to q4_g128 and to bf16 / f16 (half weights), under f32 activations
(the batched GEMV path) and, where the CPU has AVX-512 VNNI, int8 activations (the VNNI GEMM).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from perfx_compiler.model.gguf import load_gguf
from perfx_compiler.model.testing import write_tiny_gguf
from perfx_compiler.pipeline import compile_model
from perfx_compiler.runtime.batch_engine import BatchEngine
from perfx_compiler.runtime.engine import Engine
from tests._cpu import has_vnni

CASES = {  # id: (GGUF qtype, compile quantization or None, activations)
    "gguf-q4_1-f32": ("Q4_1", None, "f32"),
    "gguf-q8_0-f32": ("Q8_0", None, "f32"),
    "q4_g128-f32": ("F32", "q4_g128", "f32"),
    "bf16-f32": ("F32", "bf16", "f32"),  # half weights: compile-time half panels (gemm_half_cpu)
    "f16-f32": ("F32", "f16", "f32"),
    "gguf-q4_1-int8": ("Q4_1", None, "int8"),
}


def _paged_decode_kernels(ir_dir: Path) -> set[str]:
    text = (ir_dir / "01_passes.py").read_text()
    start = text.index("def paged_decode(")
    end = text.find("@R.function", start)
    return set(re.findall(r"cls\.(\w+)", text[start : end if end > 0 else len(text)]))


@pytest.fixture(scope="module", params=list(CASES))
def built(request, tmp_path_factory):
    qtype, quant, act = CASES[request.param]
    if act == "int8" and not has_vnni():
        pytest.skip("int8 activations need AVX-512 VNNI")
    root = tmp_path_factory.mktemp(request.param.replace("-", "_"))
    # K = 256: whole q4_g128 groups and 16-lane interleaved blocks; N = 128/512/vocab
    path, _ = write_tiny_gguf(root / "m.gguf", context_length=96, hidden=256, ffn=512, heads=4, kv_heads=2,
                              qtype=qtype, vocab=320)
    desc = load_gguf(path)
    kw = {"quantization": quant} if quant else {}
    art = compile_model(desc, "host", root / "art", progress=False, batching=True, activations=act,
                        dump_ir=root / "ir", **kw)
    return request.param, desc, art, root / "ir"


def test_paged_decode_reads_packed_weights(built):
    """No linear of paged_decode dequantizes its weight to fp32 first."""
    name, _, _, ir = built
    kernels = _paged_decode_kernels(ir)
    assert not [k for k in kernels if "dequant" in k], sorted(kernels)
    if name.startswith(("bf16", "f16")):  # the batch's GEMMs read the half panels
        assert any(k.endswith("_nx1_panels") for k in kernels), sorted(kernels)
    elif name.endswith("-f32"):
        assert any(k.endswith("_nx1") and "_matmul_" in k for k in kernels), sorted(kernels)


def test_batched_logits_equal_single_sequence_engine(built):
    name, desc, art, _ = built
    rng = np.random.default_rng()
    vocab = desc.config.vocab_size
    prompts = [int(n) for n in rng.integers(3, 30, 8)]  # 8 sequences: pages crossed at different steps
    steps = 6
    seqs = [rng.integers(0, vocab, n + steps) for n in prompts]
    eng = BatchEngine(art, max_batch=8)
    ids = [eng.add_sequence() for _ in prompts]
    got = [[np.array(eng.prefill(i, s[:n])).reshape(-1)] for i, s, n in zip(ids, seqs, prompts, strict=True)]
    for t in range(steps):
        active = ids if t % 2 == 0 else ids[: 2 + t % 3]  # the batch size changes between steps
        logits = eng.decode(active, [seqs[ids.index(i)][prompts[ids.index(i)] + len(got[ids.index(i)]) - 1]
                                     for i in active])
        for r, i in enumerate(active):
            got[ids.index(i)].append(np.array(logits[r]).reshape(-1))
    single = Engine(art)
    errs, seq_max = [], []
    for r, n in enumerate(prompts):
        single.reset()
        want = [np.array(single.prefill(seqs[r][:n].tolist())).reshape(-1)]
        for tok in seqs[r][n : n + len(got[r]) - 1]:
            want.append(np.array(single.decode(int(tok))).reshape(-1))
        g, w = np.stack(got[r]), np.stack(want)
        errs += list(np.abs(g - w).max(axis=1) / np.abs(w).max())
        seq_max.append(max(errs[-len(g):]))
    errs = np.array(errs)
    if name.endswith("-f32"):  # the same kernels' arithmetic per row
        assert errs.max() < 2e-5, f"batched vs single-sequence relative errors {errs}"
    else:
        # int8 activations: the batch runs the VNNI GEMM, a single sequence the VNNI GEMV; their
        # float32 sums differ by ~2e-7 (tests/schedules), which can move an activation of a later
        # layer across an int8 rounding step, and the KV cache carries it to the sequence's later
        # steps (up to ~1e-2). Counted over 8 runs of 5 sequences: 2-5 sequences stayed exact
        # throughout, the others flipped at some step; a median over all vectors failed CI once
        # (3 of 5 flipped). A wrong GEMM row or group misses by order 1 (the max), and a GEMM that
        # differs from the GEMV beyond summation order leaves no sequence exact at every step.
        assert errs.max() < 6e-2, errs
        assert min(seq_max) < 2e-5, f"no sequence matched the single-sequence engine at every step: {seq_max}"
