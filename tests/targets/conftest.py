"""Target execution checks (``pytest -m targets``): every target compiles; kernels and whole models run
on this CPU-only machine through qemu-user, PoCL, nvcc and the ROCm code object toolchain.

``tests/setup.sh`` (the README's test command) installs every tool they use; a test whose tool is missing
skips with the reason, and under ``CI=true`` fails (tests/conftest.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from targets_common import MAX_CONTEXT, TOKENS  # noqa: E402


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from perfx_compiler.model.testing import write_tiny_gguf

    path, _ = write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", context_length=128)
    return path


@pytest.fixture(scope="session")
def host_logits(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory):
    """Decode logits of TOKENS from the x86 host build: the reference every target must match."""
    import numpy as np

    from perfx_compiler.pipeline import compile_model
    from perfx_compiler.runtime.engine import Engine

    out = compile_model(
        str(tiny_gguf), "host", tmp_path_factory.mktemp("host") / "a", progress=False, max_context=MAX_CONTEXT
    )
    engine = Engine(out)
    return np.stack([engine.decode(t) for t in TOKENS])


@pytest.fixture(scope="session")
def gemma3_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Gemma 3 Hugging Face folder (QK-norm, sandwich norms, GeGLU, sliding window 4 on five
    of six layers, two RoPE bases): the new-family model every execution target runs end to end."""
    sys.path.insert(0, str(REPO / "tests" / "families"))
    import family_fixtures

    return family_fixtures.make_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3") / "hf")


@pytest.fixture(scope="session")
def gemma3_host_logits(gemma3_folder: Path, tmp_path_factory: pytest.TempPathFactory):
    """Decode logits of TOKENS from the x86 host build of the tiny Gemma 3, checked against transformers."""
    import family_fixtures
    import numpy as np

    from perfx_compiler.pipeline import compile_model
    from perfx_compiler.runtime.engine import Engine

    out = compile_model(str(gemma3_folder), "host", tmp_path_factory.mktemp("g3host") / "a", progress=False,
                        max_context=MAX_CONTEXT, activations="f32")
    engine = Engine(out)
    got = np.stack([engine.decode(t).reshape(-1) for t in TOKENS])
    want = family_fixtures.transformers_logits(gemma3_folder, TOKENS)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    return got
