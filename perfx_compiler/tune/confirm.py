"""Confirmation stage: at the end of a workload's search, re-time its best few candidates and the
template default in alternation and record which one really is fastest.

The search ranks each candidate by its fastest single call of one measurement. On a shared
2-core machine that picks noise winners: one lucky measurement beats a config that is faster
most of the time (cold-tuned VNNI GEMV records made SmolLM2 decode slower than the template
defaults in 6 of 6 alternated rounds). Here the ``CONFIRM_TOP_K`` fastest measured configs and the
default are timed in ``CONFIRM_ROUNDS`` interleaved rounds (``LocalMeasurer.time_rounds``: same
cold / warm mode as the search, each round's value a median of calls); each candidate's median
over rounds decides, ties going to the default. The result is appended as a confirmation record
(``TuningRecord.confirm``: every candidate's per-round seconds and median), which
``TuningDatabase.best`` prefers to the raw fastest record; when the default wins, the default is
what gets built. A confirmation whose candidates still cover the current top-k and the default is
current: a resumed session does not redo it.
"""

from __future__ import annotations

import logging
import math
import statistics
from typing import Any, Protocol

from perfx_compiler.targets import TargetDescription
from perfx_compiler.tune.measure import MeasureResult
from perfx_compiler.tune.records import TuningDatabase, TuningRecord, config_key
from perfx_compiler.tune.workloads import TuningTask

log = logging.getLogger(__name__)
CONFIRM_TOP_K = 3
CONFIRM_ROUNDS = 5


class RoundTimer(Protocol):
    def time_rounds(
        self,
        func: Any,
        template_name: str,
        workload_key: str,
        configs: list[dict[str, Any]],
        m_value: int,
        rounds: int,
    ) -> list[MeasureResult]: ...


def confirm_candidates(
    db: TuningDatabase, task: TuningTask, target: TargetDescription, k: int = CONFIRM_TOP_K
) -> list[dict[str, Any]]:
    """The ``k`` fastest measured configs of the task (raw records) plus the default when it was
    measured successfully; the default first. Fewer than two means nothing to confirm."""
    wl = task.workload
    fastest: dict[str, TuningRecord] = {}
    for r in db.for_workload(wl.key, wl.target_key, task.bucket):
        if r.ok and not r.confirmed and r.source != "predicted" and r.bucket == task.bucket:
            key = config_key(r.config)
            if key not in fastest or r.mean_s < fastest[key].mean_s:
                fastest[key] = r
    default = task.template.default_config(wl, target)
    top = sorted(fastest.values(), key=lambda r: r.mean_s)[:k]
    configs = [dict(r.config) for r in top]
    if config_key(default) in fastest and all(config_key(c) != config_key(default) for c in configs):
        configs.append(dict(default))
    configs.sort(key=lambda c: config_key(c) != config_key(default))
    return configs


def is_confirmed(db: TuningDatabase, task: TuningTask, target: TargetDescription, k: int = CONFIRM_TOP_K) -> bool:
    """Whether the latest confirmation of the task covers its current candidates (done; resume
    skips it). New faster records since (a rerun with more trials) make it out of date."""
    wl = task.workload
    done = db.confirmation(wl.key, wl.target_key, task.bucket)
    if done is None:
        return False
    compared = {config_key(c["config"]) for c in done.confirm.get("candidates", []) if isinstance(c, dict)}
    return {config_key(c) for c in confirm_candidates(db, task, target, k)} <= compared


def confirm_task(
    task: TuningTask,
    target: TargetDescription,
    db: TuningDatabase,
    timer: RoundTimer,
    k: int = CONFIRM_TOP_K,
    rounds: int = CONFIRM_ROUNDS,
) -> TuningRecord | None:
    """Re-time the task's top ``k`` and default in alternation; append and return the
    confirmation record (the latest one when it is already current), or None when there are
    fewer than two candidates or none survives the re-timing."""
    wl = task.workload
    if is_confirmed(db, task, target, k):
        return db.confirmation(wl.key, wl.target_key, task.bucket)
    configs = confirm_candidates(db, task, target, k)
    if len(configs) < 2:
        return None
    default = config_key(task.template.default_config(wl, target))
    results = timer.time_rounds(task.func, wl.template, wl.key, configs, task.m_value, rounds)
    raw = {config_key(r.config): r.mean_s for r in db.for_workload(wl.key, wl.target_key, task.bucket)
           if r.ok and not r.confirmed and r.bucket == task.bucket}
    entries = []
    for res in results:
        samples = [float(s) for s in res.extra.get("rounds", [])]
        ok = res.ok and math.isfinite(res.mean_s) and bool(samples)
        entries.append({
            "config": res.config,
            "default": config_key(res.config) == default,
            "median_s": statistics.median(samples) if ok else None,
            "rounds_s": samples,
            "search_min_s": raw.get(config_key(res.config)),
            "error": None if ok else (res.error or "no rounds"),
        })
    valid = [e for e in entries if e["median_s"] is not None]
    if not valid:
        log.warning("confirmation of %s@M=%s: no candidate could be re-timed", wl.template, task.m_value)
        return None
    # Lowest median wins; on a tie the default (no reason to leave it), then the search's order.
    win = min(valid, key=lambda e: (e["median_s"], not e["default"]))
    default_entry = next((e for e in valid if e["default"]), None)
    spread = statistics.pstdev(win["rounds_s"]) if len(win["rounds_s"]) > 1 else 0.0
    record = TuningRecord(
        workload_key=wl.key, target_key=wl.target_key, template=wl.template, config=dict(win["config"]),
        mean_s=win["median_s"], std_s=spread, bucket=task.bucket, dims=dict(wl.dims),
        confirm={
            "rounds": rounds,
            "k": k,
            "winner_is_default": bool(win["default"]),
            "default_median_s": None if default_entry is None else default_entry["median_s"],
            "candidates": entries,
        },
    )
    cold = any(r.extra.get("cold_cache") for r in results)
    record.versions["timing"] = "cold" if cold else "warm"
    db.add(record)
    return record
