"""CPU GEMV template: decode-time linear layers, M = 1 and small static M (<= 8).

Memory bound: the weights are read once, so the schedule must stream them at full bandwidth on
all cores. Two kernels, chosen by the weight layout:

* weights [N, K] (NT_matmul): ``rows`` output rows share each x load, the contiguous K axis is
  vectorized with ``accum`` independent vector accumulators per row (rfactor) and reduced
  horizontally at the end; parallel over ``tasks`` chunks of N.
* weights [K, N] (matmul after a separate transpose): "panel", the outer-product kernel with all
  M rows in registers, vectorized along N, panels of ``nc`` columns in parallel; or "splitk",
  contiguous blocks of K rows streamed per core into private partial sums (for weights that
  come from DRAM, e.g. lm_head).
* weights pre-packed into [N / nb, K, nb] panels (layout "P", the weight_layout pass on CPU
  targets; the GEMM reads the same panels, so there is one copy of each weight): the panel
  kernel, each panel one contiguous stream, ``nc`` columns (a multiple or divisor of nb) per
  parallel task, optional ``k_unroll``.
"""

from __future__ import annotations

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
from schedules._matmul import (
    analyze_matmul,
    schedule_dot_rows,
    schedule_register_tiled,
    schedule_split_k,
    vector_registers,
)

MAX_M = 8


def _divisors(n: int, candidates: tuple[int, ...]) -> list[int]:
    return [c for c in candidates if n % c == 0]


