"""GPU template for small static batches (2-8 rows): dlight's ``gpu.LowBatchGEMV``.

Knob: ``max_threads``, the threads-per-block cap the rule sizes its thread tiles from.
Declines on CPU targets.
"""

from __future__ import annotations

from typing import Any

from schedules._gpu import DlightTemplate


class GpuLowBatchGemv(DlightTemplate):
    name = "gpu_low_batch_gemv"

    def make_rule(self, config: dict[str, Any]) -> Any:
        from tvm.s_tir import dlight as dl

        return dl.gpu.LowBatchGEMV()


TEMPLATE = GpuLowBatchGemv()
