"""CPU kernels for int4 group-quantized linears (functions tagged ``perfx.quant`` by the
quantize_int4 pass) and the quantized embedding gather.

The tagged function is a plain dequantize+matmul reduction; this template replaces it with a
hand-written kernel of the same signature, reading the interleaved packing of
``perfx_compiler/formats/int4.py`` (one vector load of L uint32 words + constant shift + mask =
L consecutive codes):

* GEMV (static rows <= 8, decode): parallel over output rows N. Per group the codes are
  multiplied into a vector accumulator with x (unpack + convert + FMA: 4 vector ops per L MACs);
  the group's scale and zero are applied once per group through per-lane sums of x precomputed
  for the call: ``y += s * (sum(q x) - z * sum(x))``.
* Several rows (static M = 2..8, or ``paged_decode``'s x [batch, 1, K] with batch symbolic):
  ``unpack_once=1`` (default, schedules/_gemv_once.py) unpacks and scales each weight vector
  once into registers and FMAs it into the accumulators of up to 8 rows (the batch in chunks,
  ``chunk`` rows each); ``unpack_once=0`` is the per-row kernel, repeating the unpack for every
  row. Either way no fp32 copy of W is written per step.
* Dequantize (prefill, M symbolic): the pass emits ``dequant -> float matmul`` for many-row
  linears; this kernel unpacks W [N, K] to fp32 (vectorized, parallel over rows) and the float
  GEMM template does the matmul at full speed. The scratch is reused across layers.
* Embedding gather: rows of the packed table dequantized on the fly.

Superblock scales (info ``sb``: GGUF Q4_K / Q2_K as they are, ``formats/superblocks.py``, min
variant only): every kernel above reads them; a group's scale is float32(sc) * float32(d) with d
read through a float16 view of the int8 scale buffer (its row tail), the min -(m * dmin) likewise
(:class:`Scales`).
"""

from __future__ import annotations

from typing import Any

from perfx_compiler.formats import GEMV_MAX_ROWS, QUANT_ATTR, read_quant_info
from perfx_compiler.kernels._lanes import lanes_sum
from perfx_compiler.schedule_template import (
    ScheduleConfigError,
    ScheduleTemplate,
    Workload,
    is_cpu_target,
    make_workload,
)
from perfx_compiler.targets import TargetDescription
from schedules._gemv_once import gemv_once
from schedules._scales import Scales

quant_info = read_quant_info  # the name the other quantized templates import from here


def static_rows_of(buf: Any) -> int | None:
    """Product of a buffer's two leading dims when static (rows of a decode GEMV / gather), else None."""
    rows = 1
    for d in list(buf.shape)[:2]:
        v = getattr(d, "value", None)
        if not isinstance(v, int):
            return None
        rows *= v
    return rows


def batch_rows(buf: Any) -> bool:
    """x [batch, m, K] with batch symbolic and m static <= GEMV_MAX_ROWS (paged_decode: m = 1): the
    GEMV's row loop takes the batch at run time, each row reading the packed weights."""
    shape = list(buf.shape)
    m = getattr(shape[1], "value", None) if len(shape) == 3 else None
    return isinstance(m, int) and m <= GEMV_MAX_ROWS and not isinstance(getattr(shape[0], "value", None), int)



