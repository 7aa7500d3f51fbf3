"""The compile pipeline's schedule phase: give every unscheduled PrimFunc a template schedule.

For each PrimFunc without ``tirx.is_scheduled``: the first matching template (by priority),
configured by the best tuning record for (workload key, target key) when one exists, else by the
template default. A record that no longer applies (the template rejects it) falls back to the
default with a warning; a default that fails falls back to the next template, so the phase
never leaves a function worse than unscheduled-but-correct.

Per-bucket dispatch: a symbolic-M matmul (prefill) tuned on several M buckets whose best
configurations differ is scheduled once per distinct configuration, and the variants are joined
in one PrimFunc under ``if M < sqrt(b_i * b_i+1)`` tests on its run-time M (thresholds halfway
between buckets on a log scale). Other symbolic functions use the record of the bucket nearest
``TYPICAL_M``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from perfx_compiler.schedule_template import registered_templates
from perfx_compiler.targets import TargetDescription

if TYPE_CHECKING:
    import tvm

    from perfx_compiler.tune.records import TuningDatabase

log = logging.getLogger(__name__)
SCHEDULED_ATTR = "tirx.is_scheduled"
TYPICAL_M = 64  # prompt length the single-config symbolic functions are configured for


def _is_scheduled(func: Any) -> bool:
    attrs = func.attrs
    return attrs is not None and SCHEDULED_ATTR in attrs and bool(attrs[SCHEDULED_ATTR])


def schedule_func(
    func: Any,
    target: TargetDescription,
    records: TuningDatabase | None = None,
    m_hint: int | None = None,
) -> tuple[Any, str | None, dict[str, Any] | None]:
    """Schedule one PrimFunc; returns (func, template name or None, config used)."""
    for template in registered_templates():
        workload = template.match(func, target)
        if workload is None:
            continue
        candidates: list[tuple[str, dict[str, Any]]] = []
        if records is not None:
            hint = m_hint if m_hint is not None else (TYPICAL_M if workload.symbolic else None)
            best = records.best(workload.key, workload.target_key, bucket=hint, nearest=True)
            if best is not None and best.template == template.name:
                candidates.append(("record", best.config))
        candidates.append(("default", template.default_config(workload, target)))
        for source, config in candidates:
            try:
                scheduled = template.apply(func, workload, config, target)
            except Exception as err:  # noqa: BLE001 - any template failure falls through
                log.warning("%s (%s config %s) failed: %s", template.name, source, config, err)
                continue
            return scheduled.with_attr(SCHEDULED_ATTR, True), template.name, config
    return func, None, None


def apply_schedules(
    mod: tvm.IRModule, target: TargetDescription, records: TuningDatabase | None = None
) -> tvm.IRModule:
    """Schedule every PrimFunc of ``mod`` not already scheduled; Relax functions are untouched."""
    from tvm import tirx

    updates = {}
    for gvar, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc) or _is_scheduled(func):
            continue
        scheduled = _dispatch_by_bucket(func, target, records) if records is not None else None
        if scheduled is not None:
            updates[gvar] = scheduled
            continue
        scheduled, name, config = schedule_func(func, target, records)
        if name is not None:
            log.debug("scheduled %s with %s %s", gvar.name_hint, name, config)
            updates[gvar] = scheduled
    if not updates:
        return mod
    mod = mod.clone()  # the caller's module stays as it was
    for gvar, func in updates.items():
        mod.update_func(gvar, func)
    return mod


def _template_names() -> list[str]:
    return [t.name for t in registered_templates()]


def _bucket_configs(template: Any, workload: Any, records: TuningDatabase) -> list[tuple[int, dict[str, Any]]]:
    """(bucket, best config) per measured bucket, ascending; neighbours with equal configs merged."""
    out: list[tuple[int, dict[str, Any]]] = []
    for bucket in records.buckets(workload.key, workload.target_key):
        best = records.best(workload.key, workload.target_key, bucket=bucket)
        if best is None or best.template != template.name:
            continue
        if out and out[-1][1] == best.config:
            continue
        out.append((bucket, best.config))
    return out


def _dispatch_by_bucket(func: Any, target: TargetDescription, records: TuningDatabase) -> Any | None:
    """One variant per distinct per-bucket configuration of a symbolic-M matmul, joined by tests
    on M; None when not applicable (static M, one config, not a matmul, a variant fails)."""
    from tvm import s_tir, tirx
    from tvm.s_tir.stmt import SBlock, SBlockRealize

    from perfx_compiler.schedule_template import find_template
    from schedules._matmul import analyze_matmul

    found = find_template(func, target)
    if found is None or found[1].symbolic is None:
        return None
    template, workload = found
    chosen = _bucket_configs(template, workload, records)
    if len(chosen) < 2:
        return None
    facts = analyze_matmul(func, allow_half=True)  # half-weight GEMMs dispatch per bucket too
    if facts is None or facts.M is not None:
        return None
    sch = s_tir.Schedule(func)
    blk = sch.get(sch.get_sblock(facts.block))
    m_extent = blk.iter_vars[facts.roles.index("m")].dom.extent
    variants = []
    for bucket, config in chosen:
        try:
            variants.append((bucket, template.apply(func, workload, config, target)))
        except Exception as err:  # noqa: BLE001 - fall back to the single-config path
            log.warning("%s bucket %d config %s failed: %s", template.name, bucket, config, err)
            return None
    roots = [v.body for _, v in variants]
    if not all(isinstance(r, SBlockRealize) for r in roots) or any(
        not v.params[i].same_as(func.params[i]) for _, v in variants for i in range(len(func.params))
    ):
        return None  # the variants must share the function's parameters to share one body
    body = roots[-1].block.body
    for i in range(len(variants) - 2, -1, -1):
        threshold = int(round((variants[i][0] * variants[i + 1][0]) ** 0.5))
        cond = m_extent < tirx.const(max(2, threshold), str(m_extent.ty) if hasattr(m_extent, "ty") else "int64")
        body = tirx.IfThenElse(cond, roots[i].block.body, body)
    allocs = [buf for r in roots for buf in r.block.alloc_buffers]
    root = roots[0].block
    merged = SBlockRealize([], True, SBlock([], [], [], root.name_hint, body, alloc_buffers=allocs))
    log.debug("%s: per-bucket dispatch over %s", workload.key, [b for b, _ in chosen])
    return variants[0][1].with_body(merged).with_attr(SCHEDULED_ATTR, True)
