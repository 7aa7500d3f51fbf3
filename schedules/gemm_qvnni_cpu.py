"""x86 AVX-512 VNNI GEMM for quantized linears with int8 activations and many rows (prefill
chunks): functions tagged ``perfx.quant`` with ``layout: vnni``, ``kind: matmul`` and symbolic
rows (or static rows > 8; the GEMV template ``gemv_qvnni_cpu`` takes decode's <= 8). Formats:
GGUF Q4_0 / Q4_1 / Q8_0 and PerfX's q4_g32/64/128 (sym and asym) and q8, in the weight layout of
``perfx_compiler/formats/vnni.py`` (the decode GEMV's: one copy of the weights serves both); also
its later variants: unsigned int8 codes with a min (``bits 8, offset``), 6-bit row quads (Q6_K),
5-bit row octets (Q5_K / Q5_1 with a min, Q5_0 with zero point 16), 2-bit row quads (Q2_K) and 3-bit row
octets (Q3_K, zero point 4): the repack assembles each row's codes, then it is the int8 kernel) and
superblock scales (info ``sb``: GGUF K-quants and IQ4_XS, groups of G = 16 or 32), whose group
scale (and min) the repack makes as float32 ``sc * d`` (``-(m * dmin)``) once per block.

One call (``y = dequant(W) @ xq``, xq = x quantized to int8 per row and weight group):

1. Activations, once per GEMM (parallel over rows): per row and group ``dx = amax/127``,
   ``q = round(x * 127/amax)`` (int8), ``sum(q)``; exactly ``formats.vnni.quantize_activations``.
2. Parallel over blocks of ``nr`` column tiles (16 output columns each). A block first repacks
   its weights from the row layout into a thread-local panel in the layout ``vpdpbusd`` wants
   for a GEMM: per 4 (int8) / 8 (int4) columns of K, one 64-byte vector holding 16 output
   columns x 4 consecutive k (int4: k..k+3 in the low nibbles, k+4..k+7 in the high ones), and
   the block's scales as float32 vectors of 16 columns. The panel (K * nr * 8 bytes for int4)
   stays in L2 while every row tile reuses it.
3. Row tiles of ``mr`` rows: per weight group, ``mr x nr`` int32 accumulators start at the
   format's offset term (``-8 sum(q)`` Q4_0, ``-128 sum(q)`` int8, ``-z sum(q)`` asym int4) and
   take ``G/4`` ``vpdpbusd`` each (a 64-byte weight vector times a broadcast dword of 4 int8
   activations: 16 columns x 4 k per instruction, no horizontal sums); then one int->float
   conversion and one FMA with ``s_w * dx`` (Q4_1 adds ``min * dx * sum(q)``).

Q6_K (6-bit codes, superblock scales, G = 16): x is quantized per 256-column superblock instead (one dx,
llama.cpp's Q8_K), so per group the int32 sums (from ``-32 sum(q)`` of the group) take one conversion
and one FMA with ``sc * d`` into float superblock accumulators, and dx one FMA per superblock: 2 float
ops per accumulator and group instead of 4, which at G = 16 cost about as much as the group's 4
``vpdpbusd`` (kernel alone, M = 512: 1.2x). The coarser activation scale costs accuracy:
docs/decisions/gguf-superblocks.md.

G must be a multiple of 16 (activation groups are quantized 16 lanes at a time; a group is a whole
number of panel steps); with ``sb``, G must divide sb and sb divide K (the layout's own rules): the
template declines other workloads.

``epilogue="swiglu"`` (``passes/fuse_gemm_swiglu.py``; W = [gate | up]): the output is h = silu(gate) * up
alone; a block's gate tiles go to a per-task scratch of rows x 16 nr floats, then the up tiles of the same
columns are computed and written as h, so gate|up's output (twice h) is never stored. Keyed as the plain
GEMM: its records apply (nr bounded by h's tiles).

``prepacked=True`` builds the same GEMM reading panels made at compile time (``prepack``) instead
of repacking per call: the benchmark compares the two (the model uses the in-call repack, which
keeps one copy of the weights).

Knobs: ``mr`` (rows per tile), ``nr`` (16-column tiles per block; ``2 mr nr`` accumulators must
fit the 32 zmm registers with the weight vectors), ``tasks`` (parallel chunks of blocks).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from perfx_compiler.formats import GEMV_MAX_ROWS
from perfx_compiler.formats.vnni import code_row_bytes, has_avx512_vnni, lut_bytes
from perfx_compiler.formats.vnni_lowbit import (
    d_of_bytes,
    group_nibble,
    min_width,
    q6_byte,
    q6_step_byte,
    scale_times_4,
    unit_codes,
)
from perfx_compiler.kernels import _lanes
from perfx_compiler.kernels.fastmath import fast_exp
from perfx_compiler.kernels.memo import memoized_kernel
from perfx_compiler.schedule_template import (
    ScheduleConfigError,
    ScheduleTemplate,
    Workload,
    is_cpu_target,
    make_workload,
)
from perfx_compiler.targets import TargetDescription
from schedules._vnni_kernels import ROWS_PER_UNIT, plan, transpose_tile
from schedules._vnni_x import quantize_group_macro
from schedules.gemv_int4_cpu import _like, quant_info, static_rows_of

MAX_ZMM = 28  # 2 mr nr accumulators + the weight vectors of one step (32 zmm, some left to LLVM)


def _info(func: Any) -> dict[str, Any] | None:
    info = quant_info(func)
    if info is None:
        return None
    ok = info.get("layout") == "vnni" and info.get("bits") in (2, 3, 4, 5, 6, 8) and info.get("kind", "matmul") == "matmul"
    return info if ok else None


def _plain_gemm(info: dict[str, Any], func: Any) -> Any:
    """The GEMM without the epilogue, of ``func``'s shape and rows (the function a record's key hashes)."""
    from perfx_compiler.formats.vnni import vnni_compute
    from perfx_compiler.kernels.tir_queries import OPAQUE

    rows = tuple(getattr(d, "value", None) for d in list(func.params[0].shape)[:2])
    return vnni_compute(int(info["N"]), int(info["K"]), int(info["group"]), int(info["bits"]), bool(info.get("sym")),
                        bool(info.get("offset")), "matmul", rows, sb=int(info.get("sb", 0)),
                        lut=str(info.get("lut", ""))).with_attr("op_pattern", OPAQUE)


def _out_tiles(workload: Workload) -> int:
    """16-column tiles of the output (with the swiglu epilogue: h, the gate half)."""
    return workload.dims["N"] // (32 if workload.info.get("epilogue") else 16)


def _static_rows(func: Any) -> int | None:
    return static_rows_of(func.params[0])


def activation_group(bits: int, G: int, sb: int) -> int:
    """Columns per int8 activation scale (dx) in the GEMM: the superblock for 6-bit superblock codes
    (Q6_K, as llama.cpp's Q8_K), else the weight group (``formats.vnni.quantize_activations``' group)."""
    return sb if sb and bits == 6 else G


def silu_mul(g: Any, u: Any) -> Any:
    """``silu(g) * u`` in the elementwise swiglu kernel's float ops (its polynomial sigmoid): bit-equal h."""
    from tvm.script import tirx as T

    return g * (T.float32(1) / (T.float32(1) + fast_exp(-g))) * u


