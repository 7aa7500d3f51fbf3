"""A tuning session over a whole model (what ``perfx-tune`` runs).

1. Tasks come from the pipeline's phases 0-2 (``pipeline.lower_model``) via ``extract_tasks``.
2. Equivalent tasks (same template, dims, layout/epilogue and M bucket; they differ only in
   function structure details such as how the symbolic M is spelled) are grouped: one is measured
   and its records are copied to the others with ``source="shared"``.
3. Phase A measures every group's template default plus one sampled candidate (a baseline for
   every kernel, builds in parallel). Phase B spends the rest of the time budget where the model's
   run time is: groups in order of (baseline seconds x functions using it), each getting a share
   of the remaining time proportional to that weight, the XGBoost model ranking the candidates.
4. Confirmation (``tune/confirm.py``): when a group's search ends, its top candidates and the
   template default are re-timed in alternation and the median winner is appended as a
   confirmation record, which the compiler prefers to the raw fastest record. Groups whose search
   ended earlier (a resumed session, the budget) are confirmed after phase B.
5. Everything is appended to the log as it is measured (fsync per record), and configurations in
   the log are never measured again, so a killed session resumes where it stopped; ``trials``
   counts the records already in the log, a current confirmation is not redone.

``predict_groups`` is the ``--no-measure`` path; ``import_records`` the ``--import-records`` one.
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from perfx_compiler.errors import DeviceUnavailableError, TuningLogError
from perfx_compiler.schedule_template import target_key
from perfx_compiler.targets import TargetDescription
from perfx_compiler.tune.confirm import confirm_task, is_confirmed
from perfx_compiler.tune.cost_model import MIN_TRAIN, CostModel, _work
from perfx_compiler.tune.records import TuningDatabase, TuningRecord, config_key, read_records
from perfx_compiler.tune.search import EARLY_STOP_GAIN, Measurer, enumerate_space, tune_task
from perfx_compiler.tune.workloads import TuningTask

log = logging.getLogger(__name__)


def log_name(model: str) -> str:
    """File stem of a model's tuning log: ``smollm2-135m``, ``model`` for ``/x/model.gguf``."""
    stem = Path(model).stem if model.endswith((".gguf", ".onnx")) else Path(model.rstrip("/")).name
    return re.sub(r"[^A-Za-z0-9._-]+", "_", stem) or "model"


@dataclass
class TaskGroup:
    rep: TuningTask  # the task that is measured
    members: list[TuningTask] = field(default_factory=list)  # equivalent tasks, records copied
    baseline_s: float | None = None

    @property
    def count(self) -> int:
        return self.rep.count + sum(m.count for m in self.members)

    @property
    def label(self) -> str:
        wl = self.rep.workload
        dims = ",".join(f"{k}={v}" for k, v in wl.dims.items() if k != "M")
        # The kind tells a gather / dequantize from the GEMV over the same table (SmolLM2's tied
        # embedding: the N=49152 K=576 take read as an lm-head with 40 ns timings).
        kind = wl.info.get("kind")
        name = wl.template if kind in (None, "matmul") else f"{wl.template}:{kind}"
        return f"{name}[{dims}]@M={self.rep.m_value}"

    def weight(self) -> float:
        """Seconds this kernel costs per model call (baseline x functions using it); before a
        baseline exists, a work-based guess so heavy kernels still come first."""
        if self.baseline_s is not None and math.isfinite(self.baseline_s):
            return self.baseline_s * self.count
        return _work(self.rep.workload.dims, self.rep.m_value) * 1e-11 * self.count


def group_tasks(tasks: list[TuningTask]) -> list[TaskGroup]:
    groups: dict[str, TaskGroup] = {}
    for task in tasks:
        wl = task.workload
        info = {k: v for k, v in wl.info.items() if k != "block"}  # block names are cosmetic
        key = json.dumps([wl.template, wl.key.split(":")[0], wl.dims, wl.symbolic, info, task.m_value],
                         sort_keys=True, default=str)
        if key in groups:
            groups[key].members.append(task)
        else:
            groups[key] = TaskGroup(task)
    return list(groups.values())


def _identity(r: TuningRecord) -> tuple[str, bool, float | None]:
    """What makes a record distinct for copying / importing: its config, whether it is a
    prediction, and for a confirmation which one (a later one may name an earlier winner again)."""
    return config_key(r.config), r.source == "predicted", r.timestamp if r.confirmed else None


