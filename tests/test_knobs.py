"""No environment variable changes a compiled artifact (issue #23 item 2): the PERFX_* variables the
code reads are all listed in environment.py (runtime, caches, benchmarks), and what changes compiled
code is a compile option: ``--knob TEMPLATE.KEY=VALUE`` overrides a template's configuration, is
recorded in perfx-config.json and is part of both compile caches' keys (LLM()'s and perfx-bench's)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from perfx_compiler.environment import VARIABLES
from perfx_compiler.errors import PerfXError
from perfx_compiler.knobs import UnknownKnobError, by_template, knob_names, parse_knobs

REPO = Path(__file__).resolve().parents[1]
KNOB = "gemv_qvnni_cpu.prefetch"


def test_no_perfx_variable_changes_compiled_code() -> None:
    """Every PERFX_* variable read in perfx_compiler/ or schedules/ is in environment.VARIABLES (none
    changes an artifact); the compile path (passes, schedules, kernels, pipeline, targets, tuning
    records, packaging) reads none but a cache location."""
    read = re.compile(r"""(?:environ(?:\.get)?\(\s*|environ\[\s*|getenv\(\s*)["'](PERFX_[A-Z0-9_]+)["']""")
    found: dict[str, set[str]] = {}
    for folder in ("perfx_compiler", "schedules"):
        for f in (REPO / folder).rglob("*"):
            if f.suffix in (".py", ".c", ".cc", ".h") and "__pycache__" not in f.parts:
                for name in read.findall(f.read_text(errors="replace")):
                    found.setdefault(name, set()).add(str(f.relative_to(REPO)))
    unlisted = {n: sorted(fs) for n, fs in found.items() if n not in VARIABLES}
    assert not unlisted, f"an environment variable must not change compiled code; make it an option: {unlisted}"
    compile_side = ("schedules/", "perfx_compiler/passes/", "perfx_compiler/kernels/", "perfx_compiler/tune/",
                    "perfx_compiler/pipeline.py", "perfx_compiler/schedule", "perfx_compiler/targets.py",
                    "perfx_compiler/package.py", "perfx_compiler/device_export.py", "perfx_compiler/knobs.py")
    cache_dirs = {"PERFX_TARGETS_CACHE"}  # where downloaded toolchains live: the same compiler wherever it is
    readers = {n: r for n, fs in found.items() if n not in cache_dirs and (r := [f for f in fs if f.startswith(compile_side)])}
    assert not readers, f"the compile path reads environment variables: {readers}"
    assert not (REPO / "perfx_compiler" / "build_switches.py").exists()


def test_parse_knobs_and_unknown_names() -> None:
    names = knob_names()
    assert "prefetch" in names["gemv_qvnni_cpu"] and "splits" in names["attention_cpu"]
    assert parse_knobs([f"{KNOB}=0", "attention_cpu.splits=2", f"{KNOB}=64"]) == {
        "attention_cpu.splits": 2, KNOB: 64}  # sorted, a later setting wins
    assert parse_knobs({"gemm_cpu.parallel": "n", "gemm_cpu.pack_x": "false"}) == {
        "gemm_cpu.pack_x": False, "gemm_cpu.parallel": "n"}
    assert by_template({KNOB: 0, "gemv_qvnni_cpu.nta": 1}) == {"gemv_qvnni_cpu": {"prefetch": 0, "nta": 1}}
    with pytest.raises(UnknownKnobError, match=r"unknown knob 'gemv_qvnni_cpu.pquant'; valid knobs: .*gemv_qvnni_cpu\.prefetch"):
        parse_knobs(["gemv_qvnni_cpu.pquant=2"])  # a retired switch is no knob
    with pytest.raises(UnknownKnobError, match="NAME=VALUE"):
        parse_knobs(["gemv_qvnni_cpu.prefetch"])
    assert issubclass(UnknownKnobError, PerfXError)


def test_cli_refuses_an_unknown_knob_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from perfx_compiler.cli import compile as cli

    assert cli.main(["smollm2-135m", "--knob", "nope.x=1", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown knob 'nope.x'" in err[0] and KNOB in err[0]


def test_knob_wins_over_default_target_file_and_record() -> None:
    """On the template's default config (over the target file's defaults) and on a tuning record's."""
    from perfx_compiler.schedule_template import template_by_name
    from perfx_compiler.targets import load_target

    target = load_target("x86-avx512")
    template = template_by_name("gemv_qvnni_cpu")
    from perfx_compiler.formats.vnni import vnni_compute

    wl = template.match(vnni_compute(64, 576, 32, 4, True, False, "matmul", (1, 1)), target)
    assert template.default_config(wl, target)["prefetch"] == 128
    knobbed = dataclasses.replace(target, templates={"gemv_qvnni_cpu": {"prefetch": 64}},
                                  knobs=by_template(parse_knobs([f"{KNOB}=0"])))
    assert template.default_config(wl, knobbed)["prefetch"] == 0
    record = {"units": 2, "tasks": 4, "unroll": 1, "prefetch": 256}
    assert template.with_knobs(wl, record, knobbed) == {**record, "prefetch": 0}
    # a value that makes the config invalid is left out (with a warning), not applied
    for wrong in (1000, "abc"):  # too many units; not a number
        bad = dataclasses.replace(target, knobs={"gemv_qvnni_cpu": {"units": wrong}})
        assert template.default_config(wl, bad) == template.default_config(wl, target)


def test_llm_cache_key_changes_with_a_knob() -> None:
    from perfx_compiler.llm import cache_key

    plain = cache_key("smollm2-135m", "host", {"max_context": 64})
    knobbed = cache_key("smollm2-135m", "host", {"max_context": 64, "knobs": {KNOB: 0}})
    other = cache_key("smollm2-135m", "host", {"max_context": 64, "knobs": {KNOB: 64}})
    assert len({plain, knobbed, other}) == 3
    assert cache_key("smollm2-135m", "host", {"max_context": 64}) == plain


def test_bench_build_stamp_changes_with_a_knob(tmp_path: Path) -> None:
    from perfx_compiler.bench.models import build_stamp

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    plain = build_stamp(gguf, "gguf", 1024)
    assert build_stamp(gguf, "gguf", 1024, {KNOB: 0}) != plain
    assert build_stamp(gguf, "gguf", 1024, {}) == plain


def test_manifest_records_the_knobs(tmp_path: Path) -> None:
    """A real compile of the tiny model with a knob that changes its attention kernel."""
    from perfx_compiler.model.testing import write_tiny_gguf
    from perfx_compiler.pipeline import compile_model

    gguf, _ = write_tiny_gguf(tmp_path / "tiny.gguf", qtype="F32")
    out = compile_model(str(gguf), "host", tmp_path / "art", progress=False, batching=False,
                        knobs=["attention_cpu.prefetch=0"])
    manifest = json.loads((Path(out) / "perfx-config.json").read_text())
    options = manifest["compile_options"]
    assert options["knobs"] == {"attention_cpu.prefetch": 0} and "build_switches" not in manifest
    # the compile options beside them: schedule source, pass list (None: default), records
    assert options["schedule"] == "perfx" and options["passes"] is None
    assert options["best_effort"] is False and options["cubin"] is True