def _vdot(acc: Any, w: Any, x: Any) -> Any:
    """acc + vpdpbusd(w, x): 16 int32 lanes, each adding 4 uint8 x int8 products."""
    from tvm.script import tirx as T

    return T.call_llvm_pure_intrin(
        T.llvm_lookup_intrinsic_id("llvm.x86.avx512.vpdpbusd.512"), acc, w, x, dtype="int32x16")


def _register_tiles(*, mr: int, nr: int, pair: bool, G: int, KS: int, KP: int, NG: int, NSB: int, GPS: int,
                    offset: bool, asym: bool, zconst: int, steps: Any, store: str = "y") -> tuple[Any, Any]:
    """(tiles_fold, tiles): step 3 of the GEMM, the ``mr x nr`` register tiles over one block's panel
    (``tiles_fold``: Q6_K's per-superblock activation scales; ``tiles``: every other format). ``store``:
    where a finished tile goes: "y" (Y's columns n0..), "gate" (the task's scratch GS, a gate block of
    the swiglu epilogue), "h" (``silu(GS) * tile`` into Y = h's columns n0..: the matching up block)."""
    from tvm.script import tirx as T

    vdot = _vdot

    def lane(i: int, t: int) -> int:  # accumulator (row i, column tile t) of a register tile
        return (i * nr + t) * 16

    def at(mt: Any, i: int, M: Any, g: Any) -> Any:  # (row, group) index of DX / SQ; rows past M repeat the last
        return T.min(mt * mr + i, M - 1) * NG + g

    @T.macro
    def put(acc, Y, GS, MM, M, mt, n0):
        for i in T.unroll(mr):
            for t in T.unroll(nr):
                if store == "gate":
                    GS[T.Ramp((T.min(mt * mr + i, M - 1) * nr + t) * 16, 1, 16)] = acc.vload([lane(i, t)], "float32x16")
                elif store == "h":
                    for ln in T.vectorized(16):
                        Y[T.min(mt * mr + i, M - 1) // MM, T.min(mt * mr + i, M - 1) % MM, n0 + t * 16 + ln] = silu_mul(
                            GS[(T.min(mt * mr + i, M - 1) * nr + t) * 16 + ln], acc[lane(i, t) + ln])
                else:
                    Y[T.min(mt * mr + i, M - 1) // MM, T.min(mt * mr + i, M - 1) % MM,
                      T.Ramp(n0 + t * 16, 1, 16)] = acc.vload([lane(i, t)], "float32x16")

    @T.macro
    def dots(ia, XQ32, PKB, M, mt, wbase, g, n):
        # n panel steps of group g: per step, nr x (2 for int4) weight vectors times mr broadcast dwords
        for s in T.unroll(n):
            for t in T.unroll(nr):
                for h in T.unroll(2 if pair else 1):
                    for i in T.unroll(mr):
                        ia[T.Ramp(lane(i, t), 1, 16)] = vdot(
                            ia.vload([lane(i, t)], "int32x16"),
                            T.shift_right(
                                T.reinterpret("uint8x64", PKB.vload(
                                    [wbase + (g * (G // KS) + s) * nr * 16 + t * 16], "uint32x16")),
                                T.Broadcast(T.uint8(4 * h), 64)) & T.Broadcast(T.uint8(15 if pair else 255), 64),
                            T.reinterpret("int8x64", T.Broadcast(
                                XQ32[T.min(mt * mr + i, M - 1) * (KP // 4) + (g * G + s * KS) // 4 + h], 16)))

    @T.macro
    def tiles_fold(XQ32, DX, SQ, PKB, SPB, Y, GS, MM, M, n0, wbase, sbase):
        # 3. (fold) per superblock: per group, int32 sums from -zconst sum(q) (SQ) + G/4 vpdpbusd, one FMA
        # with the group's sc * d into the superblock's float accumulators; then one FMA with the row's dx
        acc = T.decl_buffer((mr * nr * 16,), "float32", scope="local")
        asb = T.decl_buffer((mr * nr * 16,), "float32", scope="local")
        ia = T.decl_buffer((mr * nr * 16,), "int32", scope="local")
        for mt in T.serial((M + mr - 1) // mr):
            for j in T.unroll(mr * nr):
                acc[T.Ramp(j * 16, 1, 16)] = T.Broadcast(T.float32(0), 16)
            for a in T.serial(NSB):
                for j in T.unroll(mr * nr):
                    asb[T.Ramp(j * 16, 1, 16)] = T.Broadcast(T.float32(0), 16)
                for gg in T.serial(GPS):
                    for i in T.unroll(mr):
                        for t in T.unroll(nr):
                            ia[T.Ramp(lane(i, t), 1, 16)] = T.Broadcast(SQ[at(mt, i, M, a * GPS + gg)], 16)
                    dots(ia, XQ32, PKB, M, mt, wbase, a * GPS + gg, G // KS)
                    for i in T.unroll(mr):
                        for t in T.unroll(nr):
                            asb[T.Ramp(lane(i, t), 1, 16)] = asb.vload([lane(i, t)], "float32x16") + T.Cast(
                                "float32x16", ia.vload([lane(i, t)], "int32x16")) * SPB.vload(
                                [sbase + (a * GPS + gg) * nr * 16 + t * 16], "float32x16")
                for i in T.unroll(mr):
                    for t in T.unroll(nr):
                        acc[T.Ramp(lane(i, t), 1, 16)] = acc.vload([lane(i, t)], "float32x16") + asb.vload(
                            [lane(i, t)], "float32x16") * T.Broadcast(DX[T.min(mt * mr + i, M - 1) * NSB + a], 16)
            put(acc, Y, GS, MM, M, mt, n0)

    @T.macro
    def tiles(XQ32, DX, SQ, PKB, SPB, ZPB, Y, GS, MM, M, n0, wbase, sbase):
        # 3. mr x nr register tiles over the block's panel: word (s, t, c) at wbase + (s nr + t) 16 + c,
        # scales of group g at sbase + (g nr + t) 16 + c
        acc = T.decl_buffer((mr * nr * 16,), "float32", scope="local")
        ia = T.decl_buffer((mr * nr * 16,), "int32", scope="local")
        for mt in T.serial((M + mr - 1) // mr):
            for j in T.unroll(mr * nr):
                acc[T.Ramp(j * 16, 1, 16)] = T.Broadcast(T.float32(0), 16)
            for g in T.serial(NG):
                # the format's offset term: -8 / -128 sum(q) (Q4_0, int8), -z sum(q) (asym int4), none (Q4_1)
                for i in T.unroll(mr):
                    for t in T.unroll(nr):
                        if offset:
                            ia[T.Ramp(lane(i, t), 1, 16)] = T.Broadcast(T.int32(0), 16)
                        elif asym:
                            ia[T.Ramp(lane(i, t), 1, 16)] = T.Broadcast(T.int32(0), 16) - ZPB.vload(
                                [sbase + g * nr * 16 + t * 16], "int32x16") * T.Broadcast(SQ[at(mt, i, M, g)], 16)
                        else:
                            ia[T.Ramp(lane(i, t), 1, 16)] = T.Broadcast(SQ[at(mt, i, M, g)] * T.int32(-zconst), 16)
                if g * G + G <= KP:
                    dots(ia, XQ32, PKB, M, mt, wbase, g, G // KS)
                else:
                    dots(ia, XQ32, PKB, M, mt, wbase, NG - 1, steps(NG - 1))
                for i in T.unroll(mr):
                    for t in T.unroll(nr):
                        acc[T.Ramp(lane(i, t), 1, 16)] = acc.vload([lane(i, t)], "float32x16") + T.Cast(
                            "float32x16", ia.vload([lane(i, t)], "int32x16")) * (
                            SPB.vload([sbase + g * nr * 16 + t * 16], "float32x16")
                            * T.Broadcast(DX[at(mt, i, M, g)], 16))
                        if offset:  # Q4_1: + min * dx * sum(q)
                            acc[T.Ramp(lane(i, t), 1, 16)] = acc.vload([lane(i, t)], "float32x16") + T.reinterpret(
                                "float32x16", ZPB.vload([sbase + g * nr * 16 + t * 16], "int32x16")) * T.Broadcast(
                                DX[at(mt, i, M, g)] * T.Cast("float32", SQ[at(mt, i, M, g)]), 16)
            put(acc, Y, GS, MM, M, mt, n0)

    return tiles_fold, tiles


def _repack(*, bits: int, lut: str, pair: bool, S: int, nr: int, RPU: int, KP: int, NG: int, offset: bool,
            asym: bool, factor: Any, minf: Any) -> Any:
    """The repack macro (step 2 of the GEMM): one block's codes from the row layout into the panel vectors
    ``vpdpbusd`` reads, and its scales (and zero points / mins) as float32 / int32 vectors."""
    from tvm.script import tirx as T

    LO, HI = T.uint32(0x0F0F0F0F), T.uint32(0xF0F0F0F0)
    SWAP = [i ^ 1 for i in range(16)]  # swap the two words of each step
    EVEN_ODD = [i if i % 2 == 0 else 16 + i for i in range(16)]  # even lanes of a, odd lanes of b
    table = lut != ""  # (a bool for TVMScript's `if`)

    def natural_step(Q8: Any, q: Any, part: int, col: Any) -> Any:
        """uint8x64: ``part``'s bytes of natural columns col..col+63 of quad q. The 6-bit layout keeps a
        chunk's columns in lane-group order (formats.vnni_lowbit.q6_lane_order): their 16 words are 4 words of
        each of the chunk's 4 stored steps, transposed back into column order."""
        at = q6_byte(part, col)  # the first word's byte: the chunk's stored step 0, lane 4 * ((col % 256) // 64)
        pieces = [T.reinterpret("uint32x4", Q8.vload([q, at + q6_step_byte(s, 0)], "uint8x16")) for s in range(4)]
        return T.reinterpret("uint8x64", T.Shuffle(pieces, [s * 4 + a for a in range(4) for s in range(4)]))

    def six_bit_codes(Q8: Any, q: Any, r: Any, col: Any) -> Any:
        """uint8x64: the codes of row r (0..3) of row quad q, columns col..col+63 (natural order), from the
        6-bit row-quad layout. ``r`` must fold to a constant once the loops unroll: a shift by a variable
        count has no byte-vector instruction (it would cost more than the whole GEMM)."""
        lo = T.shift_right(natural_step(Q8, q, r // 2, col), T.Broadcast(T.Cast("uint8", 4 * (r % 2)), 64))
        hb = T.shift_right(natural_step(Q8, q, 2, col), T.Broadcast(T.Cast("uint8", 2 * r), 64))
        return (lo & T.Broadcast(T.uint8(15), 64)) | T.shift_left(hb & T.Broadcast(T.uint8(3), 64),
                                                                  T.Broadcast(T.uint8(4), 64))

    @T.macro
    def repack(Q32, Q8, Sc, Z, PK, SP, ZP, n0):
        # 2. this block's weights as panel vectors: word (s, t, c) = 4 codes of column n0+16t+c.
        # Vectorized: rows are loaded whole and a square tile is transposed by shuffles
        # (``transpose_tile``); per-word scalar code costs as much as a third of the GEMM at M=128.
        tile = T.decl_buffer((256,), "uint32", scope="local")
        if pair:
            # 8 row pairs x 8 steps: pair p's 16 words hold (step s, word e) at lane 2s+e, e = low /
            # high 4 k. Lane 2s becomes column 2p's panel word (both words' low nibbles), lane 2s+1
            # column 2p+1's (high nibbles); as 8 x 64-bit (s) rows, the transpose gives per step s
            # the 16 columns' words in order.
            for sb in T.serial(S // 8):
                for t in T.unroll(nr):
                    for p in T.unroll(8):
                        tile[T.Ramp(p * 16, 1, 16)] = T.Shuffle(
                            [(Q32.vload([(n0 + t * 16) // 2 + p, sb * 16], "uint32x16") & T.Broadcast(LO, 16))
                             | (T.shift_left(T.Shuffle([Q32.vload([(n0 + t * 16) // 2 + p, sb * 16], "uint32x16")],
                                                       SWAP), T.Broadcast(T.uint32(4), 16)) & T.Broadcast(HI, 16)),
                             (T.shift_right(T.Shuffle([Q32.vload([(n0 + t * 16) // 2 + p, sb * 16], "uint32x16")],
                                                      SWAP), T.Broadcast(T.uint32(4), 16)) & T.Broadcast(LO, 16))
                             | (Q32.vload([(n0 + t * 16) // 2 + p, sb * 16], "uint32x16") & T.Broadcast(HI, 16))],
                            EVEN_ODD)
                    for s in T.unroll(8):
                        PK[T.Ramp(((sb * 8 + s) * nr + t) * 16, 1, 16)] = T.reinterpret("uint32x16", T.Shuffle(
                            transpose_tile([T.reinterpret("uint64x8", tile[T.Ramp(r * 16, 1, 16)]) for r in range(8)]),
                            [s * 8 + r for r in range(8)]))
        else:
            # 16 rows x 16 steps of words, transposed
            for sb in T.serial(S // 16):
                for t in T.unroll(nr):
                    for c in T.unroll(16):
                        if bits == 6:  # the row's 64 codes assembled from its quad's nibble and high-bit rows
                            tile[T.Ramp(c * 16, 1, 16)] = T.reinterpret("uint32x16", six_bit_codes(
                                Q8, n0 // 4 + t * 4 + c // 4, c % 4, sb * 64))
                        elif bits in (2, 3, 5):  # likewise from its quad's / octet's bit rows (n0 % 16 == 0)
                            tile[T.Ramp(c * 16, 1, 16)] = T.reinterpret("uint32x16", unit_codes(
                                bits, Q8, n0 // RPU + t * (16 // RPU) + c // RPU, sb * 64, c % RPU))
                        elif table:  # row c's nibbles of its pair row (n0 is even), looked up
                            tile[T.Ramp(c * 16, 1, 16)] = T.reinterpret("uint32x16", lut_bytes(lut, T.shift_right(
                                Q8.vload([n0 // 2 + t * 8 + c // 2, sb * 64], "uint8x64"),
                                T.Broadcast(T.uint8(4 * (c % 2)), 64)) & T.Broadcast(T.uint8(15), 64)))
                        else:
                            tile[T.Ramp(c * 16, 1, 16)] = Q32.vload([n0 + t * 16 + c, sb * 16], "uint32x16")
                    for s in T.unroll(16):
                        PK[T.Ramp(((sb * 16 + s) * nr + t) * 16, 1, 16)] = T.Shuffle(
                            transpose_tile([tile[T.Ramp(r * 16, 1, 16)] for r in range(16)]),
                            [s * 16 + r for r in range(16)])
        for g in T.serial(NG):
            for t in T.unroll(nr):
                for c in T.serial(16):
                    SP[(g * nr + t) * 16 + c] = factor(Sc, n0 + t * 16 + c, g)
                    if offset:
                        ZP[(g * nr + t) * 16 + c] = T.reinterpret("int32", minf(Sc, Z, n0 + t * 16 + c, g))
                    elif asym:
                        ZP[(g * nr + t) * 16 + c] = T.Cast("int32", Z[n0 + t * 16 + c, g])

    return repack


@memoized_kernel
def kernel(bits: int, N: int, K: int, G: int, sym: bool, offset: bool, mr: int, nr: int, tasks: int,
           prepacked: bool = False, sb: int = 0, lut: str = "", epilogue: str = "") -> Any:
    """The GEMM PrimFunc (x, q, scale[, zero|min], y) for one configuration; with ``prepacked``
    (x, panels, panel_scales[, panel_zero|panel_min], y) over ``prepack``'s arrays. ``sb``: superblock
    scales (int8 [N2, SW] scale / min arrays, see formats/vnni.py); not with ``prepacked``. ``lut``
    (IQ4: int4 row pairs of table indices): the repack maps each row's nibbles to code + 128 with
    ``vpshufb`` (``formats.vnni.lut_bytes``) and the rest is the int8 kernel. ``epilogue="swiglu"``
    (W = [gate | up], N even): the output is ``h = silu(gate) * up`` [.., N/2] alone; a task takes a gate
    block into a scratch tile (rows x 16 nr floats), then the up block of the same columns, and writes h
    (gate|up's y, twice h's size, is never stored)."""
    from tvm.script import tirx as T

    if (sb or lut or epilogue) and prepacked:
        raise ValueError("prepacked VNNI GEMM panels take float16 group scales (no superblock scales, tables or epilogue)")
    if epilogue not in ("", "swiglu") or (epilogue and N % 32):
        raise ValueError(f"VNNI GEMM epilogue {epilogue!r}: swiglu over gate|up halves of whole 16-column tiles")

    quantize_group = quantize_group_macro()
    KP = plan(K, G)["KP"]
    NGP = plan(K, G)["NGP"]
    NG = -(-KP // G)  # groups over the padded row (the last may be short when G > 64)
    pair = bits == 4 and not lut  # int4 panels; table indices become int8 codes in the repack
    KS = 8 if pair else 4  # k per 64-byte panel vector (per tile)
    S = KP // KS  # panel steps per row
    EPI = bool(epilogue)  # (TVMScript's conditions take bools)
    NOUT = N // 2 if EPI else N  # output columns (h: the gate half's)
    NT = NOUT // 16  # column tiles (of the gate half with the epilogue: each block also takes its up tiles)
    NB = -(-NT // nr)  # blocks
    BPT = -(-NB // tasks)
    RPU = ROWS_PER_UNIT[bits]  # rows per code row: int4 pairs, 5-bit octets, 6-bit quads, int8 rows
    N2 = -(-N // RPU) * RPU
    QW = N2 // RPU
    QKW = code_row_bytes(bits, KP)  # bytes of a code row
    ST = "int8" if sb else "float16"  # scale / min element type
    ZT = ST if offset else "uint8"
    SW = NGP + (2 * (K // sb) if sb and bits != 3 else 0)  # scale row: groups, then (sb) the superblocks' d bytes
    NSB = K // sb if sb else 0
    ZW = min_width(bits, K, sb, SW)  # min row (Q2_K: dmin alone, its mins are the scale bytes' high nibbles)
    GPS = sb // G if sb else 0  # groups per superblock
    zconst = 128 if lut else {3: 4, 4: 8, 5: 16, 6: 32, 8: 128}.get(bits, 0)
    asym = pair and not sym and not offset
    GV = G // 16
    # Q6_K (superblock scales, no min): activations quantized per superblock (llama.cpp's Q8_K), so a
    # group's int32 sums take one FMA with its scale into a superblock accumulator and dx comes once per
    # superblock: 2 float ops a group instead of 4, which at G = 16 cost as much as the 4 vpdpbusd
    AG = activation_group(bits, G, sb)
    fold = AG != G

    def steps(g: int) -> int:
        return (min(KP, (g + 1) * G) - g * G) // KS

    def factor(A: Any, row: Any, g: Any) -> Any:  # noqa: N803
        """Group g's scale (or min factor) of a row as float32: the float16 value, or (sb) sc * d,
        d the row's superblock float16 from its two little-endian bytes after the groups."""
        if not sb:
            return T.Cast("float32", A[row, g])
        if bits == 3:  # the 6-bit values, d in the low bits of the superblock's first 8 (formats/vnni_lowbit.py)
            return T.Cast("float32", scale_times_4(A[row, g])) * d_of_bytes(lambda r, c: A[r, c], row, g)
        return T.Cast("float32", group_nibble(A[row, g], False) if bits == 2 else A[row, g]) * d_at(A, row, NGP, g)

    def d_at(A: Any, row: Any, first: int, g: Any) -> Any:  # noqa: N803
        """float32 d (or dmin) of group g's superblock: the little-endian float16 at A[row, first + 2 j]."""
        at = first + 2 * T.min(g // GPS, NSB - 1)
        d16 = T.Cast("uint16", T.Cast("uint8", A[row, at])) | T.shift_left(
            T.Cast("uint16", T.Cast("uint8", A[row, at + 1])), T.uint16(8))
        return T.Cast("float32", T.reinterpret("float16", d16))

    def minf(Sc: Any, Z: Any, row: Any, g: Any) -> Any:  # noqa: N803
        """The min term's factor (w = code * scale + min): the float16 min, or (sb) -(m * dmin); Q2_K's m
        is the high nibble of its scale byte, dmin the min array's only content."""
        if sb and bits == 2:
            return -(T.Cast("float32", group_nibble(Sc[row, g], True)) * d_at(Z, row, 0, g))
        return -factor(Z, row, g) if sb else factor(Z, row, g)

    @T.macro
    def quantize(X, XQ, DX, SQ, MM, M):
        # 1. int8 activations per row and group (x beyond K counts as 0), once per call
        for bm in T.parallel(M):
            mx = T.decl_buffer((16,), "float32", scope="local")
            sm = T.decl_buffer((16,), "int32", scope="local")
            inv = T.decl_buffer((1,), "float32", scope="local")
            if fold:  # dx per superblock (K % sb == 0, so KP == K); SQ: -zconst * sum(q) per weight group
                for a in T.serial(NSB):
                    quantize_group(X, XQ, DX, bm * NSB + a, bm, a, mx, sm, inv, AG, AG // 16, K, KP, MM, a * AG)
                for g in T.serial(NG):
                    for ln in T.vectorized(16):
                        sm[ln] = 0
                    for c in T.serial(GV):
                        for ln in T.vectorized(16):
                            sm[ln] = sm[ln] + T.Cast("int32", XQ[bm * KP + g * G + c * 16 + ln])
                    SQ[bm * NG + g] = _lanes.lanes_sum(sm, 0, 16, "int32") * T.int32(-zconst)
            else:
                for g in T.serial(NG):
                    quantize_group(X, XQ, DX, bm * NG + g, bm, g, mx, sm, inv, G, GV, K, KP, MM, g * G)
                    SQ[bm * NG + g] = sm[0]

    repack = _repack(bits=bits, lut=lut, pair=pair, S=S, nr=nr, RPU=RPU, KP=KP, NG=NG, offset=offset, asym=asym,
                     factor=factor, minf=minf)
    def block_tiles(store: str) -> Any:
        """Macro: the register tiles of one repacked block, ``store`` as in :func:`_register_tiles`."""
        tiles_fold, tiles = _register_tiles(mr=mr, nr=nr, pair=pair, G=G, KS=KS, KP=KP, NG=NG, NSB=NSB, GPS=GPS,
                                            offset=offset, asym=asym, zconst=zconst, steps=steps, store=store)

        @T.macro
        def run(XQ32, DX, SQ, PK, SP, ZP, Y, GS, MM, M, n0):
            if fold:
                tiles_fold(XQ32, DX, SQ, PK, SP, Y, GS, MM, M, n0, 0, 0)
            else:
                tiles(XQ32, DX, SQ, PK, SP, ZP, Y, GS, MM, M, n0, 0, 0)

        return tiles, run

    tiles, tiles_y = block_tiles("y")
    _, tiles_gate = block_tiles("gate")
    _, tiles_h = block_tiles("h")

    @T.macro
    def body(X, W, Sc, Z, Y, B, MM):
        XQ = T.decl_buffer((B * MM * KP,), "int8")
        XQ32 = T.decl_buffer((B * MM * (KP // 4),), "int32", data=XQ.data)
        DX = T.decl_buffer((B * MM * NG,), "float32")
        SQ = T.decl_buffer((B * MM * NG,), "int32")
        quantize(X, XQ, DX, SQ, MM, B * MM)
        if prepacked:
            # W, Sc, Z: panels [NB, S, nr, 16] words and scales [NB, NG, nr, 16] (``prepack``)
            for tk in T.parallel(tasks):
                for bb in T.serial(BPT):
                    if tk * BPT + bb < NB:
                        tiles(XQ32, DX, SQ, W, Sc, Z, Y, Y, MM, B * MM, T.min((tk * BPT + bb) * nr, NT - nr) * 16,
                              (tk * BPT + bb) * (S * nr * 16), (tk * BPT + bb) * (NG * nr * 16))
        else:
            Q32 = T.decl_buffer((QW, QKW // 4), "uint32", data=W.data)
            Q8 = T.decl_buffer((QW, QKW), "uint8", data=W.data)
            for tk in T.parallel(tasks):
                PK = T.decl_buffer((S * nr * 16,), "uint32")
                SP = T.decl_buffer((NG * nr * 16,), "float32")
                ZP = T.decl_buffer((NG * nr * 16,), "int32")
                GS = T.decl_buffer((B * MM * nr * 16 if EPI else 16,), "float32")  # the gate tile (epilogue)
                for bb in T.serial(BPT):
                    if tk * BPT + bb < NB:
                        repack(Q32, Q8, Sc, Z, PK, SP, ZP, T.min((tk * BPT + bb) * nr, NT - nr) * 16)
                        if EPI:
                            tiles_gate(XQ32, DX, SQ, PK, SP, ZP, Y, GS, MM, B * MM, T.min((tk * BPT + bb) * nr, NT - nr) * 16)
                            repack(Q32, Q8, Sc, Z, PK, SP, ZP, NOUT + T.min((tk * BPT + bb) * nr, NT - nr) * 16)
                            tiles_h(XQ32, DX, SQ, PK, SP, ZP, Y, GS, MM, B * MM, T.min((tk * BPT + bb) * nr, NT - nr) * 16)
                        else:
                            tiles_y(XQ32, DX, SQ, PK, SP, ZP, Y, GS, MM, B * MM, T.min((tk * BPT + bb) * nr, NT - nr) * 16)

    if prepacked or asym or offset:
        # (x, weights, scales, zero|min, y): the row layout's arrays, or ``prepack``'s panels (symmetric
        # int4, int8 and table indices take no zero array: the form below)
        i64 = T.int64
        if prepacked:
            W_SHAPE, W_DT = (i64(NB * S * nr * 16),), "uint32"
            S_SHAPE, S_DT = (i64(NB * NG * nr * 16),), "float32"
            Z_SHAPE, Z_DT = S_SHAPE, "int32"
        else:
            W_SHAPE, W_DT = (i64(QW), i64(QKW)), "uint8"
            S_SHAPE, S_DT = (i64(N2), i64(SW)), ST
            Z_SHAPE, Z_DT = (i64(N2), i64(ZW)), ZT

        @T.prim_func(private=True)
        def qv_gemm(x_h: T.handle, w_h: T.handle, s_h: T.handle, z_h: T.handle, y_h: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            B = T.int64()
            MM = T.int64()
            X = T.match_buffer(x_h, (B, MM, T.int64(K)), "float32")
            W = T.match_buffer(w_h, W_SHAPE, W_DT)
            Sc = T.match_buffer(s_h, S_SHAPE, S_DT)
            Z = T.match_buffer(z_h, Z_SHAPE, Z_DT)
            Y = T.match_buffer(y_h, (B, MM, T.int64(NOUT)), "float32")
            body(X, W, Sc, Z, Y, B, MM)

        return qv_gemm

    @T.prim_func(private=True)
    def qv_gemm8(x_h: T.handle, q_h: T.handle, s_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        B = T.int64()
        MM = T.int64()
        X = T.match_buffer(x_h, (B, MM, T.int64(K)), "float32")
        Q = T.match_buffer(q_h, (T.int64(QW), T.int64(QKW)), "uint8")
        Sc = T.match_buffer(s_h, (T.int64(N2), T.int64(SW)), ST)
        Y = T.match_buffer(y_h, (B, MM, T.int64(NOUT)), "float32")
        body(X, Q, Sc, Sc, Y, B, MM)

    return qv_gemm8


def prepack(bits: int, N: int, K: int, G: int, sym: bool, offset: bool, arrays: list[np.ndarray],
            nr: int, sb: int = 0) -> list[np.ndarray]:
    """The ``prepacked`` kernel's arrays (panels, scales, zero|min) from the row layout's ones:
    what the in-call repack writes per block, made once (a compile-time repack). Float16 group
    scales only: superblock (``sb``) layouts are declined."""
    from perfx_compiler.formats.vnni import unpack_q4_pairs

    if sb or arrays[1].dtype != np.float16:
        raise ValueError("prepack takes float16 group scales, not superblock (sb) scales")

    p = plan(K, G)
    KP = p["KP"]
    NG = -(-KP // G)
    NT = N // 16
    NB = -(-NT // nr)
    if bits == 4:
        c = unpack_q4_pairs(arrays[0], N, KP).reshape(N, KP // 8, 2, 4)
        words = np.ascontiguousarray(c[:, :, 0, :] | (c[:, :, 1, :] << np.uint8(4))).view(np.uint32)[..., 0]
    else:
        words = np.ascontiguousarray(arrays[0][:N]).view(np.uint32)
    sc = arrays[1][:N, :NG].astype(np.float32)
    if offset:
        zp = arrays[2][:N, :NG].astype(np.float32).view(np.int32)
    elif bits == 4 and not sym:
        zp = arrays[2][:N, :NG].astype(np.int32)
    else:
        zp = np.zeros((N, NG), np.int32)
    starts = [min(b * nr, NT - nr) * 16 for b in range(NB)]

    def blocks(a: np.ndarray) -> np.ndarray:  # [N, X] -> [NB, X, nr, 16]
        out = np.stack([a[s: s + nr * 16].reshape(nr, 16, -1).transpose(2, 0, 1) for s in starts])
        return np.ascontiguousarray(out).reshape(-1)

    return [blocks(words), blocks(sc), blocks(zp)]


class GemmQVnniCPU(ScheduleTemplate):
    name = "gemm_qvnni_cpu"
    knobs = ("mr", "nr", "tasks")
    version = 1

    def match(self, func: Any, target: TargetDescription) -> Workload | None:
        if not is_cpu_target(target) or not has_avx512_vnni(target):
            return None
        info = _info(func)
        if info is None or int(info["N"]) % 16:
            return None
        rows = _static_rows(func)
        if rows is not None and rows <= GEMV_MAX_ROWS:
            return None  # decode: the GEMV template's
        dims = {"N": int(info["N"]), "K": int(info["K"]), "G": int(info["group"]), "bits": int(info["bits"])}
        sb = int(info.get("sb", 0))
        if dims["G"] % 16 or (sb and (sb % dims["G"] or dims["K"] % sb)):
            return None  # see the module docstring: whole 16-lane groups, whole groups per superblock
        epilogue = str(info.get("epilogue", ""))
        if epilogue and (epilogue != "swiglu" or dims["N"] % 32):
            return None
        # a GEMM with the swiglu epilogue is keyed as the plain GEMM of its shape (passes/fuse_gemm_swiglu.py):
        # the same blocks and tiles, so the records tuned for it apply
        keyed = _plain_gemm(info, func) if epilogue else func
        return make_workload(self.name, keyed, target, dims, symbolic=None if rows else "M",
                             info={"sym": bool(info.get("sym")), "offset": bool(info.get("offset")), "sb": sb,
                                   **({"lut": str(info["lut"])} if info.get("lut") else {}),
                                   **({"epilogue": epilogue} if epilogue else {})},
                             version=self.version)

    def space(self, workload: Workload, target: TargetDescription) -> dict[str, list]:
        nt = _out_tiles(workload)
        return {"mr": [1, 2, 4, 6, 8], "nr": [n for n in (1, 2, 3, 4) if n <= nt],
                "tasks": [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= nt]}

    def builtin_default(self, workload: Workload, target: TargetDescription) -> dict[str, Any]:
        nt = _out_tiles(workload)
        nr = 2 if nt >= 2 else 1
        return {"mr": 4, "nr": nr, "tasks": min(32, -(-nt // nr))}

    def is_valid(self, workload: Workload, config: dict[str, Any], target: TargetDescription) -> bool:
        return self._why_invalid(workload, config) is None

    def _why_invalid(self, workload: Workload, config: dict[str, Any]) -> str | None:
        d = workload.dims
        mr, nr, tasks = (int(config.get(k, 0)) for k in ("mr", "nr", "tasks"))
        if mr < 1 or nr < 1 or tasks < 1:
            return "mr, nr and tasks must be >= 1"
        if nr > _out_tiles(workload):
            return f"nr={nr} tiles of 16 columns exceed the {16 * _out_tiles(workload)} output columns"
        wv = 2 * nr if d["bits"] == 4 else nr
        if 2 * mr * nr + wv > MAX_ZMM:
            return f"mr={mr} x nr={nr} needs {2 * mr * nr + wv} zmm registers (> {MAX_ZMM})"
        return None

    def apply(self, func: Any, workload: Workload, config: dict[str, Any], target: TargetDescription) -> Any:
        why = self._why_invalid(workload, config)
        if why is not None:
            raise ScheduleConfigError(f"invalid VNNI GEMM config {config} for {workload.dims}: {why}")
        d, info = workload.dims, workload.info
        k = kernel(d["bits"], d["N"], d["K"], d["G"], info["sym"], info["offset"], int(config["mr"]),
                   int(config["nr"]), int(config["tasks"]), sb=int(info.get("sb", 0)), lut=str(info.get("lut", "")),
                   epilogue=str(info.get("epilogue", "")))
        return _like(k, func)


TEMPLATE = GemmQVnniCPU()
