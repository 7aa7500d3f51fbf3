"""The compile pipeline's schedule phase: give every unscheduled PrimFunc a template schedule.

For each PrimFunc without ``tirx.is_scheduled``: the first matching template (by priority),
configured by the best tuning record for (workload key, target key) when one exists, else by the
template default. A record that no longer applies (the template rejects it) falls back to the
default with a warning; a default that fails falls back to the next template, so the phase
never leaves a function worse than unscheduled-but-correct.
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
            best = records.best(workload.key, workload.target_key, bucket=m_hint)
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
