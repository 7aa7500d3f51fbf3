"""Shared machinery of the GPU templates: TVM dlight GPU rules wrapped as PerfX templates.

Each ``gpu_*.py`` template wraps one dlight rule. ``match`` runs the rule once with the target's
defaults and accepts the function when the rule produces a schedule (cached for ``apply``); the
knobs every GPU template has are

* ``max_threads``: the threads-per-block cap the rule sees (the rule sizes its thread tiles and
  grid from it), a power of two up to the target's ``max_threads_per_block``;

and templates add their rule's own knobs (the matmul tile configuration). The templates decline
on CPU targets, so the CPU templates keep those.
"""

from __future__ import annotations

from typing import Any

from perfx_compiler.kernels.tir_queries import has_device_launch
from perfx_compiler.schedule_template import ScheduleConfigError, ScheduleTemplate, Workload, make_workload
from perfx_compiler.targets import TargetDescription

GPU_KINDS = ("cuda", "rocm", "opencl", "vulkan", "webgpu", "metal")


def is_gpu_target(target: TargetDescription) -> bool:
    return target.family == "gpu" and target.tvm_target.get("kind") in GPU_KINDS


def max_threads(target: TargetDescription) -> int:
    tt = target.tvm_target
    return int(target.max_threads_per_block or tt.get("max_num_threads") or tt.get("max_threads_per_block") or 256)


def tvm_target_with_threads(target: TargetDescription, threads: int | None):  # -> tvm.target.Target
    """The target's TVM target with the thread cap replaced by ``threads``."""
    import tvm

    tt = dict(target.tvm_target)
    if threads is not None:
        tt["max_num_threads"] = int(threads)
        if "max_threads_per_block" in tt or tt.get("kind") in ("opencl", "rocm"):
            tt["max_threads_per_block"] = int(threads)
    if target.host is not None:
        return tvm.target.Target(tt, host=target.host)
    return tvm.target.Target(tt)


class DlightTemplate(ScheduleTemplate):
    """A template around one dlight GPU rule; subclasses set ``name`` and ``make_rule``."""

    knobs = ("max_threads",)

    def make_rule(self, config: dict[str, Any]) -> Any:
        raise NotImplementedError

    def rule_space(self, workload: Workload, target: TargetDescription) -> dict[str, list]:
        return {}

    def rule_default(self, workload: Workload, target: TargetDescription) -> dict[str, Any]:
        return {}

    def _run(self, func: Any, target: TargetDescription, config: dict[str, Any]) -> Any:
        rule = self.make_rule(config)
        tgt = tvm_target_with_threads(target, config.get("max_threads"))
        with tgt:
            sch = rule.apply(func, tgt, False)
        if isinstance(sch, list):
            sch = sch[0] if sch else None
        return None if sch is None else sch.mod["main"]

    def match(self, func: Any, target: TargetDescription) -> Workload | None:
        if not is_gpu_target(target):
            return None
        try:
            scheduled = self._run(func, target, {"max_threads": max_threads(target)})
        except Exception:  # noqa: BLE001 - the rule does not apply to this function
            return None
        if scheduled is None or not has_device_launch(scheduled):
            return None
        return make_workload(self.name, func, target, {}, version=self.version)

    def space(self, workload: Workload, target: TargetDescription) -> dict[str, list]:
        top = max_threads(target)
        threads = [t for t in (32, 64, 128, 256, 512, 1024) if t <= top]
        return {"max_threads": threads, **self.rule_space(workload, target)}

    def builtin_default(self, workload: Workload, target: TargetDescription) -> dict[str, Any]:
        return {"max_threads": max_threads(target), **self.rule_default(workload, target)}

    def is_valid(self, workload: Workload, config: dict[str, Any], target: TargetDescription) -> bool:
        return 1 <= int(config.get("max_threads", 1)) <= max_threads(target)

    def apply(self, func: Any, workload: Workload, config: dict[str, Any], target: TargetDescription) -> Any:
        if not self.is_valid(workload, config, target):
            raise ScheduleConfigError(f"{self.name}: max_threads {config.get('max_threads')} out of range")
        scheduled = self._run(func, target, config)
        if scheduled is None or not has_device_launch(scheduled):
            raise ScheduleConfigError(f"{self.name}: the rule declined config {config}")
        return scheduled
