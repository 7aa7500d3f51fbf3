"""benchmarks/int8_drift.py: its int8 emulation is the kernels' rule, its forward pass is the reference model's,
and its perturbations do what they claim (numpy only, a few seconds)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from perfx_compiler.model.gguf import load_gguf
from perfx_compiler.model.reference import ReferenceModel
from perfx_compiler.model.testing import write_tiny_gguf
from perfx_compiler.passes._qvnni import quantize_activations

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
drift = pytest.importorskip("int8_drift")


def test_emulated_codes_are_the_kernels_rounding():
    rng = np.random.default_rng()
    x = rng.standard_normal((5, 256)) * rng.lognormal(0, 2, size=(5, 256))
    x[1, 32:64] = 0.0  # an all-zero group: scale 0, codes 0
    x[2, :32] *= 1e4  # one loud group must not change its neighbours' scales
    q, dx = drift.quantize_codes(x)
    assert np.array_equal(drift.dequantize_codes(q, dx), quantize_activations(x, 256, 32))
    assert np.abs(q).max() == 127 and np.array_equal(q, np.rint(q))


def test_lockstep_float_variant_is_the_reference_and_perturbations_behave(tmp_path):
    path, _ = write_tiny_gguf(tmp_path / "m.gguf", qtype="Q4_0", hidden=64, ffn=128, layers=2, tied=True, seed=5)
    desc = load_gguf(path, lazy=True)
    ids = np.random.default_rng().integers(0, desc.config.vocab_size, size=12)
    ls = drift.Lockstep(desc, ids, 1e-7, kick_at=(6, 17))
    seen: list[int] = []
    logits = ls.run(desc.config.num_layers, lambda li, _ls: seen.append(li))
    assert seen == [0, 1]
    ref = ReferenceModel(load_gguf(path, lazy=False)).forward(ids.tolist())
    assert drift.rel(logits["f64"], ref) < 1e-12  # same forward pass (RoPE, GQA, tied head)
    assert 1e-4 < drift.rel(logits["i8"], ref) < 0.2  # int8 activations really are applied, and sanely
    assert drift.rel(logits["f64+eps1"], logits["f64"]) < 1e-5  # float path: 1e-7 noise stays ~1e-7
    kicked = ls.by_name["i8+kick"]
    assert kicked.flips[0][0] >= 1  # the kicked code itself is counted
    # tokens before the kick do not see it (causal): their logits are bit-identical
    assert np.array_equal(logits["i8+kick"][:6], logits["i8"][:6])
    assert drift.rel(logits["i8+kick"][6:], logits["i8"][6:]) > 0
