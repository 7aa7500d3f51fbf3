"""Tiny random models and session-cached compiled artifacts for the graph-pass tests."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from perfx_compiler.model.description import ModelConfig, ModelDescription, expected_weight_shapes  # noqa: E402

FUSION_PASSES = ["fuse_add_norm", "merge_projections", "fuse_swiglu", "weight_layout"]
ALL_PASSES = [*FUSION_PASSES, "quantize_int4"]


def tiny_desc(*, hidden: int = 64, ffn: int = 128, layers: int = 2, bias: bool = False, tied: bool = False,
              seed: int = 0) -> ModelDescription:
    """A random llama (or qwen2 with Q/K/V biases) small enough to compile in seconds."""
    cfg = ModelConfig(
        architecture="qwen2" if bias else "llama", vocab_size=96, hidden_size=hidden, intermediate_size=ffn,
        num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=hidden // 4, max_context=64,
        tie_word_embeddings=tied, attention_bias=bias,
    )
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in expected_weight_shapes(cfg).items():
        mean = 1.0 if name.endswith("norm.weight") else 0.0
        scale = 0.1 if len(shape) == 1 else 0.05
        weights[name] = (mean + scale * rng.standard_normal(shape)).astype(np.float32)
    return ModelDescription(config=cfg, weights=weights, source="tiny")


def compile_options(**kw: Any) -> dict[str, Any]:
    """Compile options for tests: no serving (paged) functions when the pipeline has that switch."""
    from perfx_compiler.pipeline import CompileOptions

    if "batching" in CompileOptions.__dataclass_fields__:
        kw.setdefault("batching", False)
    # float activations: these tests compare with the float64 reference at 1e-3; the int8-activation
    # (VNNI) path has its own tests with bounds of its own (test_activations_int8.py)
    kw.setdefault("activations", "f32")
    return kw


def lower(desc: ModelDescription, passes: list[str], quantization: str = "f32") -> Any:
    """Run phases 0-2 and return the CompileState (module after lowering, notes with phase-1 IR)."""
    from perfx_compiler import pipeline
    from perfx_compiler.targets import load_target

    opts = pipeline.CompileOptions(**compile_options(target="host", passes=passes, quantization=quantization,
                                                     progress=False))
    state = pipeline.CompileState(desc=desc, target=load_target("host"), options=opts)
    pipeline.phase_import(state)
    pipeline.phase_passes(state)
    state.notes["after_passes"] = state.mod
    pipeline.phase_lower(state)
    return state


@pytest.fixture(scope="session")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """compiled(key, desc, passes, quantization) -> artifact dir, compiled once per session."""
    from perfx_compiler.pipeline import compile_model

    cache: dict[str, Path] = {}

    def get(key: str, desc: ModelDescription, passes: list[str], quantization: str = "f32") -> Path:
        if key not in cache:
            out = tmp_path_factory.mktemp(key) / "artifact"  # distinct paths: loaded .so files are cached
            compile_model(desc, "host", out, **compile_options(progress=False, passes=passes,
                                                                quantization=quantization))
            cache[key] = out
        return cache[key]

    return get


def max_rel_err(engine: Any, desc: ModelDescription) -> float:
    """Worst relative logit error of prefill, decode steps and prefill_all against the float64 reference."""
    from perfx_compiler.model.reference import ReferenceModel

    ref = ReferenceModel(desc)
    errs = []

    def rel(a: np.ndarray, r: np.ndarray) -> float:
        return float(np.abs(a - r).max() / np.abs(r).max())

    ids = [3, 17, 42, 5, 9, 60, 1]
    errs.append(rel(engine.prefill(ids), ref.forward(ids)[-1]))
    for tok in (7, 11, 13):
        errs.append(rel(engine.decode(tok), ref.forward([tok])[-1]))
    errs.append(rel(engine.prefill_all([4, 8, 15]), ref.forward([4, 8, 15])))
    return max(errs)
