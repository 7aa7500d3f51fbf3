"""Fallback for CPU functions no other template takes: keep them correct, add safe parallelism.

For each top-level block, the outermost loop is made parallel when it is a spatial loop of that
block with more than one iteration; anything the schedule rejects is left as it was.
"""

from __future__ import annotations

from typing import Any

from perfx_compiler.schedule_template import (
    ScheduleTemplate,
    Workload,
    is_cpu_target,
    make_workload,
)
from perfx_compiler.targets import TargetDescription


class FallbackCPU(ScheduleTemplate):
    name = "fallback_cpu"

    def match(self, func: Any, target: TargetDescription) -> Workload | None:
        if not is_cpu_target(target):
            return None
        return make_workload(self.name, func, target, {}, version=self.version)

    def space(self, workload: Workload, target: TargetDescription) -> dict[str, list]:
        return {}  # nothing to tune

    def builtin_default(self, workload: Workload, target: TargetDescription) -> dict[str, Any]:
        return {"parallel": True}

    def apply(
        self, func: Any, workload: Workload, config: dict[str, Any], target: TargetDescription
    ) -> Any:
        from tvm import s_tir

        if not config.get("parallel", True):
            return func
        try:
            sch = s_tir.Schedule(func)
            blocks = sch.get_child_blocks(sch.get_sblock("root"))
        except Exception:  # noqa: BLE001 - not a block-structured function: leave it alone
            return func
        for blk in blocks:
            try:
                loops = sch.get_loops(blk)
                if not loops:
                    continue
                first = sch.get(loops[0])
                extent = getattr(first.extent, "value", None)
                if extent == 1:
                    continue
                trial = s_tir.Schedule(sch.mod)  # try on a copy: a rejected step leaves no trace
                tblk = trial.get_sblock(sch.get(blk).name_hint)
                trial.parallel(trial.get_loops(tblk)[0])
                sch = trial
            except Exception:  # noqa: BLE001, S112 - reduction/opaque loops cannot be parallel: skip
                continue
        return sch.mod["main"]


TEMPLATE = FallbackCPU()
