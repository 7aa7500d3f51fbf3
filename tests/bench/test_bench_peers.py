"""perfx-bench fails when a requested peer cannot run (exit 2, one line naming it and why), unless
--skip-failed-peers; it says which engines ran (issue #22 item 6)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from perfx_compiler.cli.bench import main
from perfx_compiler.model.testing import write_tiny_gguf


def _argv(model: Path, tmp_path: Path, peers: str, *extra: str) -> list[str]:
    # --work next to the model: the tests share one PerfX build (bench/models.py caches it there)
    return [str(model), "--peers", peers, "--rounds", "1", "--prompt-tokens", "8", "--decode-tokens", "16",
            "--prefill-lens", "128", "--bw-size-mb", "128", "--out", str(tmp_path / "results"),
            "--work", str(model.parent / "work"), "--no-plot", "--name", "tiny", *extra]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = write_tiny_gguf(tmp_path_factory.mktemp("peers") / "tiny.gguf", vocab=512, hidden=64, layers=2,
                              heads=4, kv_heads=2, ffn=128)
    return path


def _one_error_line(capsys: pytest.CaptureFixture) -> str:
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("perfx-bench: error: "), err
    return err[0]


def test_unknown_peer_is_an_error(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for extra in ((), ("--skip-failed-peers",)):  # a typo is never skipped
        assert main(_argv(model, tmp_path, "ort,llama.cp", *extra)) == 2
        line = _one_error_line(capsys)
        assert "llama.cp" in line and "known: llama.cpp, ort-genai, ort" in line, line
    assert not (model.parent / "work").exists() or not any((model.parent / "work").iterdir())  # nothing built


def test_missing_peer_package_fails_the_run(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # find_spec() -> None: as if not installed
    assert main(_argv(model, tmp_path, "llama.cpp")) == 2
    line = _one_error_line(capsys)
    assert "peer llama.cpp failed: llama_cpp is not installed" in line and "--skip-failed-peers" in line, line


def test_skip_failed_peers_runs_the_rest_and_says_so(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    assert main(_argv(model, tmp_path, "llama.cpp", "--skip-failed-peers")) == 0
    out = capsys.readouterr().out
    assert "skipping llama.cpp: llama_cpp is not installed" in out, out
    assert "engines that ran: perfx; requested but skipped: llama.cpp" in out, out
    machine = json.loads((tmp_path / "results" / "bench_tiny_machine.json").read_text())
    assert machine["engines"] == ["perfx"] and list(machine["peers_skipped"]) == ["llama.cpp"]


def test_a_peer_whose_worker_fails_to_load(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A peer that passes the package check but whose worker dies at load fails the run too."""
    import perfx_compiler.cli.bench as bench
    from perfx_compiler.errors import PerfXError

    real = bench.Worker

    def worker(engine: str, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - same signature as Worker
        if engine == "ort":
            raise PerfXError("ort worker died (rc=1): simulated\nTraceback ...")
        return real(engine, *args, **kwargs)

    monkeypatch.setattr(bench, "Worker", worker)
    monkeypatch.setattr("perfx_compiler.bench.models.emit_ort_onnx", lambda *a, **k: tmp_path / "none.onnx")
    assert main(_argv(model, tmp_path, "ort")) == 2
    line = _one_error_line(capsys)
    assert "peer ort failed: its worker failed to load: ort worker died (rc=1): simulated" in line, line
