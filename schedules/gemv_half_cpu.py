"""CPU kernels for half-precision weights (functions tagged ``perfx.quant`` with bits = 16: the
``f16`` / ``bf16`` quantizations of ``passes/cast_weights.py``).

* GEMV (static rows <= 8, decode): parallel over ``tasks`` chunks of output rows; ``rows`` rows
  share each x vector, ``accum`` independent vector accumulators per row along K. Each weight
  vector is widened to fp32 in registers (bf16: zero-extend + shift left 16; f16: vcvtph2ps) and
  FMA'd in fp32; the lanes are summed at the end. Under ``--precision bf16`` x is first rounded to
  bf16 (round to nearest even) into a K-long scratch shared by all tasks.
* Dequantize (prefill, rows symbolic): W widened to fp32 [N, K], then the float GEMM template.
* Embedding gather: rows of the half table widened on the fly.
* Round (prefill under ``--precision``): x rounded to bf16 before the float GEMM.

(``vdpbf16ps`` is not used: TVM 0.27's LLVM codegen lowers bfloat16 vectors to i16, so the
``llvm.x86.avx512bf16.dpbf16ps.512`` call fails LLVM's verifier. Rounded bf16 x bf16 products are
exact in fp32, so the results equal a bf16 dot product up to fp32 summation order.)
"""

from __future__ import annotations

from typing import Any

from perfx_compiler.formats import GEMV_MAX_ROWS
from perfx_compiler.kernels._lanes import lanes_sum
from perfx_compiler.schedule_template import (
    ScheduleConfigError,
    ScheduleTemplate,
    Workload,
    is_cpu_target,
    make_workload,
    vector_lanes,
)
from perfx_compiler.targets import TargetDescription
from schedules.gemv_int4_cpu import panel_of, quant_info, static_rows_of


def _info(func: Any) -> dict[str, Any] | None:
    info = quant_info(func)
    if info is None:
        return None
    return info if info.get("bits") == 16 and info.get("dtype") in ("f16", "bf16") else None


def _widen(T: Any, v: Any, family: str) -> Any:
    if family == "bf16":
        return T.reinterpret("float32", T.shift_left(T.Cast("uint32", v), T.uint32(16)))
    return T.Cast("float32", v)


def _round_bf16(T: Any, v: Any) -> Any:
    u = T.reinterpret("uint32", v)
    r = u + T.uint32(0x7FFF) + T.bitwise_and(T.shift_right(u, T.uint32(16)), T.uint32(1))
    return T.reinterpret("float32", T.bitwise_and(r, T.uint32(0xFFFF0000)))


def _act(T: Any, v: Any, rnd: bool) -> Any:
    return _round_bf16(T, v) if rnd else v