def _gemv(N: int, K: int, G: int, L: int, tasks: int, R: int = 4, offset: bool = False, batch: bool = False,
          sb: int = 0, sym: bool = False) -> Any:
    """Int4 GEMV over the rows of x [b, m, K]. One row after another, each a parallel launch; with
    ``batch`` (paged_decode's symbolic batch) one parallel launch with the rows innermost, so each
    task's R-row weight block is read from memory once per call and from L1 per row."""
    from tvm.script import tirx as T

    F = Scales(N, K, G, offset, sb, sym=sym)
    NG, SW, ST, ZT = F.NG, F.SW, F.ST, F.ZT  # offset (GGUF Q4_1): w = code * s + min
    VPG = G // L  # vectors per full group
    NV = K // L
    NB = K // (8 * L)  # packed blocks per row
    PER = N // tasks

    @T.macro
    def prepare_x(X, xr, xs, xr0, xs0, bm, m):
        # x copied into a buffer zero-padded to whole groups (the ragged last group then runs the
        # same unrolled loop: its clamped weight reads are multiplied by zeros), and its lane sums
        # per group (the zero point's term)
        for c in T.serial(NG * VPG):
            for lane in T.vectorized(L):
                xr[xr0 + c * L + lane] = T.if_then_else(c < NV, X[bm // m, bm % m, T.min(c, NV - 1) * L + lane], T.float32(0))
        for g in T.serial(NG):
            for lane in T.vectorized(L):
                xs[xs0 + g * L + lane] = T.float32(0)
        for c in T.serial(NV):
            for lane in T.vectorized(L):
                xs[xs0 + (c * L // G) * L + lane] = xs[xs0 + (c * L // G) * L + lane] + xr[xr0 + c * L + lane]

    groups = F.group_loop(R, NG)  # superblock factors from a table (Scales.fill_table)

    @T.macro
    def one_group(Q, S, Z, Sd, Zd, xr, xs, xr0, xs0, acc, accg, t, nj, fac, fmin, g):
        for r in T.unroll(R):
            for lane in T.vectorized(L):
                accg[r * L + lane] = T.float32(0)
        for u in T.unroll(VPG):
            for r in T.unroll(R):
                for lane in T.vectorized(L):
                    accg[r * L + lane] = accg[r * L + lane] + (
                        T.Cast(
                            "float32",
                            T.Cast(
                                "int32",
                                T.bitwise_and(
                                    T.shift_right(
                                        Q[t * PER + nj * R + r, T.min((g * VPG + u) // 8, NB - 1) * L + lane],
                                        T.Cast("uint32", ((g * VPG + u) % 8) * 4),
                                    ),
                                    T.uint32(15),
                                ),
                            ),
                        ) * xr[xr0 + (g * VPG + u) * L + lane]
                    )
        if offset:
            for r in T.unroll(R):
                for lane in T.vectorized(L):
                    acc[r * L + lane] = acc[r * L + lane] + (
                        F.table_scale(S, Sd, fac, t * PER + nj * R, r, g) * accg[r * L + lane]
                        + F.table_min(S, Z, Zd, fmin, t * PER + nj * R, r, g) * xs[xs0 + g * L + lane]
                    )
        else:
            for r in T.unroll(R):
                for lane in T.vectorized(L):
                    acc[r * L + lane] = acc[r * L + lane] + T.Cast("float32", S[t * PER + nj * R + r, g]) * (
                        accg[r * L + lane] - F.zero(Z, t * PER + nj * R + r, g) * xs[xs0 + g * L + lane]
                    )

    @T.macro
    def row_block(Q, S, Z, Sd, Zd, Y, xr, xs, xr0, xs0, acc, accg, t, nj, bm, m):
        # R weight rows against one row of x: R independent FMA chains sharing each x load
        for r in T.unroll(R):
            for lane in T.vectorized(L):
                acc[r * L + lane] = T.float32(0)
        groups(S, Z, Sd, Zd, t * PER + nj * R, acc, one_group, Q, S, Z, Sd, Zd, xr, xs, xr0, xs0, acc, accg, t, nj)
        for r in T.unroll(R):
            Y[bm // m, bm % m, t * PER + nj * R + r] = lanes_sum(acc, r * L, L)

    @T.macro
    def batch_body(S, Z, Sd, Zd, X, Q, Y, b, m):
        # every row's padded x and group sums first (one workspace for the call), so the rows
        # can be the innermost loop below
        xs = T.decl_buffer((b * m * NG * L,), "float32")
        xr = T.decl_buffer((b * m * NG * G,), "float32")
        for bm in T.serial(b * m):
            prepare_x(X, xr, xs, bm * NG * G, bm * NG * L, bm, m)
        # accumulators once per task, not per row: inside a parallel loop each allocation is
        # a TVMBackendAllocWorkspace call, which cost more than the row itself
        for t in T.parallel(tasks):
            acc = T.decl_buffer((R * L,), "float32", scope="local")
            accg = T.decl_buffer((R * L,), "float32", scope="local")
            for nj, bm in T.grid(PER // R, b * m):
                row_block(Q, S, Z, Sd, Zd, Y, xr, xs, bm * NG * G, bm * NG * L, acc, accg, t, nj, bm, m)

    @T.macro
    def rows_body(S, Z, Sd, Zd, X, Q, Y, b, m):
        xs = T.decl_buffer((NG * L,), "float32")
        xr = T.decl_buffer((NG * G,), "float32")
        for bm in T.serial(b * m):
            prepare_x(X, xr, xs, 0, 0, bm, m)
            for t in T.parallel(tasks):
                acc = T.decl_buffer((R * L,), "float32", scope="local")
                accg = T.decl_buffer((R * L,), "float32", scope="local")
                for nj in T.serial(PER // R):
                    row_block(Q, S, Z, Sd, Zd, Y, xr, xs, 0, 0, acc, accg, t, nj, bm, m)

    body = batch_body if batch else rows_body
    views = F.views()

    @T.prim_func(private=True)
    def q4_gemv(x_h: T.handle, q_h: T.handle, s_h: T.handle, z_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        b = T.int64()
        m = T.int64()
        X = T.match_buffer(x_h, (b, m, T.int64(K)), "float32")
        Q = T.match_buffer(q_h, (T.int64(N), T.int64(K // 8)), "uint32")
        S = T.match_buffer(s_h, (T.int64(N), T.int64(SW)), ST)
        Z = T.match_buffer(z_h, (T.int64(N), T.int64(SW)), ZT)
        Y = T.match_buffer(y_h, (b, m, T.int64(N)), "float32")
        views(body, S, Z, X, Q, Y, b, m)

    return F.signature(q4_gemv)


def _dequant(N: int, K: int, G: int, L: int, tasks: int, offset: bool = False, sb: int = 0, sym: bool = False) -> Any:
    from tvm.script import tirx as T

    F = Scales(N, K, G, offset, sb, sym=sym)
    SW, ST, ZT = F.SW, F.ST, F.ZT
    views = F.views()
    NV = K // L
    PER = N // tasks

    @T.macro
    def body(S, Z, Sd, Zd, Q, Out):
        for t in T.parallel(tasks):
            for nj in T.serial(PER):
                for v in T.serial(NV):
                    if offset:
                        for lane in T.vectorized(L):
                            Out[t * PER + nj, v * L + lane] = T.Cast(
                                "float32",
                                T.Cast(
                                    "int32",
                                    T.bitwise_and(
                                        T.shift_right(Q[t * PER + nj, (v // 8) * L + lane], T.Cast("uint32", (v % 8) * 4)),
                                        T.uint32(15),
                                    ),
                                ),
                            ) * F.scale(S, Sd, t * PER + nj, v * L // G) + F.min(S, Z, Zd, t * PER + nj, v * L // G)
                    else:
                        for lane in T.vectorized(L):
                            Out[t * PER + nj, v * L + lane] = (
                                T.Cast(
                                    "float32",
                                    T.Cast(
                                        "int32",
                                        T.bitwise_and(
                                            T.shift_right(Q[t * PER + nj, (v // 8) * L + lane], T.Cast("uint32", (v % 8) * 4)),
                                            T.uint32(15),
                                        ),
                                    ),
                                )
                                - F.zero(Z, t * PER + nj, v * L // G)
                            ) * T.Cast("float32", S[t * PER + nj, v * L // G])

    @T.prim_func(private=True)
    def q4_dequant(q_h: T.handle, s_h: T.handle, z_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        Q = T.match_buffer(q_h, (T.int64(N), T.int64(K // 8)), "uint32")
        S = T.match_buffer(s_h, (T.int64(N), T.int64(SW)), ST)
        Z = T.match_buffer(z_h, (T.int64(N), T.int64(SW)), ZT)
        Out = T.match_buffer(o_h, (T.int64(N), T.int64(K)), "float32")
        views(body, S, Z, Q, Out)

    return F.signature(q4_dequant)


def _dequant_panels(N: int, K: int, G: int, L: int, nb: int, offset: bool = False, sb: int = 0,
                    sym: bool = False) -> Any:
    """W written as [N / nb, K, nb] panels (the packed GEMM's layout, see weight_layout): an
    L x L tile is widened with the row kernel's contiguous loads, then stored transposed (L
    columns of L contiguous rows) through ``transpose_tile``'s shuffles."""
    from tvm.script import tirx as T

    from schedules._vnni_kernels import transpose_tile

    F = Scales(N, K, G, offset, sb, sym=sym)
    SW, ST, ZT = F.SW, F.ST, F.ZT
    views = F.views()
    TR = L
    if nb % L or L & (L - 1):
        raise ScheduleConfigError(f"panel width {nb} is not a multiple of the {L}-lane tile")

    def w(Q: Any, S: Any, Z: Any, Sd: Any, Zd: Any, row: Any, col: Any) -> Any:  # noqa: N803
        word = (col // L // 8) * L + col % L
        shift = T.Cast("uint32", (col // L) % 8 * 4)
        q = T.Cast("float32", T.Cast("int32", T.bitwise_and(T.shift_right(Q[row, word], shift), T.uint32(15))))
        if offset:
            return q * F.scale(S, Sd, row, col // G) + F.min(S, Z, Zd, row, col // G)
        return (q - F.zero(Z, row, col // G)) * T.Cast("float32", S[row, col // G])

    @T.macro
    def body(S, Z, Sd, Zd, Q, Out):
        for p in T.parallel(N // nb):
            for v in T.serial(K // L):
                for jb in T.serial(nb // TR):
                    tile = T.decl_buffer((TR * L,), "float32", scope="local")
                    for j in T.unroll(TR):
                        for lane in T.vectorized(L):
                            tile[j * L + lane] = w(Q, S, Z, Sd, Zd, p * nb + jb * TR + j, v * L + lane)
                    for c in T.unroll(L):
                        Out[p, v * L + c, T.Ramp(jb * TR, 1, TR)] = T.Shuffle(
                            transpose_tile([tile[T.Ramp(r * L, 1, L)] for r in range(TR)]), [c * TR + r for r in range(TR)])

    @T.prim_func(private=True)
    def q4_dequant_panels(q_h: T.handle, s_h: T.handle, z_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        Q = T.match_buffer(q_h, (T.int64(N), T.int64(K // 8)), "uint32")
        S = T.match_buffer(s_h, (T.int64(N), T.int64(SW)), ST)
        Z = T.match_buffer(z_h, (T.int64(N), T.int64(SW)), ZT)
        Out = T.match_buffer(o_h, (T.int64(N // nb), T.int64(K), T.int64(nb)), "float32")
        views(body, S, Z, Q, Out)

    return F.signature(q4_dequant_panels)


def _take(N: int, K: int, G: int, L: int, offset: bool = False, sb: int = 0, sym: bool = False) -> Any:
    from tvm.script import tirx as T

    F = Scales(N, K, G, offset, sb, sym=sym)
    SW, ST, ZT = F.SW, F.ST, F.ZT
    views = F.views()
    NV = K // L

    @T.macro
    def body(S, Z, Sd, Zd, Q, ID, Out, b, m):
        for bm in T.serial(b * m):
            for v in T.serial(NV):
                if offset:
                    for lane in T.vectorized(L):
                        Out[bm // m, bm % m, v * L + lane] = T.Cast(
                            "float32",
                            T.bitwise_and(
                                T.shift_right(Q[ID[bm // m, bm % m], (v // 8) * L + lane], T.Cast("uint32", (v % 8) * 4)),
                                T.uint32(15),
                            ),
                        ) * F.scale(S, Sd, ID[bm // m, bm % m], v * L // G) + F.min(S, Z, Zd, ID[bm // m, bm % m], v * L // G)
                else:
                    for lane in T.vectorized(L):
                        Out[bm // m, bm % m, v * L + lane] = (
                            T.Cast(
                                "float32",
                                T.bitwise_and(
                                    T.shift_right(Q[ID[bm // m, bm % m], (v // 8) * L + lane], T.Cast("uint32", (v % 8) * 4)),
                                    T.uint32(15),
                                ),
                            )
                            - F.zero(Z, ID[bm // m, bm % m], v * L // G)
                        ) * T.Cast("float32", S[ID[bm // m, bm % m], v * L // G])

    @T.prim_func(private=True)
    def q4_take(q_h: T.handle, s_h: T.handle, z_h: T.handle, i_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        b = T.int64()
        m = T.int64()
        Q = T.match_buffer(q_h, (T.int64(N), T.int64(K // 8)), "uint32")
        S = T.match_buffer(s_h, (T.int64(N), T.int64(SW)), ST)
        Z = T.match_buffer(z_h, (T.int64(N), T.int64(SW)), ZT)
        ID = T.match_buffer(i_h, (b, m), "int64")
        Out = T.match_buffer(o_h, (b, m, T.int64(K)), "float32")
        views(body, S, Z, Q, ID, Out, b, m)

    return F.signature(q4_take)


def rows_divisor(n: int, want: int) -> int:
    for r in (want, 16, 8, 4, 2, 1):
        if r <= want and n % r == 0:
            return r
    return 1


class GemvInt4CPU(ScheduleTemplate):
    """Also the base of ``gemv_int8_cpu``'s template: the same workload, knob and kernel choice, over
    that format's kernels (the hooks below)."""

    name = "gemv_int4_cpu"
    knobs = ("tasks", "unpack_once", "chunk")
    version = 2  # v2: 'unpack_once' (multi-row GEMVs unpack each weight once for all rows)
    bits = 4
    weight_arrays = 3  # codes, scales, zeros: the gather's ids follow them

    def _format_info(self, info: dict[str, Any]) -> dict[str, Any]:
        """Workload facts of this format beyond kind, nb and batch."""
        out = {"sym": bool(info.get("sym")), "offset": bool(info.get("offset"))}
        if info.get("sb"):  # only then: the classic formats' workload keys stay as they were
            out["sb"] = int(info["sb"])
        return out

    def _weight_arrays(self, info: dict[str, Any]) -> int:
        """Weight arrays of this format's functions (the gather's ids follow them): symmetric int4 has
        no zero array."""
        return self.weight_arrays - 1 if info.get("sym") and not info.get("offset") else self.weight_arrays

    def _fits(self, N: int, K: int, G: int, L: int) -> bool:
        return K % (8 * L) == 0 and G % L == 0  # 8 codes per uint32 word, whole vectors per group

    def _takes_superblocks(self, info: dict[str, Any]) -> bool:
        """Whether the kernels read this superblock-scale variant (int4: the min variant only,
        GGUF Q4_K / Q2_K; superblocks of whole groups, K whole superblocks)."""
        sb, G, K = int(info["sb"]), int(info["group"]), int(info["K"])
        return bool(info.get("offset")) and not info.get("words") and sb % G == 0 and K % sb == 0

    def _kernels(self, workload: Workload, target: TargetDescription) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """(gemv, dequant, dequant_panels, take builders, their format keyword arguments)."""
        fmt: dict[str, Any] = {"offset": bool(workload.info.get("offset")), "sym": bool(workload.info.get("sym"))}
        if workload.info.get("sb"):
            fmt["sb"] = int(workload.info["sb"])
        return _gemv, _dequant, _dequant_panels, _take, fmt

    def _gemv_once(self) -> Any:
        """The multi-row GEMV that unpacks each weight once for all rows, or None (the per-row
        kernel then serves every row count)."""
        return gemv_once

    def _multi_row(self, workload: Workload) -> bool:
        """A GEMV over more than one row of x: the symbolic batch or a static M of 2..8."""
        if workload.info.get("kind", "matmul") != "matmul":
            return False
        return bool(workload.info.get("batch")) or (workload.symbolic is None and 2 <= workload.dims["M"] <= GEMV_MAX_ROWS)

    def match(self, func: Any, target: TargetDescription) -> Workload | None:
        if not is_cpu_target(target):
            return None
        info = quant_info(func)
        # the VNNI layout (int8 activations) is gemv_qvnni_cpu's
        if info is None or info.get("bits") != self.bits or info.get("layout") is not None:
            return None
        if info.get("sb") and not self._takes_superblocks(info):
            return None  # the reference PrimFunc runs
        kind = info.get("kind", "matmul")
        rows = static_rows_of(func.params[0] if kind == "matmul" else func.params[self._weight_arrays(info)])
        dims = {"N": int(info["N"]), "K": int(info["K"]), "G": int(info["group"]), "L": int(info["lanes"]),
                "M": rows or 0}
        return make_workload(
            self.name, func, target, dims, symbolic="M" if rows is None else None,
            info={"kind": kind, **self._format_info(info), "nb": panel_of(func),
                  "batch": kind == "matmul" and batch_rows(func.params[0])},
            version=self.version,
        )

    def space(self, workload: Workload, target: TargetDescription) -> dict[str, list]:
        if workload.info.get("kind") == "take":
            return {}  # the gather (_take) has no knob: apply ignores tasks, nothing to tune
        N = workload.dims["N"]
        space: dict[str, list] = {"tasks": [t for t in (2, 4, 8, 16, 32, 64) if N % t == 0]}
        if self._gemv_once() is not None and self._multi_row(workload):
            space["unpack_once"] = [1, 0]
            if workload.info.get("batch"):
                space["chunk"] = [4, 8, 2]  # rows sharing one unpack (symbolic batch only)
        return space

    def is_valid(self, workload: Workload, config: dict[str, Any], target: TargetDescription) -> bool:
        # 'chunk' shapes only the unpack-once kernel: the per-row kernel is one candidate, not three
        return int(config.get("unpack_once", 1)) == 1 or int(config.get("chunk", 4)) == 4

    def builtin_default(self, workload: Workload, target: TargetDescription) -> dict[str, Any]:
        # A few tasks per core balance the rows; each task allocates its accumulators once.
        # Several rows: each weight unpacked once for all of them (unpack_once=1), which won at
        # M = 2..8 on every SmolLM2/TinyLlama shape (docs/decisions/quantized-linears.md).
        config: dict[str, Any] = {"tasks": rows_divisor(workload.dims["N"], 16)}
        if self._gemv_once() is not None and self._multi_row(workload):
            config["unpack_once"] = 1  # 0 (the per-row kernel) is searched; --knob gemv_int4_cpu.unpack_once=0
            if workload.info.get("batch"):
                # 4 rows x 4 weight rows of accumulators: beat 8 x 2 at batch 1..4, about even at 8
                config["chunk"] = 4
        return config

    def apply(self, func: Any, workload: Workload, config: dict[str, Any], target: TargetDescription) -> Any:
        d = workload.dims
        N, K, G, L = d["N"], d["K"], d["G"], d["L"]
        tasks = int(config.get("tasks", rows_divisor(N, 16)))
        if N % tasks or not self._fits(N, K, G, L):
            raise ScheduleConfigError(f"invalid int{self.bits} config {config} for {d}")
        kind = workload.info.get("kind", "matmul")
        gemv, dequant, dequant_panels, take, fmt = self._kernels(workload, target)
        if kind == "take":
            kernel = take(N, K, G, L, **fmt)
        elif kind == "dequant" and workload.info.get("nb"):
            nb = int(workload.info["nb"])
            if N % nb:
                raise ScheduleConfigError(f"panel width {nb} does not divide N={N}")
            kernel = dequant_panels(N, K, G, L, nb, **fmt)
        elif kind == "dequant":
            kernel = dequant(N, K, G, L, tasks, **fmt)
        elif int(config.get("unpack_once", 0)) and self._gemv_once() is not None and self._multi_row(workload):
            # MB rows share each unpacked weight vector; MB x R accumulators + R weights stay in
            # the vector registers: MB * R <= 16 of AVX-512's 32 (at 8 or 16 lanes), <= 8 of AVX2's 16 (the latter
            # not measured: no AVX2-only machine here)
            batch = bool(workload.info.get("batch"))
            MB = int(config.get("chunk", 4)) if batch else d["M"]
            if not 1 <= MB <= GEMV_MAX_ROWS:
                raise ScheduleConfigError(f"invalid int{self.bits} row chunk {MB} (1..{GEMV_MAX_ROWS})")
            cap = 16 if (target.vector_bits or 0) >= 512 else 8
            R = next(r for r in (4, 2, 1) if (N // tasks) % r == 0 and MB * r <= max(cap, MB))
            kernel = self._gemv_once()(N, K, G, L, tasks, R, MB, batch=batch, **fmt)
        elif workload.info.get("batch") or (workload.symbolic is None and d["M"] <= GEMV_MAX_ROWS):
            R = next(r for r in (4, 2, 1) if (N // tasks) % r == 0)
            kernel = gemv(N, K, G, L, tasks, R=R, batch=bool(workload.info.get("batch")), **fmt)
        else:
            raise ScheduleConfigError(f"int{self.bits} matmul with many rows: the pass emits dequantize + float GEMM")
        return _like(kernel, func)


def panel_of(func: Any) -> int:
    """nb when ``func`` (a dequantize) writes W as [N / nb, K, nb] panels (weight_layout chose
    them for the target), else 0: the kernels take the layout from the function they replace."""
    out = func.params[-1]  # tirx PrimFunc params are the buffers
    return int(out.shape[2]) if len(out.shape) == 3 else 0


def _like(kernel: Any, func: Any) -> Any:
    """``kernel`` with the static leading dims of ``func`` (decode: rows known at compile time)."""
    from tvm import tirx

    binds = {}
    for kp, fp in zip(kernel.params, func.params, strict=True):
        shape, changed = [], False
        for kd, fd in zip(kp.shape, fp.shape, strict=True):
            if type(kd).__name__ == "Var" and isinstance(getattr(fd, "value", None), int):
                shape.append(tirx.IntImm("int64", fd.value))  # the kernels index in int64
                changed = True
            else:
                shape.append(kd)
        if changed:
            binds[kp] = tirx.decl_buffer(shape, kp.dtype, name=kp.name, elem_offset=kp.elem_offset)
    out = kernel.specialize(binds) if binds else kernel
    attrs = {k: v for k, v in func.attrs.items() if k != QUANT_ATTR} if func.attrs is not None else {}
    return out.with_attrs({**attrs, "tirx.is_scheduled": True})


TEMPLATE = GemvInt4CPU()
