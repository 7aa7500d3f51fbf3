"""CPU template for injective functions (residual add, SiLU * mul, embedding take, casts).

Every intermediate block is inlined into the last one; the innermost static axis is vectorized
(so a symbolic M never puts a predicate in the vector loop) and the remaining axes are fused and
split into chunks that run in parallel. Knobs: vec (multiple of the SIMD width), chunk (rows of
the fused outer axis per parallel task, 0 = no parallelism for tiny functions).
"""

from __future__ import annotations

from typing import Any

from perfx_compiler.kernels.fastmath import called_ops, fast_activations
from perfx_compiler.schedule_template import (
    ScheduleConfigError,
    ScheduleTemplate,
    Workload,
    is_cpu_target,
    make_workload,
    vector_lanes,
)
from perfx_compiler.targets import TargetDescription
from schedules._matmul import _as_int, outer_extents, root_blocks


def analyze_injective(func: Any) -> dict[str, Any] | None:
    """Inner static extent, static outer size and the symbolic dim of an all-spatial function."""
    found = root_blocks(func)
    if found is None:
        return None
    sch, blocks = found
    if not blocks:
        return None
    for blk_rv in blocks:
        blk = sch.get(blk_rv)
        if blk.init is not None or any(int(iv.iter_type) != 0 for iv in blk.iter_vars):
            return None
        if sch.get_child_blocks(blk_rv):
            return None
    last = blocks[-1]
    loops = sch.get_loops(last)
    if not loops:
        return None
    extents = [sch.get(lp).extent for lp in loops]
    inner = _as_int(extents[-1])
    if inner is None:
        return None
    outer_static, symbolic = outer_extents(extents[:-1])
    heavy = bool(called_ops(func) & {f"tirx.{op}" for op in ("sigmoid", "exp", "tanh", "erf", "log", "pow")})
    return {"inner": inner, "outer": outer_static, "symbolic": symbolic, "heavy": heavy}


class ElementwiseCPU(ScheduleTemplate):
    name = "elementwise_cpu"
    knobs = ("vec", "chunk")

    def match(self, func: Any, target: TargetDescription) -> Workload | None:
        if not is_cpu_target(target):
            return None
        facts = analyze_injective(func)
        if facts is None:
            return None
        return make_workload(
            self.name,
            func,
            target,
            {"inner": facts["inner"], "outer": facts["outer"]},
            symbolic="M" if facts["symbolic"] else None,
            info={"heavy": facts["heavy"]},
            version=self.version,
        )

    def space(self, workload: Workload, target: TargetDescription) -> dict[str, list]:
        lanes = vector_lanes(target)
        inner = workload.dims["inner"]
        vecs = [v * lanes for v in (1, 2, 4) if inner % (v * lanes) == 0] or [1]
        return {"vec": vecs, "chunk": [0, 1, 4, 16, 64]}

    def is_valid(self, workload: Workload, config: dict[str, Any], target: TargetDescription) -> bool:
        vec, chunk = config.get("vec", 0), config.get("chunk", -1)
        return vec >= 1 and workload.dims["inner"] % vec == 0 and chunk >= 0

    def builtin_default(self, workload: Workload, target: TargetDescription) -> dict[str, Any]:
        lanes = vector_lanes(target)
        inner = workload.dims["inner"]
        vec = next((v * lanes for v in (2, 1) if inner % (v * lanes) == 0), 1)
        # Threads cost ~5 us to wake: with the vectorized sigmoid even SiLU*mul on 512 x 1536 runs
        # ~120 us on one core and measured no faster threaded here; only huge static tensors split.
        big = workload.symbolic is None and workload.dims["outer"] * inner >= 1 << 22
        return {"vec": vec, "chunk": 16 if big else 0}

    def apply(
        self, func: Any, workload: Workload, config: dict[str, Any], target: TargetDescription
    ) -> Any:
        from tvm import s_tir

        if not self.is_valid(workload, config, target):
            raise ScheduleConfigError(f"invalid elementwise_cpu config {config} for {workload.dims}")
        if config.get("fast_activations", True):
            func = fast_activations(func)  # vector polynomials instead of per-lane libm exp / tanh
        sch = s_tir.Schedule(func)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
        for blk in blocks[:-1]:
            try:
                sch.compute_inline(blk)
            except Exception:  # noqa: BLE001, S112 - a block read twice stays materialized, still correct
                continue
        last = blocks[-1]
        loops = sch.get_loops(last)
        vec, chunk = int(config["vec"]), int(config["chunk"])
        outer = sch.fuse(*loops[:-1]) if len(loops) > 1 else None
        _, vl = sch.split(loops[-1], [None, vec])
        sch.vectorize(vl)
        if outer is not None and chunk > 0:
            po, _ = sch.split(outer, [None, chunk])
            sch.parallel(po)
        # Blocks that could not be inlined run as their own (parallel) loop nests.
        for blk in sch.get_child_blocks(sch.get_sblock("root"))[:-1]:
            bl = sch.get_loops(blk)
            if len(bl) > 1 and chunk > 0:
                sch.parallel(sch.fuse(*bl[:-1]))
        return sch.mod["main"]


TEMPLATE = ElementwiseCPU()
