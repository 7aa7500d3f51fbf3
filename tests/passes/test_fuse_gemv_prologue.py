"""passes/fuse_gemv_prologue.py: residual add + RMSNorm and SwiGLU fused into the VNNI GEMV that reads
them (decode, one activation row, int4 or int8 codes). The fused model must give the same logits, bit for bit,
as the one without the pass (the fused kernel makes x with the same float ops in the same order as the
separate kernels), and only the decode function's GEMVs change."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests._cpu import needs_vnni

from .conftest import ALL_PASSES, FUSION_PASSES, compile_options, tiny_desc

PASSES = [*ALL_PASSES, "quantize_int8"]


def _after_passes(desc, passes: list[str], quantization: str):
    """The module after phase 1 with int8 activations (VNNI GEMVs)."""
    from perfx_compiler import pipeline
    from perfx_compiler.targets import load_target

    opts = pipeline.CompileOptions(**compile_options(target="host", passes=passes, quantization=quantization,
                                                     progress=False, activations="int8"))
    state = pipeline.CompileState(desc=desc, target=load_target("host"), options=opts)
    pipeline.phase_import(state)
    pipeline.phase_passes(state)
    return state.mod


def _callees(mod, fn: str) -> list[str]:
    """Names of the kernels ``fn`` calls (call_tir), in order."""
    from tvm import relax

    names: list[str] = []

    def visit(e) -> None:
        if isinstance(e, relax.Call) and getattr(e.op, "name", "") == "relax.call_tir":
            names.append(e.args[0].name_hint)

    relax.analysis.post_order_visit(mod[fn].body, visit)
    return names


def _compile(desc, out: Path, passes: list[str], quantization: str) -> Path:
    from perfx_compiler.pipeline import compile_model

    from .conftest import compile_options

    if not (out / "perfx-config.json").exists():
        compile_model(desc, "host", out, **compile_options(progress=False, passes=passes, quantization=quantization,
                                                            activations="int8"))
    return out


def _assert_same_logits(plain: Path, fused: Path, vocab: int) -> None:
    """Prefill of 4 random ids, then 8 decode steps: the two artifacts' logits equal bit for bit."""
    from perfx_compiler.runtime.engine import Engine

    ids = np.random.default_rng().integers(0, vocab, size=12).tolist()
    out = []
    for art in (plain, fused):
        e = Engine(art)
        out.append(np.stack([e.prefill(ids[:4])[0]] + [e.decode(t) for t in ids[4:]]))
    assert np.array_equal(out[0], out[1]), np.abs(out[0] - out[1]).max()


@needs_vnni
def test_decode_gemvs_take_the_norm_and_swiglu() -> None:
    """In decode every add_rms_norm before a GEMV and every swiglu are gone into fused GEMVs (the first
    layer's plain rms_norm and the final norm stay): swiglu into the gate|up GEMV after it (epilogue);
    prefill (many rows) keeps them."""
    from perfx_compiler.pipeline import GRAPH_PASSES

    mod = _after_passes(tiny_desc(layers=3, seed=2), [*PASSES, "fuse_gemv_prologue"], "q4_g32")
    dec = _callees(mod, "decode")
    fused = [c for c in dec if c.startswith(("add_rms_norm_q4_matmul", "swiglu_q4_matmul"))]
    # per layer: qkv after the norm (all but the first layer), gate_up after the norm, down after swiglu
    assert sum(c.startswith("add_rms_norm_q4") for c in fused) == 2 * 3 - 1, dec
    tails = [c for c in fused if c.endswith("_swiglu")]
    assert len(tails) == 3, dec
    assert all(c.startswith("add_rms_norm_q4") for c in tails), dec  # gate_up, after the norm too
    assert not any(c.startswith("swiglu_q4") for c in fused), dec  # no swiglu left for down to take
    assert not any(c.startswith(("swiglu_", "add_rms_norm_")) and c not in fused for c in dec), dec
    assert any(c.startswith("swiglu_") and "matmul" not in c for c in _callees(mod, "prefill"))
    assert "fuse_gemv_prologue" in GRAPH_PASSES


@needs_vnni
@pytest.mark.parametrize("quantization", ["q4_g32", "q4_sym_g64", "q8"])
def test_fused_model_gives_the_same_logits(tmp_path_factory, quantization: str) -> None:
    desc = tiny_desc(layers=2, seed=7)
    root = tmp_path_factory.mktemp(f"prologue-{quantization}")
    plain = _compile(desc, root / "plain", PASSES, quantization)
    fused = _compile(desc, root / "fused", [*PASSES, "fuse_gemv_prologue"], quantization)
    fused_name = b"add_rms_norm_q8_matmul" if quantization == "q8" else b"add_rms_norm_q4_matmul"
    assert fused_name in (fused / "model.so").read_bytes()
    assert fused_name not in (plain / "model.so").read_bytes()
    assert b"1x1_swiglu" in (fused / "model.so").read_bytes()  # gate_up with the swiglu epilogue
    assert json.loads((fused / "perfx-config.json").read_text())["activations"] == "int8"
    _assert_same_logits(plain, fused, desc.config.vocab_size)


@needs_vnni
@pytest.mark.parametrize("qtype", ["Q5_0", "Q6_K", "Q5_K"])
def test_low_bit_gguf_model_fuses_and_gives_the_same_logits(tmp_path_factory, qtype: str) -> None:
    """A GGUF of 5- or 6-bit codes (its blocks as they are): decode's norms and swiglu go into its GEMVs
    as they do for int4 / int8 codes, and the logits stay bit for bit those of the unfused model."""
    from perfx_compiler.model.gguf import load_gguf
    from perfx_compiler.model.testing import write_tiny_gguf

    root = tmp_path_factory.mktemp(f"prologue-{qtype}")
    gguf, _ = write_tiny_gguf(root / "m.gguf", qtype=qtype, vocab=320, hidden=256, ffn=512, seed=11)
    desc = load_gguf(gguf)
    passes = [*FUSION_PASSES, "gguf_passthrough"]
    plain = _compile(desc, root / "plain", passes, "gguf")
    fused = _compile(desc, root / "fused", [*passes, "fuse_gemv_prologue"], "gguf")
    fused_so = (fused / "model.so").read_bytes()
    assert b"add_rms_norm_q" in fused_so and b"1x1_swiglu" in fused_so
    assert b"add_rms_norm_q" not in (plain / "model.so").read_bytes()
    _assert_same_logits(plain, fused, desc.config.vocab_size)
