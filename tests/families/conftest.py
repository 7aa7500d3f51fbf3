"""Session fixtures of the decoder-family tests: ``family_artifacts`` builds each family's HF folder, GGUF
(f32 or quantized) and ONNX graph once and hands back paths.

Where: ``$PERFX_TEST_CACHE/families/<key>/`` when PERFX_TEST_CACHE is set (kept between runs; the key
hashes family_fixtures.py and the versions of transformers, torch and llama-cpp-python, so a change to
any of them builds afresh), else pytest's session tmp dir. Builds go to a ``.partial`` path first and
are renamed into place, so an interrupted run leaves nothing half-written behind.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import family_fixtures as ff  # noqa: E402


def _cache_key() -> str:
    h = hashlib.sha256((HERE / "family_fixtures.py").read_bytes())
    for dist in ("transformers", "torch", "llama_cpp_python", "tokenizers"):
        try:
            h.update(f"{dist}={importlib.metadata.version(dist)}".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{dist}=none".encode())
    return h.hexdigest()[:16]


def _suffix(overrides: dict) -> str:
    return "".join(f"-{k}={v}" for k, v in sorted(overrides.items()))


class FamilyArtifacts:
    """Per-family artifacts, built on first use and cached under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _build(self, path: Path, make: Callable[[Path], object]) -> Path:
        if path.exists():
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.partial-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        make(tmp)
        try:
            os.replace(tmp, path)
        except OSError:  # another process put it there first
            if not path.exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        return path

    def checkpoint(self, family: str, seed: int = 0, config_style: str = "v5", **overrides) -> Path:
        """The HF folder (``ff.make_checkpoint``)."""
        path = self.root / f"{family}-s{seed}{_suffix(overrides)}" / ("hf" if config_style == "v5" else "hf-v4")
        return self._build(path, lambda p: ff.make_checkpoint(family, p, seed, config_style, **overrides))

    def gguf(self, family: str, quant: str = "f32", seed: int = 0, **overrides) -> Path:
        """llama.cpp's conversion at f32, or ``quant`` ("Q8_0", "Q4_K_M", ...) quantized from it."""
        hf = self.checkpoint(family, seed, **overrides)
        f32 = self._build(hf.parent / "model-f32.gguf", lambda p: ff.to_gguf(hf, p, "f32"))
        if quant.lower() == "f32":
            return f32
        return self._build(hf.parent / f"model-{quant}.gguf", lambda p: ff.quantize_gguf(f32, p, quant))

    def onnx(self, family: str, seed: int = 0, **overrides) -> Path:
        """The torch.onnx graph with KV cache (``ff.to_onnx``): ``<dir>/model.onnx`` (+ tokenizer, config)."""
        hf = self.checkpoint(family, seed, **overrides)
        folder = self._build(hf.parent / "onnx", lambda p: ff.to_onnx(hf, p / "model.onnx"))
        return folder / "model.onnx"


@pytest.fixture(scope="session")
def family_artifacts(tmp_path_factory) -> FamilyArtifacts:
    # kept across runs in the test cache tests/setup.sh fills (keyed by the fixtures' code and versions)
    cache = os.environ.get("PERFX_TEST_CACHE") or Path.home() / ".cache" / "perfx-test"
    root = Path(cache) / "families" / _cache_key()
    return FamilyArtifacts(root)


@pytest.fixture
def family_report(request) -> Callable[..., None]:
    """``family_report(family, check, text)``: a line of the summary table printed at the end (carried in
    the test's report, so xdist's workers hand it to the process that prints; tests/conftest.py prints)."""
    return lambda family, check, text: request.node.user_properties.append(("family_report", (family, check, text)))
