"""Per-workload search: sample the template's space, rank with the cost model, measure the top,
retrain, repeat, within a trial and time budget.

Resuming is free: configurations already in the log for (workload, target, bucket) are never
measured again, and the cost model starts from every stored record (of all workloads).
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from perfx_compiler.targets import TargetDescription
from perfx_compiler.tune.cost_model import CostModel, _work
from perfx_compiler.tune.measure import MeasureResult
from perfx_compiler.tune.records import TuningDatabase, TuningRecord, config_key
from perfx_compiler.tune.workloads import TuningTask

log = logging.getLogger(__name__)
MAX_ENUMERATE = 20000
EARLY_STOP_AFTER = 8  # measured candidates before the cost model may end a task
EARLY_STOP_GAIN = 0.03  # ... when it predicts no remaining candidate 3% faster than the best


class Measurer(Protocol):
    def measure(
        self,
        func: Any,
        template_name: str,
        workload_key: str,
        configs: list[dict[str, Any]],
        m_value: int,
    ) -> list[MeasureResult]: ...


@dataclass
class TaskResult:
    task: str
    workload_key: str
    bucket: int | None
    measured: int = 0
    skipped_known: int = 0
    best: TuningRecord | None = None
    default_s: float | None = None
    history: list[float] = field(default_factory=list)
    stopped_early: bool = False  # the cost model predicted no further gain


def enumerate_space(task: TuningTask, target: TargetDescription, rng: random.Random) -> list[dict[str, Any]]:
    """Valid configurations of the task's space (sampled when the product is huge)."""
    space = task.template.space(task.workload, target)
    if not space:
        return []
    knobs = list(space)
    total = 1
    for values in space.values():
        total *= max(1, len(values))
    if total <= MAX_ENUMERATE:
        combos = (dict(zip(knobs, vals, strict=True)) for vals in itertools.product(*space.values()))
    else:
        combos = ({k: rng.choice(space[k]) for k in knobs} for _ in range(MAX_ENUMERATE))
    out, seen = [], set()
    for config in combos:
        key = config_key(config)
        if key in seen or not task.template.is_valid(task.workload, config, target):
            continue
        seen.add(key)
        out.append(config)
    return out


def tune_task(
    task: TuningTask,
    target: TargetDescription,
    db: TuningDatabase,
    measurer: Measurer,
    model: CostModel,
    trials: int = 32,
    batch: int = 8,
    time_budget_s: float | None = None,
    explore: float = 0.25,
    seed: int = 0,
    progress: Any = None,
    early_stop: float | None = None,
) -> TaskResult:
    """Measure up to ``trials`` candidates of ``task`` (default first, then cost-model picks).

    ``early_stop`` (perfx-tune's sessions pass ``EARLY_STOP_GAIN``; None measures all ``trials``):
    after ``EARLY_STOP_AFTER`` measured candidates, stop as soon as the trained
    cost model predicts no remaining candidate faster than the best so far by that fraction
    (the budget then goes to other kernels)."""
    rng = random.Random(seed)
    wl = task.workload
    bucket = task.bucket
    result = TaskResult(task.name, wl.key, bucket)
    known = db.measured_configs(wl.key, wl.target_key, bucket)
    space = enumerate_space(task, target, rng)
    default = task.template.default_config(wl, target)
    candidates = [c for c in space if config_key(c) not in known]
    result.skipped_known = len(space) - len(candidates)
    if config_key(default) not in known and all(config_key(c) != config_key(default) for c in candidates):
        candidates.append(default)
    # The default goes first, so every task has a baseline even with a tiny budget.
    candidates.sort(key=lambda c: config_key(c) != config_key(default))
    start = time.perf_counter()
    best_prev = db.best(wl.key, wl.target_key, bucket, confirmed=False)  # raw times compare with raw times
    result.best = best_prev
    first = True
    while candidates and result.measured < trials:
        if time_budget_s is not None and time.perf_counter() - start > time_budget_s:
            break
        if early_stop is not None and _no_predicted_gain(model, task, candidates, result, early_stop):
            result.stopped_early = True  # also on resume: a task that had converged stays closed
            break
        n = min(batch, trials - result.measured, len(candidates))
        if first and config_key(candidates[0]) == config_key(default):
            chosen = [candidates[0]]
            pool = candidates[1:]
            n -= 1
        else:
            chosen, pool = [], candidates
        first = False
        if n > 0:
            scores = model.predict(wl.template, wl.dims, pool, task.m_value) if model.trained else None
            if scores is None:
                chosen += rng.sample(pool, min(n, len(pool)))
            else:
                n_explore = round(n * explore)
                order = sorted(range(len(pool)), key=lambda i: scores[i])
                top = [pool[i] for i in order[: n - n_explore]]
                rest = [pool[i] for i in order[n - n_explore :]]
                chosen += top + rng.sample(rest, min(n_explore, len(rest)))
        chosen_keys = {config_key(c) for c in chosen}
        candidates = [c for c in candidates if config_key(c) not in chosen_keys]
        measured = measurer.measure(task.func, wl.template, wl.key, chosen, task.m_value)
        for res in measured:
            record = TuningRecord(
                workload_key=wl.key,
                target_key=wl.target_key,
                template=wl.template,
                config=res.config,
                mean_s=res.mean_s if res.ok else float("inf"),
                std_s=res.std_s,
                bucket=bucket,
                error=res.error,
                dims=dict(wl.dims),
            )
            # Provenance (records.py: a record whose timing method changed is stale): cold = weights
            # flushed before each call (tune/traffic.py); measurers that do not say time warm.
            record.versions["timing"] = "cold" if res.extra.get("cold_cache") else "warm"
            if res.extra.get("device"):  # measured on a remote device (tune/rpc.py): which one
                record.versions["device"] = str(res.extra["device"])
            db.add(record)
            result.measured += 1
            if res.ok:
                model.add(wl.template, wl.dims, res.config, task.m_value, res.mean_s)
                if config_key(res.config) == config_key(default):
                    result.default_s = res.mean_s
                if result.best is None or res.mean_s < result.best.mean_s:
                    result.best = record
            else:
                log.info("candidate %s failed: %s", res.config, res.error)
            if result.best is not None:
                result.history.append(result.best.mean_s)
            if progress is not None:
                progress.update(1)
                if result.best is not None:
                    progress.set_postfix_str(f"{task.name}@M={task.m_value}: best {result.best.mean_s * 1e6:.1f} us")
        model.fit()
    return result


def _no_predicted_gain(model: CostModel, task: TuningTask, candidates: list[dict[str, Any]], result: TaskResult,
                       gain: float) -> bool:
    if result.measured + result.skipped_known < EARLY_STOP_AFTER or result.best is None or not candidates or not model.trained:
        return False
    scores = model.predict(task.workload.template, task.workload.dims, candidates, task.m_value)
    if scores is None:
        return False
    # Scores are log(seconds / work) (cost_model.add): back to seconds for this task.
    predicted = math.exp(float(np.min(scores))) * _work(task.workload.dims, task.m_value)
    return predicted > result.best.mean_s * (1.0 - gain)

