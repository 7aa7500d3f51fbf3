"""The packed weights go to disk after the graph passes (``package.spill_weights``), so codegen's peak does
not land on top of them: the artifact's ``weights.bin`` is that file moved in place, byte for byte what
writing it at packaging gives, and no spill file is left behind, neither by a compile nor by one that
fails after the passes."""

from __future__ import annotations

import numpy as np
import pytest

from perfx_compiler import pipeline
from perfx_compiler.errors import PerfXError
from perfx_compiler.model.gguf import load_gguf
from perfx_compiler.model.testing import write_tiny_gguf
from perfx_compiler.package import SpilledWeights, _write_weights


def test_spilled_weights_are_the_artifacts_and_leave_nothing(tmp_path, monkeypatch):
    gguf, _ = write_tiny_gguf(tmp_path / "m.gguf", qtype="Q4_0", vocab=320, seed=int(np.random.default_rng().integers(1 << 30)))
    desc = load_gguf(gguf)
    seen = {}
    orig = pipeline.phase_build

    def build(state):  # what the later phases see: the weights mapped from the spill file
        seen["weights"] = state.weights
        orig(state)

    monkeypatch.setattr(pipeline, "PHASES", [(n, build if n == "build" else f) for n, f in pipeline.PHASES])
    out = pipeline.compile_model(desc, "host", tmp_path / "art", progress=False)
    weights = seen["weights"]
    assert isinstance(weights, SpilledWeights) and weights
    assert all(not a.flags.writeable for a in weights.values())
    again = tmp_path / "again.bin"
    _write_weights(again, {n: np.array(a) for n, a in weights.items()})
    assert again.read_bytes() == (out / "weights.bin").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.bin", "art", "m.gguf"]

    def fail(state):
        raise PerfXError("codegen failed")

    monkeypatch.setattr(pipeline, "PHASES", [(n, fail if n == "build" else f) for n, f in pipeline.PHASES])
    with pytest.raises(PerfXError, match="codegen failed"):
        pipeline.compile_model(desc, "host", tmp_path / "art2", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.bin", "art", "m.gguf"]
