"""A kernel that no schedule template can schedule is a compile error naming it (issue #22 item 5),
unless the caller asks for best effort; every kernel's template is recorded and reported.

Templates are made to fail by replacing their ``apply`` (monkeypatch); the model is the tiny F32
llama of ``model/testing.py`` (lowered once per module, a few seconds)."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from tvm import tirx

from perfx_compiler.errors import PerfXError
from perfx_compiler.schedule import UnscheduledKernelError
from perfx_compiler.schedule_template import template_by_name


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from perfx_compiler.model.testing import write_tiny_gguf

    path, _ = write_tiny_gguf(tmp_path_factory.mktemp("sched_err") / "tiny.gguf", qtype="F32")
    return path


@pytest.fixture(scope="module")
def lowered(tiny: Path) -> Any:
    """Phases 0-2 of the tiny model with perfx-compile's defaults (batching on, f32)."""
    from perfx_compiler.pipeline import lower_model

    return lower_model(str(tiny), "host")[1]


def _schedule(lowered: Any, best_effort: bool = False) -> Any:
    from perfx_compiler.pipeline import phase_schedule

    state = dataclasses.replace(lowered, notes={}, options=dataclasses.replace(lowered.options, best_effort=best_effort))
    phase_schedule(state)  # schedule_module clones the module: the fixture's stays unscheduled
    return state


def _break(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    def boom(self: Any, func: Any, workload: Any, config: Any, target: Any) -> Any:
        raise ValueError(f"boom in {self.name}")

    for name in names:
        monkeypatch.setattr(type(template_by_name(name)), "apply", boom)


def _kernels(state: Any) -> set[str]:
    return {gv.name_hint for gv, f in state.mod.functions.items() if isinstance(f, tirx.PrimFunc)}


def test_every_kernel_has_a_template(lowered: Any) -> None:
    state = _schedule(lowered)
    rows = state.notes["schedules"]
    assert {r["kernel"] for r in rows} == _kernels(state)
    assert all(r["template"] and r["source"] in ("record", "default", "pre-scheduled", "records per bucket")
               for r in rows), rows
    assert {"gemv_cpu", "gemm_cpu", "fallback_cpu"} <= {r["template"] for r in rows}, rows


def test_next_template_takes_over_from_a_failing_one(lowered: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Falling through to the next template that applies stays (not an error); the failure is kept."""
    _break(monkeypatch, "gemv_cpu")
    rows = _schedule(lowered).notes["schedules"]
    taken = [r for r in rows if r.get("failures")]
    assert taken and all(r["template"] not in (None, "gemv_cpu") and r["failures"][0].startswith("gemv_cpu (")
                         for r in taken), rows
    assert "fallback_cpu" in {r["template"] for r in taken}, rows


def test_failing_templates_are_an_error_naming_the_kernel(lowered: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import re

    before = {r["kernel"]: r["template"] for r in _schedule(lowered).notes["schedules"]}
    _break(monkeypatch, "gemv_cpu", "fallback_cpu")
    with pytest.raises(UnscheduledKernelError) as info:
        _schedule(lowered)
    msg = str(info.value)
    assert "\n" not in msg
    named = set(re.findall(r"kernel (\w+):", msg))
    # every kernel the fallback took is named; a gemv kernel another template can take is not
    assert {k for k, t in before.items() if t == "fallback_cpu"} <= named, msg
    assert {before[k] for k in named} == {"gemv_cpu", "fallback_cpu"}, msg
    assert "gemv_cpu (default config" in msg and "fallback_cpu (default config" in msg, msg
    assert "ValueError: boom in gemv_cpu" in msg and "best_effort" in msg, msg


def test_best_effort_builds_them_unscheduled_with_a_warning(
    lowered: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _break(monkeypatch, "gemv_cpu", "fallback_cpu")
    with caplog.at_level(logging.WARNING, logger="perfx_compiler.schedule"):
        state = _schedule(lowered, best_effort=True)
    left = [r for r in state.notes["schedules"] if r["template"] is None]
    assert left and all(r["source"] == "failed" and r["failures"][-1].startswith("fallback_cpu (") for r in left), left
    assert "best effort" in caplog.text and left[0]["kernel"] in caplog.text


def test_cli_error_then_best_effort_artifact_and_report(
    tiny: Path, lowered: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """perfx-compile: exit 2 with one line naming the kernel; --best-effort builds, and the manifest
    and the report list every kernel with its template (the unscheduled ones marked)."""
    from perfx_compiler import compile_report as report
    from perfx_compiler.cli.compile import main

    kernels = _kernels(_schedule(lowered))
    _break(monkeypatch, "gemv_cpu", "fallback_cpu")
    out = tmp_path / "art"
    assert main([str(tiny), "-o", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("perfx-compile: error:") and "kernel " in err[0], err
    assert not out.exists()

    assert main([str(tiny), "-o", str(out), "--quiet", "--best-effort"]) == 0
    manifest = json.loads((out / "perfx-config.json").read_text())
    assert manifest["compile_options"]["best_effort"] is True
    rows = manifest["schedules"]
    assert {r["kernel"] for r in rows} == kernels
    # the report: every kernel on its own line with its template or UNSCHEDULED
    monkeypatch.setattr(report, "variant_counts", lambda *a, **k: [{"variant": "unfused", "decode": 1, "prefill": 1}])
    text = report.compile_report(str(tiny), "host", out)
    lines = {ln.split()[0]: ln.split()[1:] for ln in text.splitlines() if ln.startswith("  ") and ln.split()}
    for r in rows:
        assert lines[r["kernel"]][0] == (r["template"] or "UNSCHEDULED"), text
    assert any(r["template"] is None for r in rows) and "UNSCHEDULED" in text
    assert "gemv_cpu (default config" in text  # why each is unscheduled


def test_unscheduled_error_is_a_perfx_error() -> None:
    assert issubclass(UnscheduledKernelError, PerfXError)  # one line, exit 2 from every command
