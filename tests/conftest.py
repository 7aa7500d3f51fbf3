"""Shared fixtures: compiled artifacts are built once per test run and reused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without an install
    sys.path.insert(0, str(REPO))


from tests.tvmscript_speedups import install as _install_tvmscript_speedups  # noqa: E402

_install_tvmscript_speedups()


@pytest.fixture(scope="session")
def smol_desc():
    """The default model's description (SmolLM2-135M-Instruct, dequantized)."""
    from perfx_compiler.model.loader import load_model

    return load_model("smollm2-135m", max_context=512)


@pytest.fixture(scope="session")
def smol_artifact(smol_desc, tmp_path_factory):
    """The default model compiled for this CPU (host target)."""
    from perfx_compiler.pipeline import compile_model

    out = tmp_path_factory.mktemp("smol") / "artifact"
    # float activations: test_smollm2 holds it to the float64 reference at 1e-3 (the int8-activation
    # default on VNNI CPUs is checked against this artifact in tests/passes/test_activations_int8.py)
    return compile_model(smol_desc, "host", out, progress=False, activations="f32")


@pytest.fixture(scope="session")
def smol_engine(smol_artifact):
    from perfx_compiler.runtime.engine import Engine

    return Engine(smol_artifact)


@pytest.fixture(scope="session")
def smol_reference(smol_desc):
    from perfx_compiler.model.reference import ReferenceModel

    return ReferenceModel(smol_desc)