def sync_members(db: TuningDatabase, group: TaskGroup) -> int:
    """Copy the representative's records to equivalent workloads that lack them; returns how many.
    Copies keep the timing provenance, confirmation and (for confirmations) the timestamp."""
    rep = group.rep
    rows = db.for_workload(rep.workload.key, rep.workload.target_key, rep.bucket)
    added = 0
    for member in group.members:
        wl = member.workload
        have = {_identity(r) for r in db.for_workload(wl.key, wl.target_key, member.bucket)}
        for r in rows:
            if _identity(r) in have:
                continue
            copy = TuningRecord(
                workload_key=wl.key, target_key=wl.target_key, template=r.template, config=dict(r.config),
                mean_s=r.mean_s, std_s=r.std_s, bucket=member.bucket, error=r.error, dims=dict(wl.dims),
                source="predicted" if r.source == "predicted" else "shared", versions=dict(r.versions),
                confirm=r.confirm,
            )
            if r.confirmed:
                copy.timestamp = r.timestamp  # the latest confirmation decides: keep the order
            db.add(copy)
            added += 1
    return added


def _baseline(db: TuningDatabase, task: TuningTask, target: TargetDescription) -> float | None:
    wl = task.workload
    default = config_key(task.template.default_config(wl, target))
    rows = [r for r in db.for_workload(wl.key, wl.target_key, task.bucket)
            if r.ok and r.source != "predicted" and not r.confirmed]
    for r in rows:
        if config_key(r.config) == default:
            return r.mean_s
    return min((r.mean_s for r in rows), default=None)


def _known(db: TuningDatabase, task: TuningTask) -> int:
    wl = task.workload
    return len(db.measured_configs(wl.key, wl.target_key, task.bucket))


