"""GPU template for decode linear layers (one row times a weight matrix): dlight's ``gpu.GEMV`` (threads split the reduction, results combined in shared memory or by warp shuffles).

Knob: ``max_threads``, the threads-per-block cap the rule sizes its thread tiles from.
Declines on CPU targets.
"""

from __future__ import annotations

from typing import Any

from schedules._gpu import DlightTemplate


class GpuGemv(DlightTemplate):
    name = "gpu_gemv"

    def make_rule(self, config: dict[str, Any]) -> Any:
        from tvm.s_tir import dlight as dl

        return dl.gpu.GEMV()


TEMPLATE = GpuGemv()
