"""GPU matmul template (prefill linear layers, M >= a few rows): dlight's ``gpu.Matmul``.

Knobs: ``max_threads`` plus the rule's tile configuration (thread block ``block_size_x/y``,
per-thread micro tile ``micro_size_x/y/k``, ``vector_size``, ``unroll``, ``use_shared``). The
default is the rule's own per-target configuration (Adreno: 32x4 threads of 8x2 outputs reading
global memory directly; CUDA/ROCm: 8x16 threads of 4x4 through shared memory). On CUDA sm_70+
with fp16/int8 inputs the rule switches to tensor cores by itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from perfx_compiler.schedule_template import Workload
from perfx_compiler.targets import TargetDescription
from schedules._gpu import DlightTemplate, tvm_target_with_threads

KNOBS = (
    "block_size_x",
    "block_size_y",
    "micro_size_x",
    "micro_size_y",
    "micro_size_k",
    "vector_size",
    "unroll",
    "use_shared",
)


def _matmul_rule(overrides: dict[str, Any]) -> Any:
    from tvm.s_tir import dlight as dl

    class TunedMatmul(dl.gpu.Matmul):
        def get_configs(self, target: Any) -> Any:
            base = super().get_configs(target)
            return dataclasses.replace(base, **{k: v for k, v in overrides.items() if k in KNOBS})

    return TunedMatmul()


class GpuMatmul(DlightTemplate):
    name = "gpu_matmul"
    knobs = ("max_threads", *KNOBS)

    def make_rule(self, config: dict[str, Any]) -> Any:
        return _matmul_rule(config)

    def rule_default(self, workload: Workload, target: TargetDescription) -> dict[str, Any]:
        from tvm.s_tir import dlight as dl

        base = dl.gpu.Matmul().get_configs(tvm_target_with_threads(target, None))
        return {k: getattr(base, k) for k in KNOBS}

    def rule_space(self, workload: Workload, target: TargetDescription) -> dict[str, list]:
        return {
            "block_size_x": [4, 8, 16, 32],
            "block_size_y": [4, 8, 16],
            "micro_size_x": [1, 2, 4, 8],
            "micro_size_y": [1, 2, 4, 8],
            "micro_size_k": [4, 8, 16],
            "vector_size": [1, 2, 4, 8],
            "unroll": [0, 16, 64, 256],
            "use_shared": [True, False],
        }

    def is_valid(self, workload: Workload, config: dict[str, Any], target: TargetDescription) -> bool:
        if not super().is_valid(workload, config, target):
            return False
        threads = config.get("block_size_x", 8) * config.get("block_size_y", 8)
        return threads <= int(config.get("max_threads", threads))


TEMPLATE = GpuMatmul()
