"""Whole model with int8 activations: prefill linears run the VNNI GEMM (``schedules/gemm_qvnni_cpu.py``),
decode linears the VNNI GEMV; both do the same int8 arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from .conftest import ALL_PASSES, compile_options, tiny_desc


def _has_vnni() -> bool:
    try:
        return " avx512_vnni" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


needs_vnni = pytest.mark.skipif(not _has_vnni(), reason="this CPU has no AVX-512 VNNI")


@needs_vnni
def test_tiny_model_prefill_gemm_equals_decode_gemv(tmp_path):
    """Whole model: prefill through the GEMM and token-by-token decode through the GEMV do the same
    int8 arithmetic, so their logits agree to float32 summation order (1e-4 of max |logit|; int8 vs
    float activations (PERFX_VNNI_GEMM=0) differ by ~1.5e-2 here, a wrong GEMM by order 1;
    observed 2.4e-7)."""
    from perfx_compiler.pipeline import compile_model
    from perfx_compiler.runtime.engine import Engine

    desc = tiny_desc(tied=True, seed=7)
    art = tmp_path / "int8"
    compile_model(desc, "host", art, **compile_options(progress=False, passes=[*ALL_PASSES, "quantize_int8"],
                                                       quantization="q4_g32", activations="int8"))
    assert json.loads((art / "perfx-config.json").read_text())["activations"] == "int8"
    so = (art / "model.so").read_bytes()
    assert b"q4_matmul_64_64_g32v_1xn" in so and b"q4_dequant_64_64_g32v" not in so  # GEMM, not dequant + GEMM
    ids = np.random.default_rng().integers(0, desc.config.vocab_size, size=24).tolist()
    eng = Engine(art)
    eng.reset()
    pre = np.asarray(eng.prefill(ids))
    eng.reset()
    steps = [np.asarray(eng.prefill(ids[:1]))[-1]] + [np.asarray(eng.decode(t)) for t in ids[1:]]
    dec = np.stack(steps).reshape(len(ids), -1)
    last = pre.reshape(-1, dec.shape[-1])[-1]
    err = float(np.abs(last - dec[-1]).max() / np.abs(dec[-1]).max())
    assert err < 1e-4, err
