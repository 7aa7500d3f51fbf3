"""CPU GEMM template: symbolic or large M (prefill) linear layers.

Register tiling (mr rows x nr columns of accumulators, nr a multiple of the SIMD width), an
nc-wide panel of the weights kept in L2 across all M tiles, x strips copied (and zero-padded for
the M tail) next to their use, parallel over N panels or over (N panel, M tile) pairs. Knobs:
mr, nr, nc, parallel, pack_x, pack_b, k_unroll. Small M (<= 16) and large M use different
regions of the same space (narrow mr / wide nc versus tall mr).

Weights pre-packed by the weight_layout pass (layout "P", ``W[n // nb, k, n % nb]``) are read
as they are: nr must divide the panel width nb (taken from the function, so a record tuned for
another nb is another workload) and nc must be a multiple or a divisor of nb; a quantized
weight dequantized at prefill is written in those panels too (weight_layout). Weights in [N, K]
(one whose N is not a multiple of nb, a GPU-less fallback) are still packed per call ("NT").
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
from schedules._matmul import analyze_matmul, schedule_register_tiled, vector_registers

PRIORITY = 20
GEMV_MAX_M = 8  # static M up to this goes to the GEMV template


def _packed_tiles(N: int, nb: int, lanes: int) -> tuple[list[int], list[int]]:
    """(nr, nc) candidates that fit nb-wide packed panels."""
    nrs = [v * lanes for v in range(1, nb // lanes + 1) if nb % (v * lanes) == 0]
    ncs = sorted({c for c in nrs if nb % c == 0} | {nb * f for f in range(1, N // nb + 1) if (N // nb) % f == 0 and f <= 8})
    return nrs, ncs


class GemmCPU(ScheduleTemplate):
    name = "gemm_cpu"
    # v2: pre-packed weights (layout "P"), k_unroll, register budget per ISA (32 on AArch64/RVV)
    version = 2

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
        nb = int(workload.info.get("nb", 0))
        if nb:
            nrs, ncs = _packed_tiles(N, nb, lanes)
            return {
                "mr": [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14],
                "nr": nrs,
                "nc": ncs,
                "parallel": ["n", "nm"],
                "pack_x": [True, False],
                "k_unroll": [1, 2],
            }
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
        ku = config.get("k_unroll", 1)
        if ku < 1 or workload.dims["K"] % ku:
            return False
        nb = int(workload.info.get("nb", 0))
        if nb and (nb % nr or (nc % nb and nb % nc) or config.get("pack_b", False)):
            return False  # the panels were packed at compile time with width nb
        # Accumulators + one B vector per column + a broadcast must fit in the register file.
        return mr * (nr // lanes) + nr // lanes + 1 <= vector_registers(target)

    def builtin_default(self, workload: Workload, target: TargetDescription) -> dict[str, Any]:
        lanes = vector_lanes(target)
        N = workload.dims["N"]
        cores = max(1, target.cores or 1)
        regs = vector_registers(target)
        nb = int(workload.info.get("nb", 0))
        if nb:
            # The whole panel as the micro-tile (one contiguous weight stream per k), as many rows
            # as the registers hold (6 x 4 zmm on AVX-512: 24 accumulators), and (panel, M tile)
            # pairs in parallel so that 9 panels still split evenly over the cores.
            nv = nb // lanes
            while nv > 1 and (nb % (nv * lanes) or 2 * nv + nv + 1 > regs):
                nv -= 1
            mr = max(1, min(8, (regs - nv - 1) // nv))
            return {"mr": mr, "nr": nv * lanes, "nc": nb, "parallel": "nm", "pack_x": True, "k_unroll": 1}
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
            k_unroll=int(config.get("k_unroll", 1)),
        )


TEMPLATE = GemmCPU()
