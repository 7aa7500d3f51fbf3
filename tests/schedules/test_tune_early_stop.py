"""Early stop of a tuning task: once the cost model predicts no remaining candidate faster than
the best by EARLY_STOP_GAIN, the task ends (perfx-tune's default budget relies on it); without
early stop the same task measures every trial."""

from __future__ import annotations

from perfx_compiler.tune.cost_model import CostModel
from perfx_compiler.tune.measure import MeasureResult
from perfx_compiler.tune.records import TuningDatabase, config_key
from perfx_compiler.tune.search import EARLY_STOP_AFTER, EARLY_STOP_GAIN, tune_task
from perfx_compiler.tune.workloads import extract_tasks, linear_module


class _FlatMeasurer:
    """Every candidate but the default takes the same time: nothing left to gain after a few."""

    def __init__(self, default_key: str) -> None:
        self.default_key = default_key
        self.seen: list[str] = []

    def measure(self, func, template_name, workload_key, configs, m_value):
        out = []
        for c in configs:
            self.seen.append(config_key(c))
            out.append(MeasureResult(config=c, mean_s=2e-3 if config_key(c) == self.default_key else 1e-3))
        return out


def _task(cpu_target):
    mod = linear_module(None, 64, 96, None, True)
    return next(t for t in extract_tasks(mod, cpu_target, buckets=(16,)) if t.template.name == "gemm_cpu")


def test_early_stop_ends_a_converged_task(tmp_path, cpu_target):
    task = _task(cpu_target)
    default = config_key(task.template.default_config(task.workload, cpu_target))
    stopped = tune_task(task, cpu_target, TuningDatabase(tmp_path / "a.jsonl"), _FlatMeasurer(default), CostModel(),
                        trials=40, batch=4, early_stop=EARLY_STOP_GAIN)
    assert stopped.stopped_early and EARLY_STOP_AFTER <= stopped.measured < 40
    full = tune_task(task, cpu_target, TuningDatabase(tmp_path / "b.jsonl"), _FlatMeasurer(default), CostModel(),
                     trials=40, batch=4, early_stop=None)
    assert not full.stopped_early and full.measured == 40
    # A resumed session (its cost model trained on the log, as perfx-tune's) does not reopen it.
    db = TuningDatabase(tmp_path / "a.jsonl")
    model = CostModel()
    model.add_records(db.records(), {task.workload.key: task.workload})
    model.fit()
    again = tune_task(task, cpu_target, db, _FlatMeasurer(default), model, trials=40, batch=4, early_stop=EARLY_STOP_GAIN)
    assert again.stopped_early and again.measured == 0
