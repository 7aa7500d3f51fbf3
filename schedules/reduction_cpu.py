"""CPU template for row reductions with elementwise prologue/epilogue (RMSNorm, mean, sum).

Cheap elementwise blocks are inlined into their consumers (but not the per-row scalars computed
from a reduction, e.g. rsqrt(mean), which would then be recomputed per element). Every remaining
block is computed per row under one fused, optionally parallel, row loop. The reduction runs on
``lanes``-wide vector partial sums (rfactor) and the per-row epilogue is vectorized.
Knobs: rfactor (vector partial sums or scalar chain), vec, chunk (rows per parallel task; 0 = serial).
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
from schedules._matmul import _as_int, outer_extents, root_blocks


def _is_reduction(blk: Any) -> bool:
    return any(int(iv.iter_type) == 2 for iv in blk.iter_vars)


def _buffer_names(regions: Any) -> set[str]:
    names = set()
    for region in regions:
        src = getattr(region, "source", None)
        if src is None:
            src = getattr(region, "buffer", None)
        names.add(str(getattr(src, "name", src)))
    return names


def _written(sch: Any, blk_rv: Any) -> set[str]:
    return _buffer_names(sch.get(blk_rv).writes)


def _read(sch: Any, blk_rv: Any) -> set[str]:
    return _buffer_names(sch.get(blk_rv).reads)


def analyze_row_reduction(func: Any) -> dict[str, Any] | None:
    found = root_blocks(func)
    if found is None:
        return None
    sch, blocks = found
    if len(blocks) < 2:
        return None
    reds = [b for b in blocks if _is_reduction(sch.get(b))]
    if not reds or _is_reduction(sch.get(blocks[-1])):
        return None
    for b in blocks:
        if sch.get_child_blocks(b):
            return None
    for red in reds:
        kinds = [int(iv.iter_type) for iv in sch.get(red).iter_vars]
        # rows first, then the reduced axis last: [S..., R]
        if kinds[-1] != 2 or any(k == 2 for k in kinds[:-1]):
            return None
    loops = sch.get_loops(blocks[-1])
    extents = [sch.get(lp).extent for lp in loops]
    inner = _as_int(extents[-1])
    red_extent = _as_int(sch.get(reds[0]).iter_vars[-1].dom.extent)
    if inner is None or red_extent is None or len(loops) < 2:
        return None
    rows_static, symbolic = outer_extents(extents[:-1])
    return {"inner": inner, "reduce": red_extent, "rows": rows_static, "symbolic": symbolic}


class ReductionCPU(ScheduleTemplate):
    name = "reduction_cpu"
    knobs = ("rfactor", "vec", "chunk")
    version = 2  # v1 vectorized the row loop when chunk == SIMD width

    def match(self, func: Any, target: TargetDescription) -> Workload | None:
        if not is_cpu_target(target):
            return None
        facts = analyze_row_reduction(func)
        if facts is None:
            return None
        dims = {"rows": facts["rows"], "inner": facts["inner"], "reduce": facts["reduce"]}
        return make_workload(
            self.name, func, target, dims, symbolic="M" if facts["symbolic"] else None, version=self.version
        )

    def space(self, workload: Workload, target: TargetDescription) -> dict[str, list]:
        lanes = vector_lanes(target)
        inner = workload.dims["inner"]
        vecs = [v * lanes for v in (1, 2, 4) if inner % (v * lanes) == 0] or [1]
        return {"rfactor": [True, False], "vec": vecs, "chunk": [0, 1, 4, 16]}

    def is_valid(self, workload: Workload, config: dict[str, Any], target: TargetDescription) -> bool:
        vec = config.get("vec", 0)
        if vec < 1 or workload.dims["inner"] % vec or config.get("chunk", -1) < 0:
            return False
        return not config.get("rfactor") or workload.dims["reduce"] % vector_lanes(target) == 0

    def builtin_default(self, workload: Workload, target: TargetDescription) -> dict[str, Any]:
        lanes = vector_lanes(target)
        inner = workload.dims["inner"]
        vec = lanes if inner % lanes == 0 else 1
        # A row of the model is 576-1536 floats: even 512 rows take ~35 us on one core, which
        # measured faster than waking the thread pool on this 2-core class (tuning may differ).
        return {"rfactor": workload.dims["reduce"] % lanes == 0, "vec": vec, "chunk": 0}

    def apply(
        self, func: Any, workload: Workload, config: dict[str, Any], target: TargetDescription
    ) -> Any:
        from tvm import s_tir

        if not self.is_valid(workload, config, target):
            raise ScheduleConfigError(f"invalid reduction_cpu config {config} for {workload.dims}")
        lanes = vector_lanes(target)
        sch = s_tir.Schedule(func)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
        red_out: set[str] = set()
        for b in blocks:
            if _is_reduction(sch.get(b)):
                red_out |= _written(sch, b)
        for b in blocks[:-1]:
            if _is_reduction(sch.get(b)) or _read(sch, b) & red_out:
                continue
            try:
                sch.compute_inline(b)
            except Exception:  # noqa: BLE001, S112 - stays a materialized row buffer: still correct
                continue
        # rfactor must happen while the reduction is still a root-level loop nest (it rejects
        # blocks that were moved under compute_at), so split the lanes off first.
        if config["rfactor"]:
            for b in sch.get_child_blocks(sch.get_sblock("root")):
                if _is_reduction(sch.get(b)):
                    _, ri = sch.split(sch.get_loops(b)[-1], [None, lanes])
                    sch.rfactor(ri, factor_axis=0)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
        last = blocks[-1]
        loops = sch.get_loops(last)
        row = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
        chunk = int(config["chunk"])
        if chunk > 0:
            po, row = sch.split(row, [None, chunk])
            sch.parallel(po)
        _, vl = sch.split(sch.get_loops(last)[-1], [None, int(config["vec"])])
        sch.vectorize(vl)
        names = [sch.get(b).name_hint for b in blocks[:-1]]
        depth = len(sch.get_loops(last)) - 2  # loops above and including the row loop
        for b in reversed(blocks[:-1]):
            sch.compute_at(b, row, preserve_unit_loops=False)
        for name in names:
            blk = sch.get_sblock(name)
            bl = sch.get_loops(blk)
            kinds = [int(iv.iter_type) for iv in sch.get(blk).iter_vars]
            if name.endswith("_rf"):
                # rf block: iters (lane, rows..., r_outer); loops under the row: r_outer, lane
                own = list(bl[depth:])
                lane_loop = next((lp for lp in own if _as_int(sch.get(lp).extent) == lanes), None)
                r_outer = next((lp for lp in own if not lp.same_as(lane_loop)), None) if lane_loop else None
                if lane_loop is not None and r_outer is not None and len(own) == 2:
                    sch.reorder(r_outer, lane_loop)  # lanes innermost: one vector accumulator
                    sch.vectorize(lane_loop)  # before decompose: the update alone is not "complete"
                    init = sch.decompose_reduction(blk, r_outer)
                    sch.vectorize(sch.get_loops(init)[-1])
            elif 2 not in kinds and len(bl) > depth:  # own loops only, never the row loop
                inner_loop = bl[-1]
                ext = _as_int(sch.get(inner_loop).extent)
                if ext is not None and ext % lanes == 0 and ext > 1:
                    _, il = sch.split(inner_loop, [None, lanes])
                    sch.vectorize(il)
        return sch.mod["main"]


TEMPLATE = ReductionCPU()
