"""GPU template for everything else (elementwise, gathers, slices): dlight's ``gpu.Fallback`` (inline, then bind the spatial loops to blocks x threads); it must take every function the others leave, because an unbound function would run on the host.

Knob: ``max_threads``, the threads-per-block cap the rule sizes its thread tiles from.
Declines on CPU targets.
"""

from __future__ import annotations

from typing import Any

from schedules._gpu import DlightTemplate


class GpuFallback(DlightTemplate):
    name = "gpu_fallback"

    def make_rule(self, config: dict[str, Any]) -> Any:
        from tvm.s_tir import dlight as dl

        return dl.gpu.Fallback()


TEMPLATE = GpuFallback()
