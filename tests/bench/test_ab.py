"""benchmarks/ab.py (the A/B tool) and the traced-step replay it is built on (perfx_compiler/bench/replay.py):
argument checks, per-arm environments, the paired summary, and one step and kernel run on a tiny model."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
ab = pytest.importorskip("ab")


def test_arms_need_labels_and_envs_one_each():
    args = ab.parse_args(["a", "b", "--level", "step", "--env", "X=1", "--env", ""])
    assert args.labels == ["a", "b"] and args.rounds == 200 and args.env == ["X=1", ""]
    assert ab.parse_args(["a", "b"]).prefill == [128, 512]
    for bad in (["a"], ["a", "b", "--labels", "x"], ["a", "b", "--labels", "x,x"], ["a", "b", "--env", "X=1"]):
        with pytest.raises(SystemExit):
            ab.parse_args(bad)


def test_arm_env_is_set_inside_and_restored_after(monkeypatch):
    monkeypatch.setenv("PERFX_AB_KEPT", "old")
    monkeypatch.delenv("PERFX_AB_NEW", raising=False)
    with ab.arm_env("PERFX_AB_KEPT=1,PERFX_AB_NEW=2"):
        assert os.environ["PERFX_AB_KEPT"] == "1" and os.environ["PERFX_AB_NEW"] == "2"
    assert os.environ["PERFX_AB_KEPT"] == "old" and "PERFX_AB_NEW" not in os.environ
    with ab.arm_env(""):
        assert os.environ["PERFX_AB_KEPT"] == "old"


def test_compile_level_runs_each_arm_fresh_with_its_env(monkeypatch, tmp_path):
    """--level compile: a warm-up compile per arm, then per round one compile per arm under the arm's env,
    ``{empty}`` a new empty folder each time, the artifact's phase seconds read back (the compiles faked)."""
    seen = []

    def fake_run(cmd, **kwargs):
        out = Path(cmd[cmd.index("-o") + 1])
        cache = os.environ.get("PERFX_KERNEL_CACHE", "")
        seen.append((cmd[cmd.index("--quiet") + 1 :], cache, Path(cache).is_dir() and not any(Path(cache).iterdir())))
        out.mkdir(parents=True)
        time.sleep(0.02)  # (a wall time the paired ratios can divide by)
        (out / "perfx-config.json").write_text('{"compile_seconds": {"build": 1.5}}')

    monkeypatch.setattr(ab.subprocess, "run", fake_run)
    monkeypatch.delenv("PERFX_KERNEL_CACHE", raising=False)
    with pytest.raises(SystemExit):
        ab.parse_args(["", "", "--level", "compile"])  # needs --compile MODEL
    args = ab.parse_args(["", "--knob x.y=1", "--level", "compile", "--compile", "m.gguf", "--labels", "a,b",
                          "--env", "PERFX_KERNEL_CACHE={empty}", "--env", "", "--rounds", "2", "--warmup",
                          "--work", str(tmp_path)])
    rows, summary, key = ab.level_compile(args, list(zip(args.labels, args.arms, args.env, strict=True)))
    assert len(seen) == 2 + 2 * 2 and key == "wall_s"
    empties = [cache for _, cache, _ in seen if cache]
    assert len(empties) == 3 == len(set(empties)) and all(fresh for _, cache, fresh in seen if cache)
    assert [extra for extra, cache, _ in seen if not cache] == [["--knob", "x.y=1"]] * 3
    assert [r["arm"] for r in rows] == ["a", "b", "b", "a"] and all(r["build_s"] == 1.5 for r in rows)
    assert {r["arm"] for r in summary} == {"a", "b"} and "PERFX_KERNEL_CACHE" not in os.environ


def test_paired_speedups_per_placement_leave_mixed_rounds_out():
    rows = [{"round": r, "arm": arm, "placement": place, "step_ms": ms}
            for r, place, a, b in ((0, "split", 2.0, 1.0), (1, "split", 4.0, 1.0), (2, "mixed", 1.0, 9.0),
                                   (3, "shared", 3.0, 3.0))
            for arm, ms in (("a", a), ("b", b))]
    got = {(s["placement"], s["arm"]): s for s in ab.paired(rows, ["a", "b"], "step_ms", higher_is_better=False)}
    assert set(got) == {("split", "a"), ("split", "b"), ("shared", "a"), ("shared", "b")}
    assert got[("split", "b")]["speedup"] == 3.0 and got[("split", "b")]["rounds"] == 2  # median of 2x, 4x
    assert got[("shared", "b")]["speedup"] == 1.0 and got[("split", "a")]["speedup"] == 1.0


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory):
    from perfx_compiler.model.gguf import load_gguf
    from perfx_compiler.model.testing import write_tiny_gguf
    from perfx_compiler.pipeline import compile_model

    root = tmp_path_factory.mktemp("ab")
    path, _ = write_tiny_gguf(root / "m.gguf", context_length=64)
    return compile_model(load_gguf(path), "host", root / "art", progress=False, activations="f32")


def test_traced_step_replays_the_decode_step_kernels(tiny_artifact):
    from perfx_compiler.bench.engines import perfx_weight_bytes
    from perfx_compiler.bench.replay import TracedStep, build_replay_module

    prompt = [int(t) for t in np.random.default_rng(0).integers(1, 200, 12)]
    step = TracedStep("a", tiny_artifact, prompt, 8)
    assert step.position == 8 and len(step.calls) == len(step.names) == len(step.weight_bytes) > 0
    # every streamed weight read once a step, as perfx-bench counts them (small scale arrays included)
    assert sum(step.weight_bytes) == perfx_weight_bytes(step.engine.manifest)
    mod = build_replay_module()
    assert len(list(mod.replay(step.calls, 3))) == 3
    med, low = step.per_kernel(mod.replay_each, 4)
    assert set(med) == set(step.names) | {"__step__"} and set(low) == set(med)
    assert med["__step__"] > 0 and step.time_engine_step(2) > 0
    assert step.engine.position == 8  # every timed step runs at the traced position


@pytest.mark.parametrize("level,extra", [("step", ["--passes", "2", "--engine-steps", "2"]),
                                         ("kernel", ["--steps", "2", "--shared-args"])])
def test_step_and_kernel_levels_write_their_csv(tiny_artifact, tmp_path, level, extra):
    out = tmp_path / f"{level}.csv"
    cmd = [sys.executable, str(REPO / "benchmarks" / "ab.py"), "--level", level, str(tiny_artifact),
           str(tiny_artifact), "--labels", "a,b", "--rounds", "2", "--position", "8", "--out", str(out), *extra]
    subprocess.run(cmd, check=True, timeout=600, capture_output=True)
    rows = list(csv.DictReader(out.open()))
    summary = [r for r in rows if r["round"] == "median"]
    assert {r["arm"] for r in summary} == {"a", "b"}
    if level == "kernel":
        assert any(r["kernel"] == "__step__" for r in summary)
