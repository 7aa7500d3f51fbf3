"""perfx-tune: session over grouped tasks (time-weighted budget, resume, shared records),
--no-measure predictions, --import-records validation, one-line errors; the pipeline's default
records and the per-bucket M dispatch of symbolic matmuls."""

from __future__ import annotations

import json

import numpy as np
import pytest

from perfx_compiler.cli import tune as tune_cli
from perfx_compiler.errors import TuningLogError
from perfx_compiler.schedule import apply_schedules
from perfx_compiler.schedule_template import find_template
from perfx_compiler.tune.cost_model import CostModel
from perfx_compiler.tune.measure import MeasureResult
from perfx_compiler.tune.records import TuningDatabase, TuningRecord, config_key, default_records
from perfx_compiler.tune.session import group_tasks, import_records, predict_groups, tune_groups
from perfx_compiler.tune.workloads import extract_tasks, linear_module, matmul_func


class FakeMeasurer:
    def __init__(self):
        self.seen: list[tuple[str, str, int]] = []

    def measure(self, func, template_name, workload_key, configs, m_value):
        out = []
        for c in configs:
            self.seen.append((workload_key, config_key(c), m_value))
            t = 1e-5 * m_value * (1 + abs(c.get("mr", 4) - 4) + abs(c.get("nr", 32) - 32) / 16)
            out.append(MeasureResult(config=c, mean_s=t))
        return out


def _model_tasks(target, buckets=(1, 16)):
    """Two structurally different functions with equal dims (as prefill / paged_prefill give)."""
    import tvm

    a = linear_module(None, 64, 96, None, True)
    b = linear_module(None, 64, 96, None, True)
    merged = tvm.IRModule()
    for i, mod in enumerate((a, b)):
        f = matmul_func(mod)
        if i:  # same computation, another function structure (an extra attribute)
            f = f.with_attr("perfx.variant", 1)
        merged[f"mm{i}"] = f.with_attr("global_symbol", f"mm{i}")
    return extract_tasks(merged, target, buckets=buckets)


def test_session_groups_budget_and_resume(tmp_path, cpu_target):
    tasks = _model_tasks(cpu_target)
    groups = group_tasks(tasks)
    assert len(groups) == len({t.m_value for t in tasks}) and all(len(g.members) == 1 for g in groups)
    path = tmp_path / cpu_target.name / "m.jsonl"
    fake = FakeMeasurer()
    summary = tune_groups(groups, cpu_target, TuningDatabase(path), fake, trials=6, show_progress=False)
    assert summary.measured == 12 and summary.shared == 12  # each rep measured, copied to its twin
    assert len({(k, c, m) for k, c, m in fake.seen}) == len(fake.seen)  # nothing measured twice
    db = TuningDatabase(path)
    for t in tasks:
        assert db.best(t.workload.key, t.workload.target_key, t.bucket) is not None
    # A rerun (a resumed or repeated session) measures nothing: trials count what is logged.
    again = FakeMeasurer()
    summary2 = tune_groups(group_tasks(tasks), cpu_target, TuningDatabase(path), again, trials=6, show_progress=False)
    assert again.seen == [] and summary2.measured == 0
    # A killed session (records of one group only) resumes with the rest, not with what it has.
    lines = path.read_text().splitlines()
    first_rep = json.loads(lines[0])["workload_key"]
    first_bucket = json.loads(lines[0])["bucket"]
    kept = [ln for ln in lines if json.loads(ln)["workload_key"] == first_rep and json.loads(ln)["bucket"] == first_bucket]
    path.write_text("\n".join(kept) + "\n" + '{"torn": ')
    third = FakeMeasurer()
    tune_groups(group_tasks(tasks), cpu_target, TuningDatabase(path), third, trials=6, show_progress=False)
    done = {(r["workload_key"], config_key(r["config"]), r["bucket"]) for r in map(json.loads, kept)}
    assert third.seen and not set(third.seen) & done


