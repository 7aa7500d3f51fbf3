"""passes/fuse_gemm_swiglu.py: SwiGLU fused into the VNNI GEMM that makes gate|up (prefill, batched decode).
The fused model gives the same logits, bit for bit, as the one without the pass (the epilogue computes
silu(gate) * up with the elementwise kernel's float ops from the same int32 sums), prefill no longer
calls swiglu on its own, and decode (the GEMV's epilogue) is untouched."""

from __future__ import annotations

import numpy as np

from tests._cpu import needs_vnni

from .conftest import tiny_desc
from .test_fuse_gemv_prologue import PASSES, _after_passes, _callees, _compile

BEFORE = [*PASSES, "fuse_gemv_prologue"]


@needs_vnni
def test_prefill_gemm_takes_swiglu() -> None:
    mod = _after_passes(tiny_desc(layers=3, seed=2), [*BEFORE, "fuse_gemm_swiglu"], "q4_g32")
    pre = _callees(mod, "prefill")
    assert sum(c.endswith("_1xn_swiglu") for c in pre) == 3, pre  # gate_up of each layer
    assert not any(c.startswith("swiglu") for c in pre), pre  # no elementwise swiglu left
    assert _callees(mod, "decode") == _callees(_after_passes(tiny_desc(layers=3, seed=2), BEFORE, "q4_g32"), "decode")


@needs_vnni
def test_fused_model_gives_the_same_logits(tmp_path_factory) -> None:
    from perfx_compiler.runtime.engine import Engine

    desc = tiny_desc(layers=2, seed=5)
    root = tmp_path_factory.mktemp("gemm-swiglu")
    plain = _compile(desc, root / "plain", BEFORE, "q4_g32")
    fused = _compile(desc, root / "fused", [*BEFORE, "fuse_gemm_swiglu"], "q4_g32")
    assert b"1xn_swiglu" in (fused / "model.so").read_bytes()
    assert b"1xn_swiglu" not in (plain / "model.so").read_bytes()
    ids = np.random.default_rng().integers(0, desc.config.vocab_size, size=21).tolist()
    out = []
    for art in (plain, fused):
        e = Engine(art)
        out.append(np.concatenate([e.prefill_all(ids[:17]), np.stack([e.decode(t) for t in ids[17:]])]))
    assert np.array_equal(out[0], out[1]), np.abs(out[0] - out[1]).max()
