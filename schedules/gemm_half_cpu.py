"""CPU GEMM / GEMV template for half-precision weights (``--quantization f16 | bf16``) stored
as compile-time packed panels ``Wp[N / nb, K, nb]`` (``passes/_half_panels.py``).

The function is a matmul whose B operand is a half array widened in the product:
``C[m, n] += x[m, k] * widen(Wp[n // nb, k, n % nb])``. The schedule is the fp32 packed GEMM's
(``_matmul.schedule_register_tiled``): an mr x nr tile of fp32 accumulators in registers, k over
the whole reduction; per k, nr contiguous half weights are loaded as one 2-byte-per-lane vector
and widened in registers (bf16: zero-extend + shift left 16, ``vpmovzxwd`` + ``vpslld``; f16:
``vcvtph2ps``) before the FMAs against broadcast x. Half the weight bytes of the fp32 GEMM, and no
per-call dequantize (the old prefill path wrote 4 N K bytes of fp32 panels per linear per call).

Two regimes of one space: symbolic or large M (prefill: tall mr, (panel, M tile) pairs in
parallel) and static M <= 8 (decode GEMV: mr = M, narrow nc so that N / nc tasks split evenly
over the cores). Knobs: mr, nr, nc, parallel, pack_x, k_unroll.
"""

from __future__ import annotations

from typing import Any

from perfx_compiler.schedule_template import (
    ScheduleConfigError,
    ScheduleTemplate,
    Workload,
    is_cpu_target,
    vector_lanes,
)
from perfx_compiler.targets import TargetDescription
from schedules._matmul import analyze_matmul, vector_registers
from schedules.gemm_cpu import (
    apply_register_tiled,
    matmul_workload,
    packed_prefill_default,
    packed_tiles,
    panel_vectors,
    tile_is_valid,
)

GEMV_MAX_M = 8


class GemmHalfCPU(ScheduleTemplate):
    name = "gemm_half_cpu"
    knobs = ("mr", "nr", "nc", "parallel", "pack_x", "k_unroll")
    version = 1

    def match(self, func: Any, target: TargetDescription) -> Workload | None:
        if not is_cpu_target(target):
            return None
        facts = analyze_matmul(func, allow_half=True)
        if facts is None or not facts.b_half or facts.layout != "P":
            return None
        if facts.M is None and "u" in facts.roles[facts.roles.index("m"):]:
            return None  # x [batch, 1, K] (batched decode): pad_einsum cannot pad M there; fallback
        lanes = vector_lanes(target)
        if facts.N % lanes or facts.nb % lanes:
            return None
        return matmul_workload(self.name, func, target, facts, self.version)

    def space(self, workload: Workload, target: TargetDescription) -> dict[str, list]:
        lanes = vector_lanes(target)
        N, nb = workload.dims["N"], int(workload.info["nb"])
        nrs, ncs = packed_tiles(N, nb, lanes, (1, 2, 3, 4, 6, 8))
        M = workload.dims["M"]
        mrs = [M] if 0 < M <= GEMV_MAX_M else [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14]
        return {"mr": mrs, "nr": nrs, "nc": ncs, "parallel": ["n", "nm"], "pack_x": [True, False], "k_unroll": [1, 2, 4]}

    def is_valid(self, workload: Workload, config: dict[str, Any], target: TargetDescription) -> bool:
        M = workload.dims["M"]
        if 0 < M <= GEMV_MAX_M and int(config.get("mr", 0)) != M:
            return False  # static rows: the tile is all of them (padding would only add work)
        # a micro-tile lies inside one compile-time panel; the B vectors are the widened halves
        return tile_is_valid(workload.dims, config, int(workload.info["nb"]), target)

    def builtin_default(self, workload: Workload, target: TargetDescription) -> dict[str, Any]:
        lanes = vector_lanes(target)
        N, M = workload.dims["N"], workload.dims["M"]
        nb = int(workload.info["nb"])
        regs = vector_registers(target)
        cores = max(1, target.cores or 1)
        if 0 < M <= GEMV_MAX_M:
            # Decode: every weight byte is read once, so the only concern is splitting N evenly
            # over the cores: the widest nc (a divisor of nb) leaving >= 4 tasks per core.
            nr = panel_vectors(nb, lanes, regs, M) * lanes
            nc = nr
            for c in sorted({c for c in range(nr, nb + 1, nr) if nb % c == 0}, reverse=True):
                if N // c >= 4 * cores:
                    nc = c
                    break
            return {"mr": M, "nr": nr, "nc": nc, "parallel": "n", "pack_x": True, "k_unroll": 1}
        return packed_prefill_default(nb, lanes, regs)  # prefill: gemm_cpu's over packed panels

    def apply(self, func: Any, workload: Workload, config: dict[str, Any], target: TargetDescription) -> Any:
        facts = analyze_matmul(func, allow_half=True)
        if facts is None or not facts.b_half:
            raise ScheduleConfigError("function is no longer a half-weight matmul this template understands")
        if not self.is_valid(workload, config, target):
            raise ScheduleConfigError(f"invalid gemm_half_cpu config {config} for {workload.dims}")
        return apply_register_tiled(func, facts, config, target, pack_b=False)


TEMPLATE = GemmHalfCPU()