def test_time_budget_stops_session(tmp_path, cpu_target):
    tasks = _model_tasks(cpu_target, buckets=(1, 16, 64))
    summary = tune_groups(group_tasks(tasks), cpu_target, TuningDatabase(tmp_path / "t" / "m.jsonl"),
                          FakeMeasurer(), trials=50, time_budget_s=0.0, show_progress=False)
    assert summary.stopped_by_budget and summary.measured == 0


def test_no_measure_predictions(tmp_path, cpu_target):
    tasks = _model_tasks(cpu_target)
    db = TuningDatabase(tmp_path / cpu_target.name / "m.jsonl")
    assert predict_groups(group_tasks(tasks), cpu_target, db, CostModel()) == len(tasks)  # untrained: defaults
    for t in tasks:
        best = db.best(t.workload.key, t.workload.target_key, t.bucket)
        assert best.source == "predicted" and best.config == t.template.default_config(t.workload, cpu_target)
        assert 0 < best.mean_s < 1
    # Measured records beat predicted ones.
    t = tasks[0]
    db.add(TuningRecord(t.workload.key, t.workload.target_key, t.workload.template, {"mr": 2}, 5.0, bucket=t.bucket))
    assert db.best(t.workload.key, t.workload.target_key, t.bucket).source == "measured"


def test_import_records_validates(tmp_path, cpu_target):
    tasks = _model_tasks(cpu_target)
    t = tasks[0]
    good = TuningRecord(t.workload.key, t.workload.target_key, "gemm_cpu", {"mr": 4}, 1e-4, bucket=t.bucket)
    src = tmp_path / "in.jsonl"
    src.write_text(good.to_json() + "\n")
    db = TuningDatabase(tmp_path / "x" / "m.jsonl")
    assert import_records(src, db, tasks, cpu_target) == (1, 0)
    assert import_records(src, db, tasks, cpu_target) == (0, 1)
    wrong_target = TuningRecord(t.workload.key, "x86-avx2-0123456789", "gemm_cpu", {"mr": 4}, 1e-4)
    src.write_text(wrong_target.to_json() + "\n")
    with pytest.raises(TuningLogError, match="tuned for target key"):
        import_records(src, db, tasks, cpu_target)
    other = TuningRecord("gemm_cpu.v1:0000:" + t.workload.target_key, t.workload.target_key, "gemm_cpu", {}, 1e-4)
    src.write_text(other.to_json() + "\n")
    with pytest.raises(TuningLogError, match="not a workload of this model"):
        import_records(src, db, tasks, cpu_target)
    src.write_text(good.to_json()[:40])
    with pytest.raises(TuningLogError, match="truncated"):
        import_records(src, db, tasks, cpu_target)


