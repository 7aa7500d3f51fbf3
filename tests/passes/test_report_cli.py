"""``perfx-compile --report``: kernel launches per decode step for each fusion variant, counted in
really lowered modules, dropping once the fusions are on; plus the artifact's decode time."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from perfx_compiler import compile_report as report


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from perfx_compiler.model.testing import write_tiny_gguf

    path, _ = write_tiny_gguf(tmp_path_factory.mktemp("report") / "tiny.gguf", qtype="F32")
    return path


def test_fusion_variants_add_one_fusion_at_a_time() -> None:
    variants = report.fusion_variants()
    labels = [v[0] for v in variants]
    assert labels[0] == "unfused"
    for name in ("fuse_add_norm", "merge_projections", "fuse_swiglu", "fuse_gemv_prologue"):
        assert f"+ {name}" in labels
    assert not any(n.startswith(report.FUSION_PREFIXES) for n in variants[0][1])
    assert "weight_layout" in variants[0][1]  # non-fusion passes stay on in every variant
    for (_, a), (_, b) in zip(variants, variants[1:], strict=False):
        assert set(a) < set(b) and len(b) == len(a) + 1


def test_report_counts_drop_after_fusion(tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from perfx_compiler.cli.compile import main

    assert main([str(tiny_gguf), "-o", str(tmp_path / "art"), "--quiet", "--report", "--quantization", "f32"]) == 0
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^  (unfused|\+ \w+)(?:  \(= default\))?\s+(\d+)\s+\d+", out, flags=re.M))
    assert set(rows) == {label for label, _ in report.fusion_variants()}, out
    counts = [int(rows[label]) for label, _ in report.fusion_variants()]
    assert all(b <= a for a, b in zip(counts, counts[1:], strict=False)), out  # no fusion adds launches
    # tiny llama, 2 layers: add+RMSNorm saves 5 launches, merged Q/K/V and gate/up at least 2 per layer
    assert int(rows["+ fuse_add_norm"]) <= int(rows["unfused"]) - 5, out
    assert int(rows["+ merge_projections"]) <= int(rows["+ fuse_add_norm"]) - 4, out
    m = re.search(r"decode kernels: (\d+) -> (\d+)", out)
    assert m and int(m.group(2)) < int(m.group(1)) and int(m.group(2)) == counts[-1], out
    assert re.search(r"decode step of .*: \d+\.\d+ ms", out), out
    assert "benchmarks/fusion_report.py" in out
    # The numbers are call_tir launches of the lowered decode function, not a table: recount the
    # first and last variants in an independent lowering.
    for label, passes in (report.fusion_variants()[0], report.fusion_variants()[-1]):
        assert int(rows[label]) == _decode_launches(tiny_gguf, passes), (label, out)


def _decode_launches(model: Path, passes: list[str]) -> int:
    from tvm import relax

    from perfx_compiler.pipeline import lower_model

    mod, _ = lower_model(str(model), "host", passes=passes, quantization="f32", batching=False)
    launches = 0
    for block in mod["decode"].body.blocks:
        for b in block.bindings:
            if isinstance(b.value, relax.Call) and str(getattr(b.value.op, "name", "")) in (
                    "relax.call_tir", "relax.call_tir_inplace"):
                launches += 1
    return launches
