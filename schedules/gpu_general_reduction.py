"""GPU template for fused normalizations (RMSNorm: mean of squares then scale): dlight's ``gpu.GeneralReduction``.

Knob: ``max_threads``, the threads-per-block cap the rule sizes its thread tiles from.
Declines on CPU targets.
"""

from __future__ import annotations

from typing import Any

from schedules._gpu import DlightTemplate


class GpuGeneralReduction(DlightTemplate):
    name = "gpu_general_reduction"

    def make_rule(self, config: dict[str, Any]) -> Any:
        from tvm.s_tir import dlight as dl

        return dl.gpu.GeneralReduction()


TEMPLATE = GpuGeneralReduction()