def test_cli_one_line_errors(tmp_path, capsys):
    assert tune_cli.main(["smollm2-135m", "--target", "no-such-target", "--log-dir", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("perfx-tune: error: unknown target")
    log = tmp_path / "x86-avx512" / "smollm2-135m.jsonl"
    log.parent.mkdir(parents=True)
    log.write_text('{"workload_key": "a"\n{"workload_key": "b", "target_key": "t"}\n')  # corrupt, not just torn
    assert tune_cli.main(["smollm2-135m", "--target", "x86-avx512", "--log-dir", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "line 1 is not a tuning record" in err[0]
    assert tune_cli.main(["smollm2-135m", "--target", "cuda-sm90", "--log-dir", str(tmp_path), "--quiet"]) == 2
    assert "cannot be measured on this machine" in capsys.readouterr().err


def test_default_records(tmp_path, monkeypatch):
    from perfx_compiler.tune import records

    monkeypatch.setattr(records, "DEFAULT_LOG_ROOT", tmp_path)
    assert default_records("x86-avx512") is None  # no directory: template defaults
    d = tmp_path / "x86-avx512"
    d.mkdir()
    TuningDatabase(d / "m.jsonl").add(TuningRecord("wl", "tk", "gemm_cpu", {"mr": 4}, 1e-4))
    assert len(default_records("x86-avx512")) == 1
    assert len(default_records("x86-avx512", tmp_path)) == 1  # --tuning-log given a log root
    assert len(default_records("x86-avx512", d / "m.jsonl")) == 1
    assert default_records("x86-avx512", "none") is None  # --tuning-log none: template defaults
    with pytest.raises(TuningLogError):
        default_records("x86-avx512", tmp_path / "missing.jsonl")


def test_per_bucket_dispatch_is_correct(tmp_path, cpu_target):
    import tvm

    mod = linear_module(None, 64, 96, "add", True)
    tmpl, wl = find_template(matmul_func(mod), cpu_target)
    db = TuningDatabase(tmp_path / "r.jsonl")
    small = {"mr": 1, "nr": 32, "nc": 96, "parallel": "n", "pack_x": False, "pack_b": False}
    large = {"mr": 4, "nr": 16, "nc": 48, "parallel": "nm", "pack_x": True, "pack_b": False}
    db.add(TuningRecord(wl.key, wl.target_key, tmpl.name, small, 1e-5, bucket=1))
    db.add(TuningRecord(wl.key, wl.target_key, tmpl.name, large, 1e-4, bucket=64))
    out = apply_schedules(mod, cpu_target, db)
    text = out[next(g for g in out.functions if "matmul" in g.name_hint)].script()
    assert "if seq < T.int64(8)" in text  # threshold between buckets 1 and 64 on a log scale
    vm = tvm.relax.VirtualMachine(tvm.compile(out, cpu_target.tvm()), tvm.cpu())
    rng = np.random.default_rng(0)
    for m in (1, 7, 8, 33):
        x, w, r = (rng.standard_normal(s).astype("float32") for s in ((1, m, 64), (96, 64), (1, m, 96)))
        y = vm["main"](*(tvm.runtime.tensor(a) for a in (x, w, r))).numpy()
        np.testing.assert_allclose(y, x @ w.T + r, rtol=1e-4, atol=1e-4)


def test_cli_tunes_resumes_and_compile_uses_records(tmp_path, capsys, monkeypatch):
    """A real GGUF model through the CLI (a tiny one: the schedules, records and resume logic are
    the same as SmolLM2's, whose tuning and rebuild times are measured in benchmarks/tuning_time.py):
    a short session, one that finishes it, a rerun that measures nothing, and a compile from the
    records that runs no trials (the log does not grow)."""
    from perfx_compiler.model.testing import write_tiny_gguf
    from perfx_compiler.pipeline import compile_model

    model, _ = write_tiny_gguf(tmp_path / "tiny.gguf", hidden=128, ffn=256, context_length=64)
    args = [str(model), "--target", "x86-avx512", "--log-dir", str(tmp_path / "logs"), "--trials", "2",
            "--buckets", "16", "--time-budget", "3", "--quiet"]
    assert tune_cli.main(args) == 0
    logs = list((tmp_path / "logs" / "x86-avx512").glob("*.jsonl"))
    assert len(logs) == 1
    log = logs[0]
    lines = log.read_text().count("\n")
    assert lines > 0 and "measured" in capsys.readouterr().out
    # Finish the session (a budget that lets every task reach --trials), then rerun it.
    assert tune_cli.main(args[:-2] + ["600", "--quiet"]) == 0
    before = log.read_text().count("\n")
    assert before > lines  # the first session stopped at its budget; the second went on from there
    capsys.readouterr()
    assert tune_cli.main(args) == 0  # everything within --trials is logged: nothing to measure
    assert "measured 0 candidates" in capsys.readouterr().out and log.read_text().count("\n") == before
    compile_model(str(model), "x86-avx512", tmp_path / "artifact", progress=False, tuning_log=tmp_path / "logs")
    assert log.read_text().count("\n") == before
    assert (tmp_path / "artifact" / "model.so").exists()
