"""Tuning records (round trip, torn line, wrong target / changed workload never applied),
search resume without re-measuring (fake measurer), cost model, and apply_schedules."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest

from perfx_compiler.schedule import apply_schedules, schedule_func
from perfx_compiler.schedule_template import find_template
from perfx_compiler.tune.cost_model import CostModel
from perfx_compiler.tune.measure import MeasureResult
from perfx_compiler.tune.records import TuningDatabase, TuningRecord, config_key
from perfx_compiler.tune.search import tune_task
from perfx_compiler.tune.workloads import (
    extract_tasks,
    linear_module,
    matmul_func,
    rmsnorm_module,
)


def _rec(key="wl", target="tgt", mean=1e-3, config=None, bucket=None, error=None):
    return TuningRecord(key, target, "gemm_cpu", config or {"mr": 4}, mean, 1e-5, bucket, error)


def test_records_round_trip(tmp_path):
    db = TuningDatabase(tmp_path / "x86" / "a.jsonl")
    db.add(_rec(mean=2e-3, config={"mr": 2}))
    db.add(_rec(mean=1e-3, config={"mr": 4, "parallel": "n", "pack_x": True}))
    db.add(_rec(mean=float("inf"), config={"mr": 8}, error="build timed out"))
    again = TuningDatabase(tmp_path / "x86" / "a.jsonl")
    assert len(again) == 3
    best = again.best("wl", "tgt")
    assert best.config == {"mr": 4, "parallel": "n", "pack_x": True} and best.mean_s == pytest.approx(1e-3)
    failed = [r for r in again.records() if not r.ok]
    assert len(failed) == 1 and math.isinf(failed[0].mean_s) and failed[0].error == "build timed out"
    line = json.loads((tmp_path / "x86" / "a.jsonl").read_text().splitlines()[0])
    assert {"workload_key", "target_key", "template", "config", "mean_s", "std_s", "versions", "timestamp"} <= set(line)


def test_torn_last_line_is_skipped(tmp_path, caplog):
    path = tmp_path / "t" / "r.jsonl"
    db = TuningDatabase(path)
    db.add(_rec(mean=1e-3))
    with open(path, "a") as f:
        f.write('{"workload_key": "wl", "target_key": "tgt", "templ')  # writer died mid-line
    with caplog.at_level(logging.WARNING):
        again = TuningDatabase(path)
    assert len(again) == 1 and "torn last line" in caplog.text
    again.add(_rec(mean=5e-4, config={"mr": 6}))  # appending after a torn line stays readable
    third = TuningDatabase(path)
    assert len(third) == 2 and third.best("wl", "tgt").config == {"mr": 6}


def test_wrong_target_and_changed_workload_never_apply(tmp_path):
    db = TuningDatabase(tmp_path / "r.jsonl")
    db.add(_rec(key="wl", target="avx2-key", mean=1e-6))
    db.add(_rec(key="wl-old-structure", target="avx512-key", mean=1e-6))
    assert db.best("wl", "avx512-key") is None
    assert db.best("wl-new-structure", "avx512-key") is None
    assert db.best("wl", "avx2-key") is not None


def test_best_prefers_largest_bucket(tmp_path):
    db = TuningDatabase(tmp_path / "r.jsonl")
    db.add(_rec(mean=1e-6, config={"mr": 1}, bucket=1))
    db.add(_rec(mean=5e-4, config={"mr": 8}, bucket=256))
    db.add(_rec(mean=9e-4, config={"mr": 4}, bucket=256))
    assert db.best("wl", "tgt").config == {"mr": 8}
    assert db.best("wl", "tgt", bucket=1).config == {"mr": 1}


class FakeMeasurer:
    """Deterministic fake timings (a smooth function of the knobs); counts what it measures."""

    def __init__(self):
        self.seen: list[str] = []

    def measure(self, func, template_name, workload_key, configs, m_value):
        out = []
        for c in configs:
            self.seen.append(config_key(c))
            t = 1e-3 * (1 + abs(c.get("mr", 4) - 6) + abs(c.get("nr", 32) - 32) / 16 + (c.get("parallel") == "nm"))
            out.append(MeasureResult(config=c, mean_s=t, std_s=0.0))
        return out


def test_search_resumes_without_remeasuring(tmp_path, cpu_target):
    mod = linear_module(None, 64, 96, "add", False)
    tasks = [t for t in extract_tasks(mod, cpu_target, buckets=(16,)) if t.template.name == "gemm_cpu"]
    assert len(tasks) == 1 and tasks[0].bucket == 16
    task = tasks[0]
    path = tmp_path / "x86-avx512" / "r.jsonl"
    fake = FakeMeasurer()
    first = tune_task(task, cpu_target, TuningDatabase(path), fake, CostModel(), trials=12, batch=4)
    assert first.measured == 12 and len(set(fake.seen)) == 12
    default = task.template.default_config(task.workload, cpu_target)
    assert fake.seen[0] == config_key(default)  # the default is always measured first
    fake2 = FakeMeasurer()
    db2 = TuningDatabase(path)
    second = tune_task(task, cpu_target, db2, fake2, CostModel(), trials=12, batch=4, seed=1)
    assert second.measured == 12
    assert not set(fake2.seen) & set(fake.seen)  # nothing measured twice
    assert len(TuningDatabase(path)) == 24
    best = TuningDatabase(path).best(task.workload.key, task.workload.target_key, bucket=16)
    assert best.mean_s == min(first.best.mean_s, second.best.mean_s)


def test_cost_model_ranks_after_training(cpu_target):
    model = CostModel()
    dims = {"M": 0, "N": 256, "K": 64}
    configs = [{"mr": mr, "nr": nr, "parallel": "n"} for mr in (1, 2, 4, 6, 8) for nr in (16, 32, 48, 64)]
    for c in configs:
        model.add("gemm_cpu", dims, c, 64, 1e-3 * (1 + abs(c["mr"] - 6) + abs(c["nr"] - 32) / 16))
    assert model.fit()
    scores = model.predict("gemm_cpu", {"M": 0, "N": 512, "K": 64}, configs, 64)  # other workload
    best = configs[int(np.argmin(scores))]
    assert abs(best["mr"] - 6) <= 2 and abs(best["nr"] - 32) <= 16


def test_apply_schedules_marks_and_uses_records(tmp_path, cpu_target):
    from tvm import tirx

    mod = linear_module(None, 64, 96, "silu_mul", False)
    scheduled = apply_schedules(mod, cpu_target)
    prims = {gv.name_hint: f for gv, f in scheduled.functions.items() if isinstance(f, tirx.PrimFunc)}
    assert prims and all(bool(f.attrs["tirx.is_scheduled"]) for f in prims.values())
    assert not any(
        f.attrs is not None and "tirx.is_scheduled" in f.attrs
        for f in mod.functions.values()
        if isinstance(f, tirx.PrimFunc)
    )  # the input module is not modified
    assert apply_schedules(scheduled, cpu_target) is scheduled  # already scheduled: untouched

    func = matmul_func(mod)
    _, wl = find_template(func, cpu_target)
    config = {"mr": 2, "nr": 32, "nc": 96, "parallel": "nm", "pack_x": False, "pack_b": True}
    db = TuningDatabase(tmp_path / "r.jsonl")
    db.add(TuningRecord(wl.key, wl.target_key, "gemm_cpu", config, 1e-6, 0.0, 256))
    db.add(TuningRecord(wl.key, "some-other-target", "gemm_cpu", {"mr": 8, "nr": 16, "nc": 16, "parallel": "n"}, 1e-9))
    _, name, used = schedule_func(func, cpu_target, db)
    assert name == "gemm_cpu" and used == config
    # A stale record the template rejects falls back to the default config (bucket 64: the one
    # nearest schedule.TYPICAL_M, which a symbolic function without a dispatch is configured for).
    db.add(TuningRecord(wl.key, wl.target_key, "gemm_cpu", {"mr": 4, "nr": 24, "nc": 24, "parallel": "n"}, 1e-7, 0.0, 64))
    _, _, used = schedule_func(func, cpu_target, db)
    assert used == find_template(func, cpu_target)[0].default_config(wl, cpu_target)


def test_scheduled_module_runs_in_relax_vm(cpu_target):
    import tvm
    from tvm import relax

    mod = linear_module(None, 64, 96, "silu_mul", False)
    ex = tvm.compile(apply_schedules(mod, cpu_target), cpu_target.tvm())
    vm = relax.VirtualMachine(ex, tvm.cpu())
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 33, 64)).astype("float32")
    w = rng.standard_normal((96, 64)).astype("float32")
    r = rng.standard_normal((1, 33, 96)).astype("float32")
    out = vm["main"](*[tvm.runtime.tensor(a) for a in (x, w, r)]).numpy()
    y = x @ w.T
    np.testing.assert_allclose(out, y / (1 + np.exp(-y)) * r, rtol=1e-4, atol=1e-4)


def test_extract_tasks_buckets(cpu_target):
    mod = linear_module(None, 64, 96, None, False)
    tasks = extract_tasks(mod, cpu_target)
    gemm = [t for t in tasks if t.template.name == "gemm_cpu"]
    assert sorted(t.m_value for t in gemm) == [1, 16, 64, 256]
    static = extract_tasks(rmsnorm_module(1, 96), cpu_target)
    assert [t.m_value for t in static] == [1] and static[0].bucket is None


def test_local_measurer_builds_verifies_and_times(cpu_target):
    from perfx_compiler.tune.measure import LocalMeasurer

    func = matmul_func(linear_module(None, 32, 64, "add", True))
    template, wl = find_template(func, cpu_target)
    good = template.default_config(wl, cpu_target)
    bad = {**good, "nr": 24}  # not a multiple of the vector width: apply must refuse it
    measurer = LocalMeasurer(cpu_target, workers=2, build_timeout_s=120, repeat=2, min_repeat_ms=1)
    ok, rejected = measurer.measure(func, template.name, wl.key, [good, bad], m_value=16)
    assert ok.ok and 0 < ok.mean_s < 1e-2 and ok.extra["max_rel_error"] < 1e-5
    assert not rejected.ok and "ScheduleConfigError" in rejected.error


def test_worker_build_exports_the_scheduled_kernel(cpu_target, tmp_path):
    """The pool's build step, called in-process: a good config exports a library that computes what the
    same scheduled function computes in-process (against a float64 numpy reference too); a config the
    template refuses and a template that no longer matches come back as errors, not exceptions."""
    import tvm

    from perfx_compiler.tune.measure import _target_payload, _worker_build, build_func, random_inputs, run_func

    func = matmul_func(linear_module(None, 32, 64, "add", True))
    template, wl = find_template(func, cpu_target)
    good = template.default_config(wl, cpu_target)
    base = {"func": tvm.ir.save_json(func), "target": _target_payload(cpu_target), "template": template.name}

    out = _worker_build({**base, "config": good, "path": str(tmp_path / "good.so")})
    assert out["error"] is None and out["build_s"] > 0
    inputs = random_inputs(func, 16, seed=7)
    got = run_func(tvm.runtime.load_module(str(tmp_path / "good.so")), func, [a.copy() for a in inputs])
    same = run_func(build_func(template.apply(func, wl, good, cpu_target), cpu_target), func,
                    [a.copy() for a in inputs])
    np.testing.assert_array_equal(got[0], same[0])
    x, w, b = (inputs[0].astype(np.float64), inputs[1].astype(np.float64), inputs[2].astype(np.float64))
    np.testing.assert_allclose(got[0], x @ w.T + b, rtol=1e-4, atol=1e-4)

    bad = _worker_build({**base, "config": {**good, "nr": 24}, "path": str(tmp_path / "bad.so")})
    assert bad["error"].startswith("ScheduleConfigError") and not (tmp_path / "bad.so").exists()
    other = _worker_build({**base, "template": "attention_cpu", "config": good, "path": str(tmp_path / "o.so")})
    assert other == {"error": "template no longer matches"}


def test_local_measurer_build_timeout_kills_workers(cpu_target):
    import time

    from perfx_compiler.tune.measure import LocalMeasurer

    func = matmul_func(linear_module(None, 32, 64, None, False))
    template, wl = find_template(func, cpu_target)
    configs = [template.default_config(wl, cpu_target), {**template.default_config(wl, cpu_target), "mr": 2}]
    start = time.perf_counter()
    with LocalMeasurer(cpu_target, workers=1, build_timeout_s=0.3) as measurer:
        results = measurer.measure(func, template.name, wl.key, configs, m_value=16)
    assert time.perf_counter() - start < 60
    assert all(not r.ok and ("timed out" in r.error or "did not start" in r.error) for r in results)


def test_apply_schedules_on_decoder_block_slice(cpu_target):
    """embedding take -> residual add -> RMSNorm -> gate/up linears -> SiLU*mul, symbolic seq:
    every PrimFunc gets a template, and the compiled Relax module matches numpy at M = 1 and 7."""
    import tvm
    from tvm import relax, tirx

    from perfx_compiler.tune.workloads import legalize_fuse

    seq = tirx.Var("seq", "int64")
    H, F, V = 64, 96, 128
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1, seq, H], "float32"))
    g = relax.Var("g", relax.TensorType([H], "float32"))
    w1 = relax.Var("w1", relax.TensorType([F, H], "float32"))
    w2 = relax.Var("w2", relax.TensorType([F, H], "float32"))
    emb = relax.Var("emb", relax.TensorType([V, H], "float32"))
    ids = relax.Var("ids", relax.TensorType([1, seq], "int32"))
    with bb.function("main", [x, g, w1, w2, emb, ids]):
        with bb.dataflow():
            e = bb.emit(relax.op.take(emb, ids, axis=0))
            h = bb.emit(relax.op.add(x, e))
            n = bb.emit(relax.op.nn.rms_norm(h, g, axes=[-1], epsilon=1e-5))
            a = bb.emit(relax.op.matmul(n, relax.op.permute_dims(w1)))
            b = bb.emit(relax.op.matmul(n, relax.op.permute_dims(w2)))
            out = bb.emit_output(relax.op.multiply(relax.op.nn.silu(a), b))
        bb.emit_func_output(out)
    mod = legalize_fuse(bb.get())
    used = {}
    for gv, f in mod.functions.items():
        if isinstance(f, tirx.PrimFunc):
            _, name, _ = schedule_func(f, cpu_target)
            used[gv.name_hint] = name
    assert "gemm_cpu" in used.values() and "reduction_cpu" in used.values()
    assert None not in used.values()
    vm = relax.VirtualMachine(tvm.compile(apply_schedules(mod, cpu_target), cpu_target.tvm()), tvm.cpu())
    rng = np.random.default_rng(1)
    for m in (1, 7):
        arrs = [
            rng.standard_normal((1, m, H)).astype("float32"),
            rng.standard_normal(H).astype("float32"),
            rng.standard_normal((F, H)).astype("float32"),
            rng.standard_normal((F, H)).astype("float32"),
            rng.standard_normal((V, H)).astype("float32"),
            rng.integers(0, V, (1, m)).astype("int32"),
        ]
        got = vm["main"](*[tvm.runtime.tensor(a) for a in arrs]).numpy()
        hx = arrs[0] + arrs[4][arrs[5]]
        nx = hx / np.sqrt((hx * hx).mean(-1, keepdims=True) + 1e-5) * arrs[1]
        ya, yb = nx @ arrs[2].T, nx @ arrs[3].T
        np.testing.assert_allclose(got, ya / (1 + np.exp(-ya)) * yb, rtol=1e-4, atol=1e-4)
