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
    make_workload,
    vector_lanes,
)
from perfx_compiler.targets import TargetDescription
from schedules._matmul import analyze_matmul, schedule_register_tiled, vector_registers

PRIORITY = 15  # before gemm_cpu / gemv_cpu (which decline half B anyway)
GEMV_MAX_M = 8


class GemmHalfCPU(ScheduleTemplate):
    name = "gemm_half_cpu"
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
        N, nb = workload.dims["N"], int(workload.info["nb"])
        nrs = [v * lanes for v in range(1, nb // lanes + 1) if nb % (v * lanes) == 0]
        ncs = sorted({c for c in nrs if nb % c == 0} | {nb * f for f in (1, 2, 3, 4, 6, 8) if (N // nb) % f == 0})
        M = workload.dims["M"]
        mrs = [M] if 0 < M <= GEMV_MAX_M else [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14]
        return {"mr": mrs, "nr": nrs, "nc": ncs, "parallel": ["n", "nm"], "pack_x": [True, False], "k_unroll": [1, 2, 4]}

    def is_valid(self, workload: Workload, config: dict[str, Any], target: TargetDescription) -> bool:
        lanes = vector_lanes(target)
        N, K, M = workload.dims["N"], workload.dims["K"], workload.dims["M"]
        nb = int(workload.info["nb"])
        mr, nr, nc = int(config.get("mr", 0)), int(config.get("nr", 0)), int(config.get("nc", 0))
        if not (mr >= 1 and nr >= lanes and nr % lanes == 0 and nc >= nr and nc % nr == 0 and N % nc == 0):
            return False
        if nb % nr or (nc % nb and nb % nc):
            return False  # a micro-tile lies inside one compile-time panel
        if 0 < M <= GEMV_MAX_M and mr != M:
            return False  # static rows: the tile is all of them (padding would only add work)
        ku = int(config.get("k_unroll", 1))
        if ku < 1 or K % ku:
            return False
        # Accumulators + the widened B vectors + a broadcast x fit the register file.
        return mr * (nr // lanes) + nr // lanes + 1 <= vector_registers(target)

    def builtin_default(self, workload: Workload, target: TargetDescription) -> dict[str, Any]:
        lanes = vector_lanes(target)
        N, M = workload.dims["N"], workload.dims["M"]
        nb = int(workload.info["nb"])
        regs = vector_registers(target)
        cores = max(1, target.cores or 1)
        if 0 < M <= GEMV_MAX_M:
            # Decode: every weight byte is read once, so the only concern is splitting N evenly
            # over the cores: the widest nc (a divisor of nb) leaving >= 4 tasks per core.
            nv = nb // lanes
            while nv > 1 and (nb % (nv * lanes) or M * nv + nv + 1 > regs):
                nv -= 1
            nr = nv * lanes
            nc = nr
            for c in sorted({c for c in range(nr, nb + 1, nr) if nb % c == 0}, reverse=True):
                if N // c >= 4 * cores:
                    nc = c
                    break
            return {"mr": M, "nr": nr, "nc": nc, "parallel": "n", "pack_x": True, "k_unroll": 1}
        # Prefill: the panel as the micro-tile width, as many rows as the registers hold.
        nv = nb // lanes
        while nv > 1 and (nb % (nv * lanes) or 2 * nv + nv + 1 > regs):
            nv -= 1
        mr = max(1, min(8, (regs - nv - 1) // nv))
        return {"mr": mr, "nr": nv * lanes, "nc": nb, "parallel": "nm", "pack_x": True, "k_unroll": 1}

    def apply(self, func: Any, workload: Workload, config: dict[str, Any], target: TargetDescription) -> Any:
        facts = analyze_matmul(func, allow_half=True)
        if facts is None or not facts.b_half:
            raise ScheduleConfigError("function is no longer a half-weight matmul this template understands")
        if not self.is_valid(workload, config, target):
            raise ScheduleConfigError(f"invalid gemm_half_cpu config {config} for {workload.dims}")
        return schedule_register_tiled(
            func,
            facts,
            mr=int(config["mr"]),
            nr=int(config["nr"]),
            nc=int(config["nc"]),
            lanes=vector_lanes(target),
            parallel=str(config["parallel"]),
            pack_x=bool(config.get("pack_x", True)),
            pack_b=False,
            k_unroll=int(config.get("k_unroll", 1)),
        )


TEMPLATE = GemmHalfCPU()