def _gemv(N: int, K: int, family: str, act: str, L: int, tasks: int, R: int, A: int) -> Any:
    from tvm.script import tirx as T

    WT = "uint16" if family == "bf16" else "float16"
    PER = N // tasks
    NV = K // (A * L)
    RA = R * A * L
    rnd = act == "bf16"

    @T.prim_func(private=True)
    def half_gemv(x_h: T.handle, w_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        b = T.int64()
        m = T.int64()
        X = T.match_buffer(x_h, (b, m, T.int64(K)), "float32")
        W = T.match_buffer(w_h, (T.int64(N), T.int64(K)), WT)
        Y = T.match_buffer(y_h, (b, m, T.int64(N)), "float32")
        XS = T.alloc_buffer((K,), "float32")
        for bm in T.serial(b * m):
            for c in T.serial(K // L):
                for lane in T.vectorized(L):
                    XS[c * L + lane] = _act(T, X[bm // m, bm % m, c * L + lane], rnd)
            for t in T.parallel(tasks):
                acc = T.decl_buffer((RA,), "float32", scope="local")
                for nj in T.serial(PER // R):
                    for i in T.unroll(R * A):
                        for lane in T.vectorized(L):
                            acc[i * L + lane] = T.float32(0)
                    for v in T.serial(NV):
                        for a in T.unroll(A):
                            for r in T.unroll(R):
                                for lane in T.vectorized(L):
                                    acc[(r * A + a) * L + lane] = acc[(r * A + a) * L + lane] + _widen(
                                        T, W[t * PER + nj * R + r, (v * A + a) * L + lane], family
                                    ) * XS[(v * A + a) * L + lane]
                    for r in T.unroll(R):
                        for a in T.unroll(A - 1):
                            for lane in T.vectorized(L):
                                acc[r * A * L + lane] = acc[r * A * L + lane] + acc[(r * A + a + 1) * L + lane]
                        Y[bm // m, bm % m, t * PER + nj * R + r] = lanes_sum(acc, r * A * L, L)

    return half_gemv


def _dequant(N: int, K: int, family: str, L: int, tasks: int) -> Any:
    from tvm.script import tirx as T

    WT = "uint16" if family == "bf16" else "float16"
    PER = N // tasks

    # one input and one output of equal size: Relax's RewriteDataflowReshape asks whether this is a
    # reshape, which needs a root block (hence the block, and no well-formedness check of it)
    @T.prim_func(private=True, check_well_formed=False)
    def half_dequant(w_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        W = T.match_buffer(w_h, (T.int64(N), T.int64(K)), WT)
        Out = T.match_buffer(o_h, (T.int64(N), T.int64(K)), "float32")
        with T.sblock("root"):
            for t in T.parallel(tasks):
                for nj in T.serial(PER):
                    for v in T.serial(K // L):
                        for lane in T.vectorized(L):
                            Out[t * PER + nj, v * L + lane] = _widen(T, W[t * PER + nj, v * L + lane], family)

    return half_dequant


def _dequant_panels(N: int, K: int, family: str, L: int, nb: int) -> Any:
    """W written as [N / nb, K, nb] panels (the packed GEMM's layout, see weight_layout): an
    L x L tile widened with contiguous loads, stored transposed through ``transpose_tile``."""
    from tvm.script import tirx as T

    from schedules._vnni_kernels import transpose_tile

    WT = "uint16" if family == "bf16" else "float16"
    if nb % L or L & (L - 1) or K % L:
        raise ScheduleConfigError(f"panel width {nb} / K={K} is not a multiple of the {L}-lane tile")

    @T.prim_func(private=True, check_well_formed=False)  # root block: see _dequant
    def half_dequant_panels(w_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        W = T.match_buffer(w_h, (T.int64(N), T.int64(K)), WT)
        Out = T.match_buffer(o_h, (T.int64(N // nb), T.int64(K), T.int64(nb)), "float32")
        with T.sblock("root"):
            for p in T.parallel(N // nb):
                for v in T.serial(K // L):
                    for jb in T.serial(nb // L):
                        tile = T.decl_buffer((L * L,), "float32", scope="local")
                        for j in T.unroll(L):
                            for lane in T.vectorized(L):
                                tile[j * L + lane] = _widen(T, W[p * nb + jb * L + j, v * L + lane], family)
                        for c in T.unroll(L):
                            Out[p, v * L + c, T.Ramp(jb * L, 1, L)] = T.Shuffle(
                                transpose_tile([tile[T.Ramp(r * L, 1, L)] for r in range(L)]), [c * L + r for r in range(L)])

    return half_dequant_panels


def _take(N: int, K: int, family: str, L: int, ids_dtype: str) -> Any:
    from tvm.script import tirx as T

    WT = "uint16" if family == "bf16" else "float16"

    @T.prim_func(private=True)
    def half_take(w_h: T.handle, i_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        b = T.int64()
        m = T.int64()
        W = T.match_buffer(w_h, (T.int64(N), T.int64(K)), WT)
        ID = T.match_buffer(i_h, (b, m), ids_dtype)
        Out = T.match_buffer(o_h, (b, m, T.int64(K)), "float32")
        for bm in T.serial(b * m):
            for v in T.serial(K // L):
                for lane in T.vectorized(L):
                    Out[bm // m, bm % m, v * L + lane] = _widen(
                        T, W[T.Cast("int64", ID[bm // m, bm % m]), v * L + lane], family
                    )

    return half_take


def _round(K: int, L: int) -> Any:
    from tvm.script import tirx as T

    @T.prim_func(private=True, check_well_formed=False)  # root block: see _dequant
    def round_bf16(x_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        b = T.int64()
        m = T.int64()
        X = T.match_buffer(x_h, (b, m, T.int64(K)), "float32")
        Out = T.match_buffer(o_h, (b, m, T.int64(K)), "float32")
        with T.sblock("root"):
            for bm in T.parallel(b * m):
                for v in T.serial(K // L):
                    for lane in T.vectorized(L):
                        Out[bm // m, bm % m, v * L + lane] = _round_bf16(T, X[bm // m, bm % m, v * L + lane])

    return round_bf16


def _lanes(K: int, target: TargetDescription) -> int:
    lanes = vector_lanes(target)
    while lanes > 1 and K % lanes:
        lanes //= 2
    return lanes


class GemvHalfCPU(ScheduleTemplate):
    name = "gemv_half_cpu"
    knobs = ("tasks", "rows", "accum")

    def match(self, func: Any, target: TargetDescription) -> Workload | None:
        if not is_cpu_target(target):
            return None
        info = _info(func)
        if info is None:
            return None
        kind = info.get("kind", "matmul")
        if kind == "round" and info.get("act") != "bf16":
            return None  # only bf16 rounding has a CPU kernel (f16 precision is refused on CPUs)
        N, K = int(info["N"]), int(info["K"])
        rows = None
        if kind in ("matmul", "round"):
            buf = func.params[0]
            rows = static_rows_of(buf)
        if kind == "matmul" and (rows is None or rows > GEMV_MAX_ROWS):
            return None  # the pass emits dequantize + float GEMM for many rows
        dims = {"N": N, "K": K, "L": _lanes(K, target), "M": rows or 0}
        symbolic = "M" if kind in ("take", "round") and rows is None else None  # dequant: no rows at all
        return make_workload(self.name, func, target, dims, symbolic=symbolic,
                             info={"kind": kind, "dtype": info["dtype"], "act": info.get("act", "f32"),
                                   "nb": panel_of(func)},
                             version=self.version)

    def space(self, workload: Workload, target: TargetDescription) -> dict[str, list]:
        N, K, L = workload.dims["N"], workload.dims["K"], workload.dims["L"]
        cores = max(1, target.cores or 1)
        tasks = sorted({t for t in (1, cores, 2 * cores, 4 * cores, 8 * cores, 16 * cores) if N % t == 0})
        if workload.info.get("kind") in ("take", "round"):
            return {"tasks": [1]}  # no knob: one kernel (the rounding loop is parallel over rows by itself)
        if workload.info.get("kind") == "dequant":
            return {"tasks": tasks}
        return {"tasks": tasks, "rows": [r for r in (1, 2, 4, 8) if N % r == 0],
                "accum": [a for a in (1, 2, 4) if K % (a * L) == 0]}

    def is_valid(self, workload: Workload, config: dict[str, Any], target: TargetDescription) -> bool:
        N, K, L = workload.dims["N"], workload.dims["K"], workload.dims["L"]
        tasks = int(config.get("tasks", 0))
        if tasks < 1 or N % tasks:
            return False
        if workload.info.get("kind") in ("take", "round"):
            return tasks == 1
        if workload.info.get("kind") == "dequant":
            return True
        R, A = int(config.get("rows", 0)), int(config.get("accum", 0))
        if R < 1 or A < 1 or (N // tasks) % R or K % (A * L):
            return False
        regs = 32 if vector_lanes(target) >= 16 else 16
        return R * A + R + 1 <= regs  # accumulators + widened w per row + x fit the register file

    def builtin_default(self, workload: Workload, target: TargetDescription) -> dict[str, Any]:
        N, K, L = workload.dims["N"], workload.dims["K"], workload.dims["L"]
        cores = max(1, target.cores or 1)
        small = N * K * 2 < (1 << 20)  # L2-resident weights: one core (waking another costs more)
        tasks = 1 if small else next((t for t in (8 * cores, 4 * cores, 2 * cores, cores) if N % t == 0), 1)
        if workload.info.get("kind") in ("take", "round"):
            return {"tasks": 1}
        if workload.info.get("kind") == "dequant":
            return {"tasks": next((t for t in (8 * cores, 4 * cores, cores, 1) if N % t == 0), 1)}
        per = N // tasks
        rows = next(r for r in (4, 2, 1) if per % r == 0)
        accum = next(a for a in (2, 1) if K % (a * L) == 0)
        return {"tasks": tasks, "rows": rows, "accum": accum}

    def apply(self, func: Any, workload: Workload, config: dict[str, Any], target: TargetDescription) -> Any:
        from schedules.gemv_int4_cpu import _like

        if not self.is_valid(workload, config, target):
            raise ScheduleConfigError(f"invalid gemv_half_cpu config {config} for {workload.dims}")
        d, info = workload.dims, workload.info
        N, K, L = d["N"], d["K"], d["L"]
        family, kind = info["dtype"], info["kind"]
        tasks = int(config["tasks"])
        if kind == "take":
            ids_dtype = str(func.params[1].dtype)
            kernel = _take(N, K, family, L, ids_dtype)
        elif kind == "dequant" and info.get("nb"):
            if N % int(info["nb"]):
                raise ScheduleConfigError(f"panel width {info['nb']} does not divide N={N}")
            kernel = _dequant_panels(N, K, family, L, int(info["nb"]))
        elif kind == "dequant":
            kernel = _dequant(N, K, family, L, tasks)
        elif kind == "round":
            kernel = _round(K, L)
        else:
            kernel = _gemv(N, K, family, info["act"], L, tasks, int(config["rows"]), int(config["accum"]))
        return _like(kernel, func)


TEMPLATE = GemvHalfCPU()
