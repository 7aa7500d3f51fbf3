"""The tuner's confirmation stage (tune/confirm.py) and stale records (records.py).

A workload's top candidates and default are re-timed in alternation; the median winner is
recorded and is what the compiler builds, even where one lucky call made another config the raw
fastest; a resumed session does not redo a current confirmation. Measured records of decode-shaped
workloads without timing provenance (timed warm, before cold timing) are never applied."""

from __future__ import annotations

import json

import pytest

from perfx_compiler.schedule import schedule_func
from perfx_compiler.tune.confirm import confirm_candidates, confirm_task, is_confirmed
from perfx_compiler.tune.measure import MeasureResult
from perfx_compiler.tune.records import TuningDatabase, TuningRecord, config_key
from perfx_compiler.tune.session import group_tasks, tune_groups
from perfx_compiler.tune.workloads import extract_tasks, linear_module, matmul_func


def _gemm_task(target, bucket=16):
    (task,) = [t for t in extract_tasks(linear_module(None, 64, 96, None, True), target, buckets=(bucket,))
               if t.template.name == "gemm_cpu"]
    return task


class FakeTimer:
    """Deterministic paired rounds: ``rounds_by_config[config_key] -> per-round seconds``."""

    def __init__(self, rounds_by_config: dict[str, list[float]]):
        self.rounds_by_config = rounds_by_config
        self.calls: list[list[str]] = []

    def time_rounds(self, func, template_name, workload_key, configs, m_value, rounds):
        self.calls.append([config_key(c) for c in configs])
        out = []
        for c in configs:
            samples = self.rounds_by_config[config_key(c)][:rounds]
            out.append(MeasureResult(config=c, mean_s=sorted(samples)[len(samples) // 2], extra={"rounds": samples}))
        return out


def _space(task, target, n):
    import random

    from perfx_compiler.tune.search import enumerate_space

    default = task.template.default_config(task.workload, target)
    others = [c for c in enumerate_space(task, target, random.Random(0)) if config_key(c) != config_key(default)]
    return default, others[:n]


def _raw(db, task, config, seconds):
    wl = task.workload
    rec = TuningRecord(wl.key, wl.target_key, wl.template, config, seconds, bucket=task.bucket, dims=dict(wl.dims))
    rec.versions["timing"] = "warm"
    db.add(rec)


def test_confirmation_builds_the_median_winner_not_the_lucky_call(tmp_path, cpu_target):
    task = _gemm_task(cpu_target)
    wl = task.workload
    default, (lucky, steady, slow, never) = _space(task, cpu_target, 4)
    path = tmp_path / cpu_target.name / "m.jsonl"
    db = TuningDatabase(path)
    # The search's view (fastest single call): lucky < steady < slow < default < never.
    for config, s in ((default, 4e-4), (lucky, 1e-4), (steady, 2e-4), (slow, 3e-4), (never, 9e-4)):
        _raw(db, task, config, s)
    candidates = confirm_candidates(db, task, cpu_target)
    assert [config_key(c) for c in candidates] == [config_key(c) for c in (default, lucky, steady, slow)]
    timer = FakeTimer({
        config_key(default): [5e-4, 5e-4, 6e-4, 5e-4, 5e-4],
        config_key(lucky): [1e-4, 9e-4, 9e-4, 8e-4, 9e-4],  # one lucky round, slow otherwise
        config_key(steady): [4e-4, 4e-4, 7e-4, 4e-4, 4.5e-4],
        config_key(slow): [3e-4, 6e-4, 6e-4, 6e-4, 6e-4],
    })
    rec = confirm_task(task, cpu_target, db, timer)
    assert len(timer.calls) == 1 and rec is not None and rec.confirmed
    assert rec.config == steady and rec.mean_s == pytest.approx(4e-4)
    assert rec.confirm["default_median_s"] == pytest.approx(5e-4) and not rec.confirm["winner_is_default"]
    by_key = {config_key(e["config"]): e for e in rec.confirm["candidates"]}
    assert by_key[config_key(lucky)]["median_s"] == pytest.approx(9e-4)
    assert by_key[config_key(lucky)]["search_min_s"] == pytest.approx(1e-4)
    # The log on disk: the lookup perfx-compile uses prefers the confirmation to the raw fastest.
    again = TuningDatabase(path)
    assert again.best(wl.key, wl.target_key, task.bucket).config == steady
    assert again.best(wl.key, wl.target_key, task.bucket, confirmed=False).config == lucky
    assert again.best(wl.key, wl.target_key, bucket=64, nearest=True).config == steady
    _, name, config = schedule_func(task.func, cpu_target, again)
    assert name == "gemm_cpu" and config == steady
    line = json.loads(path.read_text().splitlines()[-1])
    assert line["confirm"]["rounds"] == 5 and line["versions"]["timing"] == "warm"
    # Current: nothing to redo. A new raw record that enters the top 3 makes it out of date.
    assert is_confirmed(again, task, cpu_target)
    assert confirm_task(task, cpu_target, again, timer) is not None and len(timer.calls) == 1
    other = [c for c in _space(task, cpu_target, 6)[1] if c not in (lucky, steady, slow, never)][0]
    _raw(again, task, other, 1.5e-4)
    assert not is_confirmed(again, task, cpu_target)


def test_confirmation_keeps_the_default_when_it_wins(tmp_path, cpu_target):
    task = _gemm_task(cpu_target)
    wl = task.workload
    default, (lucky, second) = _space(task, cpu_target, 2)
    db = TuningDatabase(tmp_path / cpu_target.name / "m.jsonl")
    for config, s in ((default, 3e-4), (lucky, 1e-4), (second, 2e-4)):
        _raw(db, task, config, s)
    timer = FakeTimer({config_key(default): [4e-4] * 5, config_key(lucky): [5e-4, 1e-4, 5e-4, 6e-4, 5e-4],
                       config_key(second): [4e-4, 4e-4, 4e-4, 9e-4, 9e-4]})  # ties the default: default wins
    rec = confirm_task(task, cpu_target, db, timer)
    assert rec.config == default and rec.confirm["winner_is_default"]
    assert db.best(wl.key, wl.target_key, task.bucket).config == default
    _, _, config = schedule_func(task.func, cpu_target, db)
    assert config == default
    # One candidate only: nothing to confirm, no record.
    solo = TuningDatabase(tmp_path / "solo" / "m.jsonl")
    _raw(solo, task, default, 3e-4)
    assert confirm_task(task, cpu_target, solo, timer) is None and len(solo) == 1


class FakeMeasurer(FakeTimer):
    """Search timings favour a wide nc; the paired rounds a narrow one."""

    def __init__(self):
        super().__init__({})
        self.seen: list[tuple[str, str, int]] = []

    def measure(self, func, template_name, workload_key, configs, m_value):
        self.seen += [(workload_key, config_key(c), m_value) for c in configs]
        return [MeasureResult(config=c, mean_s=1e-5 * m_value / (1 + c["nc"])) for c in configs]

    def time_rounds(self, func, template_name, workload_key, configs, m_value, rounds):
        self.calls.append([config_key(c) for c in configs])
        return [MeasureResult(config=c, mean_s=1.0, extra={"rounds": [1e-5 * m_value * (1 + c["nc"] / 100)] * rounds})
                for c in configs]


def _twin_tasks(target, buckets=(1, 16)):
    import tvm

    merged = tvm.IRModule()
    for i in range(2):  # equal dims, another function structure: one group, a member gets copies
        f = matmul_func(linear_module(None, 64, 96, None, True))
        f = f.with_attr("perfx.variant", 1) if i else f
        merged[f"mm{i}"] = f.with_attr("global_symbol", f"mm{i}")
    return extract_tasks(merged, target, buckets=buckets)


def test_session_confirms_each_workload_once_and_resume_skips_done_ones(tmp_path, cpu_target):
    tasks = _twin_tasks(cpu_target)
    path = tmp_path / cpu_target.name / "m.jsonl"
    fake = FakeMeasurer()
    summary = tune_groups(group_tasks(tasks), cpu_target, TuningDatabase(path), fake, trials=6, show_progress=False)
    groups = group_tasks(tasks)
    assert summary.confirmed == len(groups) == len(fake.calls) == 2
    db = TuningDatabase(path)
    for t in tasks:  # representative and member alike build the confirmed winner
        best = db.best(t.workload.key, t.workload.target_key, t.bucket)
        raw = db.best(t.workload.key, t.workload.target_key, t.bucket, confirmed=False)
        compared = [e["config"] for e in best.confirm["candidates"]]
        assert best.confirmed and len(compared) >= 3 and raw.config in compared
        assert best.config["nc"] == min(c["nc"] for c in compared)
        assert best.config["nc"] < raw.config["nc"]  # the search's fastest call (widest nc) lost the rounds
    # A finished session rerun: nothing measured, nothing re-confirmed.
    again = FakeMeasurer()
    summary2 = tune_groups(group_tasks(tasks), cpu_target, TuningDatabase(path), again, trials=6, show_progress=False)
    assert again.seen == [] and again.calls == [] and summary2.confirmed == 0
    # Killed during one group's confirmation (its confirmation line never written): the resumed
    # session confirms that group only, and measures nothing.
    lines = path.read_text().splitlines()
    first = next(json.loads(ln) for ln in lines if json.loads(ln).get("confirm"))
    kept = [ln for ln in lines if not (json.loads(ln).get("confirm") and json.loads(ln)["bucket"] == first["bucket"])]
    path.write_text("\n".join(kept) + "\n")
    third = FakeMeasurer()
    summary3 = tune_groups(group_tasks(tasks), cpu_target, TuningDatabase(path), third, trials=6, show_progress=False)
    assert third.seen == [] and len(third.calls) == 1 and summary3.confirmed == 1
    db = TuningDatabase(path)
    assert all(db.best(t.workload.key, t.workload.target_key, t.bucket).confirmed for t in tasks)


def _rec(dims, bucket=None, timing=None, source="measured", config=None, mean=1e-5):
    r = TuningRecord("wl", "tgt", "gemv_cpu", config or {"mr": 1}, mean, bucket=bucket, dims=dims, source=source)
    if timing is None:
        r.versions.pop("timing", None)
    else:
        r.versions["timing"] = timing
    return r


def test_warm_records_of_cold_timed_workloads_are_stale(tmp_path):
    db = TuningDatabase(tmp_path / "t" / "r.jsonl")
    gemv = {"N": 576, "K": 576, "M": 1}
    db.add(_rec(gemv, config={"mr": 8}, mean=1e-6))  # old warm record: L2 speed, must not apply
    assert db.best("wl", "tgt") is None and db.measured_configs("wl", "tgt") == set()
    assert len(db.for_workload("wl", "tgt", include_stale=True)) == 1
    db.add(_rec(gemv, timing="cold", config={"mr": 2}, mean=2e-5))
    assert db.best("wl", "tgt").config == {"mr": 2}  # the slower cold one is what applies
    assert db.measured_configs("wl", "tgt") == {config_key({"mr": 2})}  # a retune re-times mr=8 cold
    # The M=1 bucket of a prefill GEMM and a VNNI GEMV (B x MM rows) are decode-shaped too ...
    other = TuningDatabase(tmp_path / "u" / "r.jsonl")
    other.add(_rec({"N": 576, "K": 576, "M": 0}, bucket=1))
    other.add(_rec({"N": 576, "K": 576, "G": 32, "bits": 4, "B": 1, "MM": 1}))
    assert other.best("wl", "tgt", bucket=1) is None and other.best("wl", "tgt") is None
    # ... the M=16 bucket, attention, records that say how they were timed and predictions are not.
    other.add(_rec({"N": 576, "K": 576, "M": 0}, bucket=16, config={"mr": 4}))
    assert other.buckets("wl", "tgt") == [16] and other.best("wl", "tgt", bucket=16).config == {"mr": 4}
    third = TuningDatabase(tmp_path / "v" / "r.jsonl")
    third.add(_rec({"H": 9, "KVH": 3, "D": 64, "MAXC": 512}, bucket=1, config={"split": 2}))
    assert third.best("wl", "tgt", bucket=1).config == {"split": 2}
    for timing, source in (("warm", "measured"), (None, "predicted")):
        fresh = TuningDatabase(tmp_path / f"w{timing}" / "r.jsonl")
        fresh.add(_rec(gemv, timing=timing, source=source, config={"mr": 3}))
        assert fresh.best("wl", "tgt").config == {"mr": 3}


def test_local_measurer_confirms_a_gemv_cold_from_kept_builds(tmp_path, cpu_target):
    """Real kernels: the search's verified builds are reused (no rebuild), every candidate gets
    one value per round, timed cold like the search (a decode GEMV), and confirm_task records it."""
    from perfx_compiler.tune import measure
    from perfx_compiler.tune.cost_model import CostModel
    from perfx_compiler.tune.search import tune_task

    (task,) = extract_tasks(linear_module(1, 576, 576, None, True), cpu_target)
    assert task.template.name == "gemv_cpu"
    db = TuningDatabase(tmp_path / cpu_target.name / "g.jsonl")
    with measure.LocalMeasurer(cpu_target, workers=1, repeat=2, min_repeat_ms=1) as measurer:
        tune_task(task, cpu_target, db, measurer, CostModel(), trials=2, batch=2)
        assert len([r for r in db.records() if r.ok]) == 2
        builds: list[int] = []
        real = measurer._build_all
        measurer._build_all = lambda base, configs, *a: (builds.append(len(configs)), real(base, configs, *a))[1]
        measurer.round_ms = 2.0
        configs = confirm_candidates(db, task, cpu_target)
        results = measurer.time_rounds(task.func, "gemv_cpu", task.workload.key, configs, 1, rounds=3)
        assert builds == []  # both builds kept from the search
        for res in results:
            assert res.ok and len(res.extra["rounds"]) == 3 and res.extra["cold_cache"]
            assert res.mean_s == pytest.approx(sorted(res.extra["rounds"])[1])
            assert 1e-7 < res.mean_s < 1e-2
        rec = confirm_task(task, cpu_target, db, measurer, rounds=3)
        measurer.forget(task.workload.key)
        assert measurer._built == {}
    assert rec.confirmed and rec.versions["timing"] == "cold" and builds == []
    assert {config_key(e["config"]) for e in rec.confirm["candidates"]} == {config_key(c) for c in configs}
    assert db.best(task.workload.key, task.workload.target_key) is rec
