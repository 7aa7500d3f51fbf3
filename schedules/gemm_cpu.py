"""CPU GEMM template: symbolic or large M (prefill) linear layers.

Register tiling (mr rows x nr columns of accumulators, nr a multiple of the SIMD width), an
nc-wide panel of the weights kept in L2 across all M tiles, x strips copied (and zero-padded for
the M tail) next to their use, parallel over N panels or over (N panel, M tile) pairs. Knobs:
mr, nr, nc, parallel, pack_x, pack_b. Small M (<= 16) and large M use different regions of the
same space (narrow mr / wide nc versus tall mr).
"""

from __future__ import annotations

from typing import Any

from perfx_compiler.schedule_template import (
    ScheduleConfigError,
    ScheduleTemplate,
    Workload,
    is_cpu_target,
    make_workload,
    vector_lanes,
)
from perfx_compiler.targets import TargetDescription
from schedules._fastmath import fast_sigmoid
from schedules._matmul import analyze_matmul, schedule_register_tiled

PRIORITY = 20
GEMV_MAX_M = 8  # static M up to this goes to the GEMV template


class GemmCPU(ScheduleTemplate):
    name = "gemm_cpu"

    def match(self, func: Any, target: TargetDescription) -> Workload | None:
        if not is_cpu_target(target):
            return None
        facts = analyze_matmul(func)
        if facts is None or facts.N % vector_lanes(target):
            return None
        if facts.M is not None and facts.M <= GEMV_MAX_M:
            return None
        return make_workload(
            self.name,
            func,
            target,
            {"M": facts.M or 0, "N": facts.N, "K": facts.K},
            symbolic="M" if facts.M is None else None,
            info=facts.info(),
            version=self.version,
        )

    def space(self, workload: Workload, target: TargetDescription) -> dict[str, list]:
        lanes = vector_lanes(target)
        N = workload.dims["N"]
        nrs = [v * lanes for v in (1, 2, 3, 4) if N % (v * lanes) == 0]
        ncs = sorted({nr * f for nr in nrs for f in (1, 2, 3, 4, 6, 8, 12, 16) if N % (nr * f) == 0})
        return {
            "mr": [1, 2, 3, 4, 6, 8],
            "nr": nrs,
            "nc": ncs,
            "parallel": ["n", "nm"],
            "pack_x": [True, False],
            "pack_b": [False, True],
        }

    def is_valid(self, workload: Workload, config: dict[str, Any], target: TargetDescription) -> bool:
        lanes = vector_lanes(target)
        N = workload.dims["N"]
        mr, nr, nc = config.get("mr", 0), config.get("nr", 0), config.get("nc", 0)
        if not (mr >= 1 and nr >= lanes and nr % lanes == 0 and nc % nr == 0 and N % nc == 0):
            return False
        # Accumulators + one B vector per column + a broadcast must fit in the register file.
        regs = 32 if lanes >= 16 else 16
        return mr * (nr // lanes) + nr // lanes + 1 <= regs

    def builtin_default(self, workload: Workload, target: TargetDescription) -> dict[str, Any]:
        lanes = vector_lanes(target)
        N = workload.dims["N"]
        cores = max(1, target.cores or 1)
        regs = 32 if lanes >= 16 else 16
        # Widest micro-tile that fits the register file: 4x4 zmm (AVX-512) or 3x2 ymm (AVX2).
        nv = 4 if lanes >= 16 else 2
        while nv > 1 and N % (nv * lanes):
            nv -= 1
        nr = nv * lanes
        mr = max(1, min(8, (regs - nv - 1) // nv))
        if regs == 32 and nv == 4:
            mr = 4
        # Panel width: a few micro-tiles, while leaving >= 2 panels per core to balance the cores.
        nc = nr
        for f in (4, 3, 2):
            if N % (nr * f) == 0 and N // (nr * f) >= 2 * cores:
                nc = nr * f
                break
        parallel = "n" if N // nc >= 2 * cores else "nm"
        return {"mr": mr, "nr": nr, "nc": nc, "parallel": parallel, "pack_x": True, "pack_b": False}

    def apply(
        self, func: Any, workload: Workload, config: dict[str, Any], target: TargetDescription
    ) -> Any:
        facts = analyze_matmul(func)
        if facts is None:
            raise ScheduleConfigError("function is no longer a matmul this template understands")
        if not self.is_valid(workload, config, target):
            raise ScheduleConfigError(f"invalid gemm_cpu config {config} for {workload.dims}")
        if config.get("fast_sigmoid", True):
            func = fast_sigmoid(func)  # vector polynomial instead of per-lane libm exp
        return schedule_register_tiled(
            func,
            facts,
            mr=int(config["mr"]),
            nr=int(config["nr"]),
            nc=int(config["nc"]),
            lanes=vector_lanes(target),
            parallel=str(config["parallel"]),
            pack_x=bool(config.get("pack_x", True)),
            pack_b=bool(config.get("pack_b", False)),
        )


TEMPLATE = GemmCPU()