@dataclass
class SessionSummary:
    groups: list[TaskGroup]
    measured: int = 0
    shared: int = 0
    seconds: float = 0.0
    stopped_by_budget: bool = False
    rows: list[dict[str, Any]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # groups whose reference run failed (left at defaults)
    confirmed: int = 0  # confirmation records written by this session
    confirm_s: float = 0.0  # seconds spent confirming


def _guarded(group: TaskGroup, fn: Any) -> Any:
    """Run one group's search; a failure of the harness itself (the unscheduled reference does not
    run, ...) skips that workload instead of ending the session. Candidate failures never get here."""
    try:
        return fn()
    except DeviceUnavailableError:
        raise  # no device at all: every workload would fail the same way, stop with its one line
    except Exception as err:  # noqa: BLE001
        log.warning("skipping %s (%s): %s: %s", group.label, group.rep.name, type(err).__name__, str(err)[:300])
        return None


def tune_groups(
    groups: list[TaskGroup],
    target: TargetDescription,
    db: TuningDatabase,
    measurer: Measurer,
    trials: int = 32,
    time_budget_s: float | None = None,
    batch: int = 8,
    seed: int = 0,
    show_progress: bool = True,
) -> SessionSummary:
    """Measure ``groups`` within ``trials`` per task and ``time_budget_s`` in all (see module doc)."""
    from tqdm.auto import tqdm

    start = time.perf_counter()
    summary = SessionSummary(groups)
    model = CostModel(seed)
    model.add_records(db.records(), {g.rep.workload.key: g.rep.workload for g in groups})
    model.fit()
    for g in groups:  # a resumed session first completes the copies a killed one had not made
        summary.shared += sync_members(db, g)
    planned = sum(max(0, trials - _known(db, g.rep)) for g in groups)
    broken: set[int] = set()

    def left() -> float | None:
        return None if time_budget_s is None else time_budget_s - (time.perf_counter() - start)

    can_confirm = hasattr(measurer, "time_rounds")
    open_groups: dict[str, int] = {}  # rep workload key -> groups not yet confirmed (kept builds)
    for g in groups:
        open_groups[g.rep.workload.key] = open_groups.get(g.rep.workload.key, 0) + 1

    confirmed: set[int] = set()

    def confirm(g: TaskGroup) -> None:
        """The group's confirmation stage (once; a current one is not redone), then its copies."""
        if not can_confirm or id(g) in broken or id(g) in confirmed:
            return
        confirmed.add(id(g))
        key = g.rep.workload.key
        if not is_confirmed(db, g.rep, target):
            t0 = time.perf_counter()
            rec = _guarded(g, lambda: confirm_task(g.rep, target, db, measurer))
            summary.confirm_s += time.perf_counter() - t0
            if rec is not None:
                summary.confirmed += 1
                summary.shared += sync_members(db, g)
                log.info("%s confirmed %s (%s)", g.label, rec.config,
                         "default" if rec.confirm.get("winner_is_default") else "tuned")
        open_groups[key] -= 1
        if open_groups[key] == 0 and hasattr(measurer, "forget"):
            measurer.forget(key)  # the kept builds of this workload are no longer needed

    with tqdm(total=planned, disable=not show_progress, desc="tuning", unit="trial", dynamic_ncols=True) as bar:
        # Phase A: a measured baseline (the default first) for every group, heaviest guesses first.
        for i, g in enumerate(sorted(groups, key=lambda g: -g.weight())):
            remaining = left()
            if remaining is not None and remaining <= 0:
                summary.stopped_by_budget = True
                break
            todo = min(2, trials - _known(db, g.rep))
            if todo > 0:
                res = _guarded(g, lambda g=g, todo=todo, i=i: tune_task(
                    g.rep, target, db, measurer, model, trials=todo, batch=2, seed=seed + i, progress=bar))
                if res is None:
                    summary.failed.append(g.label)
                    broken.add(id(g))
                    continue
                summary.measured += res.measured
            g.baseline_s = _baseline(db, g.rep, target)
            summary.shared += sync_members(db, g)
        # Phase B: the remaining budget in proportion to each kernel's share of the run time.
        order = sorted(groups, key=lambda g: -g.weight())
        pending_weight = sum(g.weight() for g in order)
        for i, g in enumerate(order):
            if id(g) in broken:
                continue
            remaining = left()
            weight = g.weight()
            if remaining is not None and remaining <= 0:
                summary.stopped_by_budget = summary.stopped_by_budget or _known(db, g.rep) < trials
                break
            share = None if remaining is None else remaining * weight / max(pending_weight, 1e-30)
            pending_weight -= weight
            todo = trials - _known(db, g.rep)
            if todo <= 0:
                confirm(g)  # searched before (a resumed session): confirm it unless already done
                continue
            if share is not None and share < 1.0:
                continue
            res = _guarded(g, lambda g=g, todo=todo, share=share, i=i: tune_task(
                g.rep, target, db, measurer, model, trials=todo, batch=batch, time_budget_s=share,
                seed=seed + 1000 + i, progress=bar, early_stop=EARLY_STOP_GAIN))
            if res is None:
                summary.failed.append(g.label)
                broken.add(id(g))
                continue
            summary.measured += res.measured
            summary.shared += sync_members(db, g)
            confirm(g)  # the end of this workload's search
    # Groups whose search the budget ended early: confirm what they have (seconds each; the
    # raw fastest record of a short search is the likeliest noise winner).
    for g in groups:
        confirm(g)
    summary.seconds = time.perf_counter() - start
    summary.rows = summary_rows(groups, target, db)
    return summary


def summary_rows(groups: list[TaskGroup], target: TargetDescription, db: TuningDatabase) -> list[dict[str, Any]]:
    rows = []
    for g in groups:
        wl = g.rep.workload
        best = db.best(wl.key, wl.target_key, g.rep.bucket)
        base = _baseline(db, g.rep, target)
        source = None if best is None else best.source
        if best is not None and best.confirmed:  # paired medians: the default's from the same rounds
            paired = best.confirm.get("default_median_s")
            base = paired if paired is not None else base
            source = "confirmed default" if best.confirm.get("winner_is_default") else "confirmed"
        rows.append({
            "workload": g.label,
            "functions": g.count,
            "trials": _known(db, g.rep),
            "default_us": None if base is None else base * 1e6,
            "best_us": None if best is None else best.mean_s * 1e6,
            "source": source,
            "speedup": None if best is None or base is None else base / best.mean_s,
            "config": None if best is None else best.config,
        })
    return rows


# ----------------------------------------------------------------------------- --no-measure


def _roofline_s(task: TuningTask, target: TargetDescription) -> float:
    """Seconds a kernel needs at the target's peak flops or bandwidth (whichever binds)."""
    d, m = task.workload.dims, task.m_value
    if {"N", "K"} <= d.keys():
        flops, nbytes = 2.0 * m * d["N"] * d["K"], 4.0 * (d["N"] * d["K"] + m * (d["K"] + d["N"]))
    else:
        flops = nbytes = 4.0 * _work(d, m)
    peak = (target.peak_gflops_fp32 or 50.0) * 1e9
    bandwidth = (target.memory_bandwidth_gbs or 10.0) * 1e9
    return max(flops / peak, nbytes / bandwidth)


def training_model(db: TuningDatabase, log_root: Path, seed: int = 0) -> tuple[CostModel, str]:
    """Cost model from this target's records, or from every target's under ``log_root`` when
    the target has too few (rankings of tile shapes transfer; absolute times do not)."""
    model = CostModel(seed)
    model.add_records([r for r in db.records() if r.source != "predicted"], {})
    scope = "this target's records"
    if len(model) < MIN_TRAIN:
        model = CostModel(seed)
        for path in sorted(log_root.glob("*/*.jsonl")):
            model.add_records([r for r in read_records(path) if r.source != "predicted"], {})
        scope = f"records of all targets under {log_root}"
    model.fit()
    return model, scope


def predict_groups(
    groups: list[TaskGroup], target: TargetDescription, db: TuningDatabase, model: CostModel, top: int = 6
) -> int:
    """Pick a configuration per task without measuring: the best-ranked of the template's space
    that the template can apply (the default when the model is untrained); write it as a
    ``predicted`` record with the predicted (or roofline) seconds. Returns records written."""
    written = 0
    for i, g in enumerate(groups):
        task, wl = g.rep, g.rep.workload
        if any(r.ok for r in db.for_workload(wl.key, wl.target_key, task.bucket)):
            written += sync_members(db, g)
            continue  # measured or predicted before: keep it (resume)
        default = task.template.default_config(wl, target)
        ranked: list[tuple[dict[str, Any], float | None]] = [(default, None)]
        if model.trained:
            space = enumerate_space(task, target, random.Random(i))
            scores = model.predict(wl.template, wl.dims, space, task.m_value) if space else None
            if scores is not None:
                order = sorted(range(len(space)), key=lambda j: scores[j])[:top]
                ranked = [(space[j], float(scores[j])) for j in order] + ranked
        chosen, score = default, None
        for config, sc in ranked:
            try:
                task.template.apply(task.func, wl, config, target)
            except Exception as err:  # noqa: BLE001 - an unappliable prediction is skipped
                log.info("predicted config %s does not apply: %s", config, err)
                continue
            chosen, score = config, sc
            break
        seconds = math.exp(score) * _work(wl.dims, task.m_value) if score is not None else _roofline_s(task, target)
        db.add(TuningRecord(workload_key=wl.key, target_key=wl.target_key, template=wl.template, config=chosen,
                            mean_s=seconds, bucket=task.bucket, dims=dict(wl.dims), source="predicted"))
        written += 1 + sync_members(db, g)
    return written


# ----------------------------------------------------------------------------- --import-records


def import_records(path: Path, db: TuningDatabase, tasks: list[TuningTask], target: TargetDescription) -> tuple[int, int]:
    """Validate and append records measured elsewhere; returns (added, already present).

    Every line must parse, carry this target's key and a workload key of this model: a record
    for another target, another model, or an older template/TVM is refused (TuningLogError)."""
    if not path.is_file():
        raise TuningLogError(f"records file {path} does not exist")
    tkey = target_key(target)
    keys = {t.workload.key for t in tasks}
    text = path.read_text()
    incoming: list[TuningRecord] = []
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = TuningRecord.from_json(line)
        except (ValueError, TypeError, KeyError) as err:
            raise TuningLogError(f"{path}: line {number} is not a tuning record (truncated file?): {err}") from None
        if record.target_key != tkey:
            raise TuningLogError(f"{path}: line {number} was tuned for target key {record.target_key}, "
                                 f"not {target.name} ({tkey}); re-tune for this target")
        if record.workload_key not in keys:
            raise TuningLogError(f"{path}: line {number} has workload {record.workload_key}, which is not a "
                                 f"workload of this model on {target.name} (other model, template or TVM version)")
        incoming.append(record)
    present = {(r.workload_key, r.bucket, r.source, *_identity(r)) for r in db.records()}
    added = 0
    for r in incoming:
        k = (r.workload_key, r.bucket, r.source, *_identity(r))
        if k in present:
            continue
        db.add(r)
        present.add(k)
        added += 1
    return added, len(incoming) - added