class GemvCPU(ScheduleTemplate):
    name = "gemv_cpu"
    knobs = ("kernel", "nr", "nc", "k_outer", "k_unroll", "splits", "k_block", "rows", "accum", "tasks")
    # v2: split-K kernel for [K, N] weights; v3 (retired: never released) and v4: [N, K] partial sums lanes-innermost in registers,
    # vector-add tree for the final sum, rows=8 for DRAM-resident weights; v5: pre-packed panels ("P")
    version = 5

    def match(self, func: Any, target: TargetDescription) -> Workload | None:
        if not is_cpu_target(target):
            return None
        facts = analyze_matmul(func)
        if facts is None or facts.M is None or facts.M > MAX_M:
            return None
        lanes = vector_lanes(target)
        if facts.layout == "NT" and facts.K % lanes:
            return None
        if facts.layout == "NN" and facts.N % lanes:
            return None
        return make_workload(
            self.name, func, target, {"M": facts.M, "N": facts.N, "K": facts.K}, info=facts.info(),
            version=self.version,
        )

    def space(self, workload: Workload, target: TargetDescription) -> dict[str, list]:
        lanes = vector_lanes(target)
        N, K = workload.dims["N"], workload.dims["K"]
        cores = max(1, target.cores or 1)
        nb = int(workload.info.get("nb", 0))
        if nb:
            nrs = [v * lanes for v in range(1, nb // lanes + 1) if nb % (v * lanes) == 0]
            ncs = sorted({c for c in nrs} | {nb * f for f in (1, 2, 3, 4, 6, 8, 12, 16) if (N // nb) % f == 0})
            return {"nr": nrs, "nc": ncs, "k_outer": [False, True], "k_unroll": [1, 2, 4]}
        if workload.info.get("layout") == "NT":
            rows = _divisors(N, (1, 2, 3, 4, 6, 8))
            accum = [a for a in (1, 2, 4) if K % (a * lanes) == 0]
            tasks = sorted({t * cores for t in (1, 2, 4, 8, 16, 32)} | {1})
            return {"rows": rows, "accum": accum, "tasks": tasks}
        nrs = [v * lanes for v in (1, 2, 3, 4) if N % (v * lanes) == 0]
        ncs = sorted({nr * f for nr in nrs for f in range(1, N // nr + 1) if N % (nr * f) == 0})
        # "panel": nc-wide column panels in parallel; "splitk": contiguous row blocks in parallel.
        # Knobs of the other kernel must sit at one canonical value (see is_valid) so the search
        # never measures the same kernel twice.
        return {
            "kernel": ["panel", "splitk"],
            "nr": nrs,
            "nc": ncs,
            "k_outer": [False, True],
            "splits": sorted({1, cores, 2 * cores, 4 * cores}),
            "k_block": [1, 2, 4, 8],
        }

    def is_valid(self, workload: Workload, config: dict[str, Any], target: TargetDescription) -> bool:
        lanes = vector_lanes(target)
        N, K, M = workload.dims["N"], workload.dims["K"], workload.dims["M"]
        regs = vector_registers(target)
        nb = int(workload.info.get("nb", 0))
        if nb:
            nr, nc, ku = config.get("nr", 0), config.get("nc", 0), config.get("k_unroll", 1)
            if nr < lanes or nr % lanes or nb % nr or nc % nr or N % nc or (nc % nb and nb % nc):
                return False  # tiles must lie inside the nb-wide panels packed at compile time
            if ku < 1 or K % ku or (config.get("k_outer", False) and ku != 1):
                return False  # k_unroll applies to the k-inner order only (one canonical value)
            return M * (nr // lanes) + nr // lanes + 1 <= regs
        if workload.info.get("layout") == "NT":
            rows, accum, tasks = config.get("rows", 0), config.get("accum", 0), config.get("tasks", 0)
            if rows < 1 or accum < 1 or tasks < 1 or N % rows or K % (accum * lanes):
                return False
            return (N // rows) % tasks == 0 and M * rows * accum + M + rows <= regs * 2
        nr, nc = config.get("nr", 0), config.get("nc", 0)
        if nr < lanes or nr % lanes or N % nr:
            return False
        if config.get("kernel", "panel") == "splitk":
            splits, kb = config.get("splits", 0), config.get("k_block", 0)
            canonical = nc == N and config.get("k_outer", True) is True
            return canonical and splits >= 1 and kb >= 1 and K % (splits * kb) == 0
        if config.get("splits", 1) != 1 or config.get("k_block", 1) != 1:
            return False
        if nc % nr or N % nc:
            return False
        return M * (nr // lanes) + nr // lanes + 1 <= regs

    def builtin_default(self, workload: Workload, target: TargetDescription) -> dict[str, Any]:
        lanes = vector_lanes(target)
        N, K, M = workload.dims["N"], workload.dims["K"], workload.dims["M"]
        cores = max(1, target.cores or 1)
        regs = vector_registers(target)
        nb = int(workload.info.get("nb", 0))
        if nb:
            # One panel per task step: a contiguous K x nb stream with nb / lanes accumulators per row.
            nv = nb // lanes
            while nv > 1 and (nb % (nv * lanes) or M * nv + nv + 1 > regs):
                nv -= 1
            return {"nr": nv * lanes, "nc": nb, "k_outer": False, "k_unroll": 1}
        if workload.info.get("layout") == "NT":
            # DRAM-resident weights (lm_head): 8 rows in flight (8 streams) with one accumulator
            # each measured at numpy's bandwidth on one core; 4 rows x 2 accumulators at 0.6x.
            dram = K * N * 4 >= (8 << 20)
            rows = next((r for r in ((8, 4, 2, 1) if dram else (4, 2, 1)) if N % r == 0 and M * r <= 16), 1)
            accum = next((a for a in (((1,) if dram else (2, 1))) if K % (a * lanes) == 0 and M * rows * a <= 16), 1)
            groups = N // rows
            small = K * N * 4 < (2 << 20)  # L2-resident weights: one core, no wake-up cost
            tasks = 1 if small else next((t for t in (8 * cores, 4 * cores, 2 * cores, cores, 1) if groups % t == 0), 1)
            return {"rows": rows, "accum": accum, "tasks": tasks}
        nv = next((v for v in (4, 3, 2, 1) if N % (v * lanes) == 0 and M * v + v + 1 <= 32), 1)
        nr = nv * lanes
        # k outside the panel: each weight row is read as one nc-long contiguous run (prefetch
        # friendly) and the M x nc accumulators stay in L1. Small weights (< 2 MiB, L2-resident)
        # run on one core: waking a second costs more than it saves.
        ncs = [c for c in range(nr, N + 1, nr) if N % c == 0 and M * c * 4 <= 32768]
        panel = {"kernel": "panel", "nr": nr, "nc": N, "k_outer": True, "splits": 1, "k_block": 1}
        if K * N * 4 < (2 << 20):
            panel["nc"] = max(ncs)
            return panel
        if K * N * 4 >= (8 << 20) and K % (cores * 4) == 0:
            # DRAM-resident weights (lm_head): one sequential stream per core beats strided panels.
            return {"kernel": "splitk", "nr": nr, "nc": N, "k_outer": True, "splits": cores, "k_block": 4}
        balanced = [c for c in ncs if N // c >= cores and c <= 1024]
        panel["nc"] = max(balanced) if balanced else min(ncs)
        return panel

    def apply(
        self, func: Any, workload: Workload, config: dict[str, Any], target: TargetDescription
    ) -> Any:
        facts = analyze_matmul(func)
        if facts is None:
            raise ScheduleConfigError("function is no longer a matmul this template understands")
        if not self.is_valid(workload, config, target):
            raise ScheduleConfigError(f"invalid gemv_cpu config {config} for {workload.dims}")
        lanes = vector_lanes(target)
        if config.get("fast_activations", True):
            func = fast_activations(func)  # vector polynomials instead of per-lane libm exp / tanh
        if facts.layout == "NT":
            return schedule_dot_rows(
                func,
                facts,
                rows=int(config["rows"]),
                accum=int(config["accum"]),
                lanes=lanes,
                tasks=int(config["tasks"]),
            )
        if facts.layout != "P" and config.get("kernel", "panel") == "splitk":
            return schedule_split_k(
                func,
                facts,
                splits=int(config["splits"]),
                nr=int(config["nr"]),
                k_block=int(config["k_block"]),
                lanes=lanes,
            )
        return schedule_register_tiled(
            func,
            facts,
            mr=int(facts.M),
            nr=int(config["nr"]),
            nc=int(config["nc"]),
            lanes=lanes,
            parallel="n",
            pack_x=False,
            pack_b=False,
            k_outer=bool(config.get("k_outer", False)),
            # k_unroll is a knob of the pre-packed panels only; [K, N] panels keep the default
            k_unroll=int(config.get("k_unroll", 1)) if facts.layout == "P" else 1,
        )


TEMPLATE = GemvCPU()
