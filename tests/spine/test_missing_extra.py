"""A missing optional package is one line naming the extra (cli/_errors.py); the install test
(test_install_without_extras.py, slow) checks the commands themselves in a venv without extras."""

from __future__ import annotations

import argparse
import sys

import pytest

from perfx_compiler.cli import _errors, bench, serve
from perfx_compiler.errors import MissingDependencyError, PerfXError


def _raise(exc: BaseException):
    def body() -> int:
        raise exc

    return body


def test_missing_optional_import_is_one_line_naming_the_extra(capsys) -> None:
    err = ModuleNotFoundError("No module named 'uvicorn.config'", name="uvicorn.config")
    assert _errors.run_command("perfx-x", _raise(err)) == 2
    assert capsys.readouterr().err == 'perfx-x: error: uvicorn is not installed; pip install "perfx[serve]"\n'
    err = ModuleNotFoundError("No module named 'llama_cpp'", name="llama_cpp")
    assert _errors.run_command("perfx-x", _raise(err)) == 2
    assert 'pip install "perfx[bench]"' in capsys.readouterr().err


def test_missing_core_module_keeps_its_traceback() -> None:
    """A core dependency missing is a broken install, not a user's choice: not hidden behind one line."""
    with pytest.raises(ModuleNotFoundError):
        _errors.run_command("perfx-x", _raise(ModuleNotFoundError("No module named 'numpy'", name="numpy")))


def test_require_names_the_extra(monkeypatch, capsys) -> None:
    real = _errors.importlib.util.find_spec
    monkeypatch.setattr(_errors.importlib.util, "find_spec", lambda m: None if m == "fastapi" else real(m))
    with pytest.raises(MissingDependencyError, match=r'fastapi is not installed; pip install "perfx\[serve\]"'):
        _errors.require("uvicorn", "fastapi")
    # perfx-serve checks before looking at its arguments' artifact
    assert serve.main(["/nonexistent/artifact"]) == 2
    assert capsys.readouterr().err == 'perfx-serve: error: fastapi is not installed; pip install "perfx[serve]"\n'


def test_ort_genai_peer_names_what_its_model_builder_imports(monkeypatch) -> None:
    """The ort-genai peer's GGUF conversion runs onnxruntime-genai's builder, which imports torch: a
    missing torch is named with the bench extra before any build, not a builder traceback later."""
    monkeypatch.setitem(sys.modules, "torch", None)  # find_spec() -> None: as if not installed
    with pytest.raises(PerfXError, match=r'peer ort-genai failed: .*torch.* not installed; pip install "perfx\[bench\]"'):
        bench.check_peers(argparse.Namespace(skip_failed_peers=False), ["ort-genai"], {})
