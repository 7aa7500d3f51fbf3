"""GPU template for row reductions with a simple epilogue (softmax-like): dlight's ``gpu.Reduction``.

Knob: ``max_threads``, the threads-per-block cap the rule sizes its thread tiles from.
Declines on CPU targets.
"""

from __future__ import annotations

from typing import Any

from schedules._gpu import DlightTemplate


class GpuReduction(DlightTemplate):
    name = "gpu_reduction"

    def make_rule(self, config: dict[str, Any]) -> Any:
        from tvm.s_tir import dlight as dl

        return dl.gpu.Reduction()


TEMPLATE = GpuReduction()
