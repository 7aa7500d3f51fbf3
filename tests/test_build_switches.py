"""The PERFX_* variables that change compiled code are listed once (build_switches.py), recorded in
perfx-config.json and part of both compile caches' keys: LLM()'s and perfx-bench's (issue #22 item 6)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from perfx_compiler.build_switches import BUILD_SWITCHES, OTHER_VARIABLES, build_switch, build_switches

REPO = Path(__file__).resolve().parents[1]
SWITCH = "PERFX_VNNI_GEMM"  # any listed switch


def test_every_perfx_variable_the_code_reads_is_classified() -> None:
    """A new PERFX_* variable must go in one of the two lists; a listed build switch is read through
    build_switch() (so it cannot change kernels without reaching the manifest and the cache keys)."""
    read = re.compile(r"""(?:environ(?:\.get)?\(\s*|environ\[\s*|getenv\(\s*)["'](PERFX_[A-Z0-9_]+)["']""")
    found: dict[str, set[str]] = {}
    for folder in ("perfx_compiler", "schedules"):
        for f in (REPO / folder).rglob("*"):
            if f.suffix in (".py", ".c", ".cc", ".h") and "__pycache__" not in f.parts:
                for name in read.findall(f.read_text(errors="replace")):
                    found.setdefault(name, set()).add(str(f.relative_to(REPO)))
    assert not set(BUILD_SWITCHES) & set(OTHER_VARIABLES)
    unclassified = {n: sorted(fs) for n, fs in found.items() if n not in BUILD_SWITCHES and n not in OTHER_VARIABLES}
    assert not unclassified, f"list these in perfx_compiler/build_switches.py: {unclassified}"
    bypassing = {n: sorted(fs) for n, fs in found.items() if n in BUILD_SWITCHES}
    assert not bypassing, f"read these through build_switch(), not os.environ: {bypassing}"
    with pytest.raises(KeyError, match="BUILD_SWITCHES"):
        build_switch("PERFX_NOT_A_SWITCH")


def test_switches_in_effect(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in BUILD_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert build_switches() == {}
    monkeypatch.setenv(SWITCH, "0")
    monkeypatch.setenv("PERFX_SPIN_US", "5")  # runtime only: not a build switch
    assert build_switches() == {SWITCH: "0"}
    assert build_switch(SWITCH, "1") == "0"


def test_llm_cache_key_changes_with_a_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    from perfx_compiler.runtime.api import cache_key

    monkeypatch.delenv(SWITCH, raising=False)
    plain = cache_key("smollm2-135m", "host", {"max_context": 64})
    monkeypatch.setenv(SWITCH, "0")
    switched = cache_key("smollm2-135m", "host", {"max_context": 64})
    monkeypatch.setenv(SWITCH, "1")
    assert len({plain, switched, cache_key("smollm2-135m", "host", {"max_context": 64})}) == 3
    monkeypatch.delenv(SWITCH)
    assert cache_key("smollm2-135m", "host", {"max_context": 64}) == plain


def test_bench_build_stamp_changes_with_a_switch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from perfx_compiler.bench.models import build_stamp

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.delenv(SWITCH, raising=False)
    plain = build_stamp(gguf, "gguf", 1024)
    monkeypatch.setenv(SWITCH, "0")
    assert build_stamp(gguf, "gguf", 1024) != plain
    monkeypatch.delenv(SWITCH)
    assert build_stamp(gguf, "gguf", 1024) == plain


def test_manifest_records_the_switches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real compile of the tiny model under a switch that changes its VM code (PERFX_REUSE_VIEWS=0)."""
    from perfx_compiler.model.testing import write_tiny_gguf
    from perfx_compiler.pipeline import compile_model

    for name in BUILD_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PERFX_REUSE_VIEWS", "0")
    gguf, _ = write_tiny_gguf(tmp_path / "tiny.gguf", qtype="F32")
    out = compile_model(str(gguf), "host", tmp_path / "art", progress=False, batching=False)
    manifest = json.loads((Path(out) / "perfx-config.json").read_text())
    assert manifest["build_switches"] == {"PERFX_REUSE_VIEWS": "0"}
    # the compile options beside them: schedule source, pass list (None: default), records
    assert manifest["compile_options"]["schedule"] == "perfx" and manifest["compile_options"]["passes"] is None
    assert manifest["compile_options"]["best_effort"] is False
