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

from collections.abc import Iterable
from typing import Any

from perfx_compiler.kernels.fastmath import fast_activations
from perfx_compiler.schedule_template import (
    ScheduleConfigError,
    ScheduleTemplate,
    Workload,
    is_cpu_target,
    make_workload,
    vector_lanes,
)
from perfx_compiler.targets import TargetDescription
from schedules._matmul import analyze_matmul, schedule_register_tiled, vector_registers

GEMV_MAX_M = 8  # static M up to this goes to the GEMV template


# -- shared with gemm_half_cpu (the same register tiling over half panels) -------------------------
def packed_tiles(N: int, nb: int, lanes: int, factors: Iterable[int]) -> tuple[list[int], list[int]]:
    """(nr, nc) candidates that fit nb-wide packed panels: nr divides a panel; nc is one of those that
    divides it too, or ``f`` whole panels for each of ``factors`` that divides the panel count."""
    nrs = [v * lanes for v in range(1, nb // lanes + 1) if nb % (v * lanes) == 0]
    ncs = sorted({c for c in nrs if nb % c == 0} | {nb * f for f in factors if (N // nb) % f == 0})
    return nrs, ncs


def panel_vectors(nb: int, lanes: int, regs: int, rows: int) -> int:
    """Vectors per micro-tile row: the widest divisor of the nb-wide panel whose accumulators for
    ``rows`` rows, weight vectors and a broadcast x fit the register file."""
    nv = nb // lanes
    while nv > 1 and (nb % (nv * lanes) or rows * nv + nv + 1 > regs):
        nv -= 1
    return nv


def packed_prefill_default(nb: int, lanes: int, regs: int) -> dict[str, Any]:
    """Prefill over packed panels: the whole panel as the micro-tile (one contiguous weight stream per
    k), as many rows as the registers hold (6 x 4 zmm on AVX-512: 24 accumulators), and (panel, M tile)
    pairs in parallel so that 9 panels still split evenly over the cores."""
    nv = panel_vectors(nb, lanes, regs, 2)
    mr = max(1, min(8, (regs - nv - 1) // nv))
    return {"mr": mr, "nr": nv * lanes, "nc": nb, "parallel": "nm", "pack_x": True, "k_unroll": 1}


def tile_is_valid(dims: dict[str, int], config: dict[str, Any], nb: int, target: TargetDescription) -> bool:
    """The register-tile checks both GEMM templates make: nr whole vectors, nc whole micro-tiles
    dividing N, k_unroll dividing K, a micro-tile inside one nb-wide panel (when packed, nb > 0), and
    accumulators + one B vector per column + a broadcast within the register file."""
    lanes = vector_lanes(target)
    mr, nr, nc = int(config.get("mr", 0)), int(config.get("nr", 0)), int(config.get("nc", 0))
    if not (mr >= 1 and nr >= lanes and nr % lanes == 0 and nc >= nr and nc % nr == 0 and dims["N"] % nc == 0):
        return False
    ku = int(config.get("k_unroll", 1))
    if ku < 1 or dims["K"] % ku:
        return False
    if nb and (nb % nr or (nc % nb and nb % nc)):
        return False  # the panels were packed at compile time with width nb
    return mr * (nr // lanes) + nr // lanes + 1 <= vector_registers(target)


def matmul_workload(name: str, func: Any, target: TargetDescription, facts: Any, version: int) -> Workload:
    """The workload of a matmul ``analyze_matmul`` understood (M symbolic when it is)."""
    return make_workload(
        name,
        func,
        target,
        {"M": facts.M or 0, "N": facts.N, "K": facts.K},
        symbolic="M" if facts.M is None else None,
        info=facts.info(),
        version=version,
    )


def apply_register_tiled(func: Any, facts: Any, config: dict[str, Any], target: TargetDescription,
                         pack_b: bool) -> Any:
    """``schedule_register_tiled`` with a config's knobs."""
    return schedule_register_tiled(
        func,
        facts,
        mr=int(config["mr"]),
        nr=int(config["nr"]),
        nc=int(config["nc"]),
        lanes=vector_lanes(target),
        parallel=str(config["parallel"]),
        pack_x=bool(config.get("pack_x", True)),
        pack_b=pack_b,
        k_unroll=int(config.get("k_unroll", 1)),
    )


class GemmCPU(ScheduleTemplate):
    name = "gemm_cpu"
    knobs = ("mr", "nr", "nc", "parallel", "pack_x", "pack_b", "k_unroll")
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
        return matmul_workload(self.name, func, target, facts, self.version)

    def space(self, workload: Workload, target: TargetDescription) -> dict[str, list]:
        lanes = vector_lanes(target)
        N = workload.dims["N"]
        nb = int(workload.info.get("nb", 0))
        if nb:
            nrs, ncs = packed_tiles(N, nb, lanes, range(1, min(8, N // nb) + 1))
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
        nb = int(workload.info.get("nb", 0))
        if nb and config.get("pack_b", False):
            return False  # the panels were packed at compile time with width nb
        return tile_is_valid(workload.dims, config, nb, target)

    def builtin_default(self, workload: Workload, target: TargetDescription) -> dict[str, Any]:
        lanes = vector_lanes(target)
        N = workload.dims["N"]
        cores = max(1, target.cores or 1)
        regs = vector_registers(target)
        nb = int(workload.info.get("nb", 0))
        if nb:
            return packed_prefill_default(nb, lanes, regs)
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
        if config.get("fast_activations", True):
            func = fast_activations(func)  # vector polynomials instead of per-lane libm exp / tanh
        return apply_register_tiled(func, facts, config, target, bool(config.get("pack_b", False)))


TEMPLATE = GemmCPU()
