"""TIR kernels over the VNNI layouts of ``perfx_compiler/formats/vnni.py`` (int4 row pairs,
int8 + 128), used by the ``gemv_qvnni_cpu`` template.

GEMV (decode, static rows M <= 8), one call:

1. Activations: each row of x is quantized to int8 per weight group G (``dx = amax/127``,
   ``q = round(x * 127/amax)``); per chunk of 16 groups the kernel keeps the vectors ``dx`` and
   ``dx * sum(q)`` (the latter with the groups an overlapping tail chunk already counted zeroed).
2. Rows: parallel over tasks; an iteration takes U units (int4: a row pair, one 64-byte load
   gives both rows' codes by ``& 15`` / ``>> 4``; int8: one row) and shares each activation load
   among them. Per 64-column step and row: ``vpdpbusd`` (16 int32 lanes, lanes 0-7 = columns
   0-31, 8-15 = 32-63), int -> float, and one FMA with the per-lane scale ``s_w * dx`` picked by
   ``vpermps`` from the chunk's 16-group vector. 6-bit (Q6_K, lane-group order, G = 16): a lane is
   one group for all 4 steps of its chunk, so the ``vpdpbusd`` sums stay int32 over the chunk and
   take one conversion and FMA a chunk. The zero point / min / +128 offset is applied once per chunk:
   ``acc += (-z * s_w | min) * dx * sum(q)`` (one vector FMA per 16 groups). x's side: ``_vnni_x``.
3. Row end: horizontal sum of the 16 lanes.

The result is exactly ``dequant(W) @ xq`` with ``xq`` the int8-quantized x, up to float32
summation order (``formats.vnni.quantize_activations`` is the numpy reference of xq).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from perfx_compiler.formats.vnni import ROWS_PER_UNIT, code_row_bytes, lut_bytes
from perfx_compiler.formats.vnni_lowbit import (
    code_scale,
    d_of_word,
    group_nibble,
    lane_groups,
    min_width,
    q6_step_byte,
    scale_times_4,
    step_part_byte,
    unit_codes,
)
from perfx_compiler.kernels.fastmath import fast_exp  # a macro below calls it (TVMScript resolves it here)
from perfx_compiler.kernels.memo import memoized_kernel
from schedules._vnni_x import _take, _x_macros

STEP = 64
CHUNK = 16


def plan(K: int, G: int) -> dict[str, int]:
    """Static chunking of a row: full 16-group chunks, then a tail chunk overlapping the last."""
    KP = -(-K // STEP) * STEP
    S = KP // STEP
    NGE = -(-KP // G)
    NGP = max(NGE, CHUNK)
    SPC = CHUNK * G // STEP  # steps per full chunk
    F = KP // (CHUNK * G)  # chunks whose 16 groups are all whole
    TS = S - F * SPC  # steps in the tail chunk
    NCH = F + (1 if TS else 0)
    return {"KP": KP, "S": S, "NGE": NGE, "NGP": NGP, "SPC": SPC, "F": F, "TS": TS, "NCH": NCH,
            "BASE_T": min(CHUNK * F, NGP - CHUNK)}


# the row-schedule configuration gemv() takes, with the value a key left out of it gets
GEMV_CONFIG: dict[str, int] = {"units": 1, "tasks": 1, "unroll": 1, "prefetch": 0, "split": 1, "hinib": 0,
                               "sprefetch": 0, "nta": 0, "ploc": 3, "tquant": 0}


@memoized_kernel
def gemv(bits: int, N: int, K: int, G: int, sym: bool, offset: bool, rows: tuple[int, int],
         config: Mapping[str, Any], prologue: str = "", eps: float = 0.0, epilogue: str = "", sb: int = 0,
         lut: str = "") -> Any:
    """The GEMV PrimFunc (x, q, scale[, zero|min], y) of one shape for one ``config`` (keys of
    :data:`GEMV_CONFIG`): ``units`` per iteration (rows sharing each activation load), ``tasks``
    (parallel chunks of rows), ``unroll`` (64-byte steps per inner loop); ``prefetch``: software
    prefetch of each unit's codes that many 64-byte steps ahead (0: none; 5-bit: each of its 5 streams); ``split``: float
    accumulators per row, taken by turns over the steps (each step's FMA waits only for the one
    ``split`` steps back, not for the previous one); ``hinib`` (int4): the odd row's codes are used as
    ``q & 0xF0`` = 16 x code, the 1/16 folded into its scale vector (exact: a power of two), which
    saves one shift per 64-byte step; ``sprefetch``: also prefetch each row's scale (and zero/min)
    chunk as far ahead as the codes (in rows); ``nta``: the codes' prefetches are non-temporal
    (``prefetchnta``, locality 0) instead of ``prefetcht0``; ``ploc``: without nta, the codes' prefetch
    locality (3 = prefetcht0 into L1, 2 = prefetcht1 into L2, ...); ``tquant``: every row task
    quantizes x for itself, on its own stack (no serial quantization before the fork; one per thread
    when ``tasks`` equals the thread count).
    ``prologue`` ("add_rms_norm" | "swiglu", one activation row): x made inside the call from the
    small kernel's inputs; ``epilogue="swiglu"`` (one activation row; y = [gate | up], N even): each
    task takes the same range of gate rows and of up rows (gate's first, then up's: two streams one
    after the other) and ends with ``h = silu(gate) * up`` over its range, read back from its own y
    rows, into a second output h [1, 1, N/2] (see ``passes/fuse_gemv_prologue.py``).
    ``sb``: superblock scales (GGUF K-quants: int8 group values times a float16 d per ``sb`` columns,
    ``formats/vnni.py``); ``bits == 8`` with ``offset``: unsigned codes and a min; ``bits`` 2, 3, 5: 2-bit row
    quads, 3- and 5-bit row octets (``formats.vnni_lowbit.unit_codes``; Q2_K, Q5_K, Q5_1 with a min);
    ``lut`` (int4 pairs of table indices: IQ4): each row's nibbles mapped to code + 128 by ``vpshufb``
    of the table register (:func:`lut_bytes`), then the int8 path."""
    g = _gemv_plan(bits, N, K, G, sym, offset, rows, config, prologue, eps, epilogue, sb, lut)
    e = _gemv_exprs(g)
    make_x, chunk_scales = _x_macros(g, e)
    body = _body_macro(g, e, make_x, chunk_scales, _row_task_macro(g, e))
    func = _gemv_prim_func(g, body)
    # symmetric int4 (zero point 8), int8 codes and table indices take no zero array
    return func if (g.pair and not g.lut and not g.sym) or g.offset else _without_zero(func)


def _gemv_plan(bits: int, N: int, K: int, G: int, sym: bool, offset: bool, rows: tuple[int, int],  # noqa: N803
               config: Mapping[str, Any], prologue: str, eps: float, epilogue: str, sb: int, lut: str) -> SimpleNamespace:
    """The validated constants of one GEMV (``gemv``'s arguments and everything derived from them)."""
    c = {**GEMV_CONFIG, **{k: int(v) for k, v in config.items() if k in GEMV_CONFIG}}
    units, tasks, unroll, prefetch, split, hinib, sprefetch, nta, ploc, tquant = (
        c[k] for k in ("units", "tasks", "unroll", "prefetch", "split", "hinib", "sprefetch", "nta", "ploc", "tquant"))

    p = plan(K, G)
    KP, S, NGE, NGP, SPC, F, TS, NCH, BT = (p[k] for k in ("KP", "S", "NGE", "NGP", "SPC", "F", "TS", "NCH", "BASE_T"))
    B, MM = rows
    if prologue not in ("", "add_rms_norm", "swiglu") or (prologue and (B * MM != 1 or K % 16)):
        raise ValueError(f"gemv: prologue {prologue!r} needs one activation row, K % 16 == 0")
    if epilogue not in ("", "swiglu") or (epilogue and (B * MM != 1 or prologue == "swiglu"
                                                        or N % (2 * ROWS_PER_UNIT[bits]) or N // 2 < units * max(2, ROWS_PER_UNIT[bits]))):
        raise ValueError(f"gemv: epilogue {epilogue!r} needs one activation row, no swiglu prologue, "
                         f"N = 2F with F a whole number of row units (N={N}, units={units})")
    PF_LOC = 0 if nta else ploc  # llvm.prefetch locality: 0 = prefetchnta, 2 = prefetcht1, 3 = prefetcht0
    M = B * MM
    pair = bits == 4
    RPU = ROWS_PER_UNIT[bits]  # rows per unit: int4 row pairs, 6-bit row quads, int8 rows
    NU = -(-N // RPU)
    RW = units * RPU  # rows per iteration
    NIT = -(-NU // units)
    IPT = -(-NIT // tasks)
    N2 = NU * RPU
    UG = unroll * STEP // G  # groups advanced per unrolled inner loop (>= 1 by validity)
    ST = "int8" if sb else "float16"  # scale / min element type
    ZT = ST if offset else "uint8"
    SW = NGP + (2 * (K // sb) if sb and bits != 3 else 0)  # scale row: groups, then the superblocks' d (3-bit: in their low bits)
    NSB = K // sb if sb else 0
    ZW = min_width(bits, K, sb, SW)  # min / zero row (Q2_K: dmin alone, its mins are the scale bytes' high nibbles)
    # the superblock scale rows viewed for d: float16 (after each row's groups), 3-bit uint64 (pext)
    DT, DW = ("uint64", 8) if bits == 3 else ("float16", 2)
    GPS = sb // G if sb else 0  # groups per superblock
    QW = N2 // RPU if RPU > 1 else N  # code rows: one per unit
    QKW = code_row_bytes(bits, KP)  # bytes of a code row (6-bit / 5-bit: 2 / 4 nibble rows, the high bits)
    zconst = 128.0 if lut else {8: 128.0, 6: 32.0, 5: 16.0, 4: 8.0, 3: 4.0}.get(bits, 0.0)
    GV = G // 16  # 16-lane vectors per group
    # 6-bit: lane-group order (formats.vnni_lowbit.q6_lane_order): a lane sums one group over a chunk's steps in
    # int32 (vpdpbusd accumulating), scaled once a chunk; whole chunks only (Q6_K rows are)
    LG = lane_groups(bits)
    if LG and (G != 16 or TS or SPC != 4):
        raise ValueError(f"gemv: the 6-bit layout needs G = 16 and whole 256-column chunks (G={G}, K={K})")
    A = 1 if LG else split  # (one float accumulator a row: its FMA is once a chunk)
    hi = pair and hinib and not lut  # (a table index must stay a nibble)
    # before a task quantizes x: its first `prefetch` steps of codes (flat: over row ends, as the row loop's
    # own prefetch runs) and the scale lines of those rows (64 bytes = 32 scales a line)
    PRO = int(prefetch) if tquant else 0
    pro_units = -(-PRO * STEP // KP) + 1  # units the prologue's codes touch (a partial one at each end)
    PRO_S = -(-pro_units * RPU * SW // 32) if tquant and sprefetch else 0
    # scale prefetch distance in elements of the flat [N2 * SW] arrays: the codes' distance in rows
    SPD = max(1, prefetch * STEP // KP) * RPU * SW if sprefetch else 0
    # The units of task t's iteration it: a contiguous run of the rows, or with the swiglu epilogue
    # HPT iterations over its share of the gate half, then the same share of the up half
    HALF = NU // 2  # units in the gate half (epilogue)
    HNIT = -(-HALF // units)
    HPT = -(-HNIT // tasks)
    FR = HALF * RPU  # rows of the gate half: h's length
    ITERS = 2 * HPT if epilogue else IPT
    ECH = -(-(HPT * units * RPU) // 16)  # 16-lane chunks of a task's h rows
    return SimpleNamespace(**{k: v for k, v in locals().items() if k not in ("c", "p", "config")})


def _gemv_exprs(g: SimpleNamespace) -> SimpleNamespace:
    """The GEMV's expression builders (TIR expressions evaluated as the macros are parsed)."""
    from tvm.script import tirx as T

    A, G, GPS, HALF, HNIT, HPT, IPT, KP, NGP, NIT, NSB, NU = _take(g, "A G GPS HALF HNIT HPT IPT KP NGP NIT NSB NU")
    RPU, SW, bits, epilogue, hi, lut, pair, prefetch, sb = _take(g, "RPU SW bits epilogue hi lut pair prefetch sb")
    units, ZW = g.units, g.ZW

    def ubase(t: Any, it: Any) -> Any:
        if epilogue:
            return (it // HPT) * HALF + T.min((t * HPT + it % HPT) * units, HALF - units)
        return T.min((t * IPT + it) * units, NU - units)

    def uvalid(t: Any, it: Any) -> Any:
        return t * HPT + it % HPT < HNIT if epilogue else t * IPT + it < NIT

    def silu_mul(g: Any, u: Any) -> Any:
        # the elementwise swiglu's float ops in its order (fast_activations' form): bit-equal x / h
        return g * (T.float32(1) / (T.float32(1) + fast_exp(-g))) * u

    def h_row(t: Any, c: Any, ln: Any) -> Any:  # epilogue: row of h at lane ln of task t's chunk c
        return t * HPT * units * RPU + c * 16 + ln

    def h_end(t: Any) -> Any:  # epilogue: one past task t's last h row
        return T.min((t + 1) * HPT * units, HALF) * RPU

    def prefetch_at(addr: Any, locality: int) -> Any:
        """llvm.prefetch (read, data cache) of ``addr``; locality 0 = prefetchnta .. 3 = prefetcht0."""
        return T.call_llvm_intrin("void", "llvm.prefetch.p0", addr, T.int32(0), T.int32(locality), T.int32(1))

    def codes(Q: Any, unit: Any, s_abs: Any, h: Any) -> Any:
        """uint8x64: the 64 codes of row h of ``unit`` in step ``s_abs`` (int4: its nibble of the pair's
        bytes; 6-bit: the nibble of its pair's part of the step, with bits 2h..2h+1 of its high-bits part; 5-bit: bit h)."""
        if bits in (2, 3, 5):
            return unit_codes(bits, Q, unit, s_abs * STEP, h, scaled=True)
        if bits == 6:
            lo = T.shift_right(Q.vload([unit, q6_step_byte(s_abs, h // 2)], "uint8x64"),
                               T.Broadcast(T.Cast("uint8", 4 * (h % 2)), 64)) & T.Broadcast(T.uint8(15), 64)
            hb = T.shift_right(Q.vload([unit, q6_step_byte(s_abs, 2)], "uint8x64"),
                               T.Broadcast(T.Cast("uint8", 2 * h), 64)) & T.Broadcast(T.uint8(3), 64)
            return lo | T.shift_left(hb, T.Broadcast(T.uint8(4), 64))
        if lut:
            return lut_bytes(lut, T.shift_right(Q.vload([unit, s_abs * STEP], "uint8x64"),
                                                T.Broadcast(T.Cast("uint8", 4 * h), 64)) & T.Broadcast(T.uint8(15), 64))
        return T.shift_right(Q.vload([unit, s_abs * STEP], "uint8x64"), T.Broadcast(hshift(h), 64)) & T.Broadcast(
            hmask(h), 64)

    def hmask(h: Any) -> Any:  # code mask of row h of a pair (after hshift)
        return T.Select(h == 0, T.uint8(15), T.uint8(240)) if hi else T.uint8(15 if pair else 255)

    def hshift(h: Any) -> Any:
        return T.uint8(0) if hi else T.Cast("uint8", 4 * h)

    def hscale(h: Any) -> Any:
        return code_scale(bits, h) if bits in (2, 3) else T.Select(h == 0, T.float32(1), T.float32(1.0 / 16)) if hi else T.float32(1)

    def lane_group(s_local: int, h: int) -> int:
        """Group (relative to the chunk's first) of lane half h in the chunk's s_local-th step."""
        return (s_local * STEP + h * 32) // G

    def idx_vec(off: Any, s_local: int) -> Any:
        lanes = T.Ramp(T.int32(0), 1, 16)
        if G < 32:  # G = 16: four groups a step, lanes 4i..4i+3 in group i (vpdpbusd: 4 columns a lane)
            return T.Broadcast(off + s_local * (STEP // G), 16) + T.shift_right(lanes, T.Broadcast(T.int32(2), 16))
        a, b = lane_group(s_local, 0), lane_group(s_local, 1)
        return T.Broadcast(off, 16) + T.Select(lanes < T.Broadcast(T.int32(8), 16), T.Broadcast(T.int32(a), 16),
                                               T.Broadcast(T.int32(b), 16))

    def svec(A: Any, Ad: Any, row: Any, c0: Any, mins: bool = False) -> Any:
        """Groups c0..c0+15 of a row's scales (or mins) as float32x16: the float16 values, or with
        superblock scales sc * d (Ad: the array's float16 view; c0 is a multiple of the groups per
        superblock or of 8, so the 16 lanes span one or two superblocks; pad groups read the last d).
        Q2_K (2 bits): A is the scale array either way (sc | m << 4), ``mins`` takes the high nibbles
        and dmin from Ad, the min array's view."""
        if not sb:
            return T.Cast("float32x16", A.vload([row, c0], "float16x16"))
        def d(j: Any) -> Any:  # (3-bit: Ad is the uint64 view, d / 4 in a superblock's first 8 values)
            if mins and bits == 2:
                return T.Broadcast(T.Cast("float32", Ad[row * (ZW // 2) + T.min(j, NSB - 1)]), 16)
            return T.Broadcast(d_of_word(Ad[row * (SW // 8) + T.min(j, NSB - 1) * (GPS // 8)]) if bits == 3
                               else T.Cast("float32", Ad[row * (SW // 2) + NGP // 2 + T.min(j, NSB - 1)]), 16)

        dv = d(c0 // GPS) if GPS >= 16 else T.Select(
            T.Ramp(T.int32(0), 1, 16) < T.Broadcast(T.int32(8), 16), d(c0 // GPS), d(c0 // GPS + 1))
        v = A.vload([row, c0], "int8x16")
        v = group_nibble(v, mins, 16) if bits == 2 else scale_times_4(v, 16 if bits == 3 else 0)
        return T.Cast("float32x16", v) * dv

    def zvec(Sc: Any, Z: Any, Zd: Any, row: Any, c0: Any) -> Any:
        """The min term's factor (w = code * scale + min): the float16 min, or -(m * dmin)."""
        if sb and bits == 2:
            return -svec(Sc, Zd, row, c0, mins=True)
        return -svec(Z, Zd, row, c0) if sb else svec(Z, Zd, row, c0)

    def vdot(w: Any, x: Any, into: Any = None) -> Any:
        """vpdpbusd: the 16 lanes' sums of 4 products of w (u8) and x (s8), added to ``into`` (or to 0)."""
        return T.call_llvm_pure_intrin(
            T.llvm_lookup_intrinsic_id("llvm.x86.avx512.vpdpbusd.512"),
            T.Broadcast(T.int32(0), 16) if into is None else into, w, x, dtype="int32x16")

    def perm(v: Any, idx: Any) -> Any:
        return T.call_llvm_pure_intrin(
            T.llvm_lookup_intrinsic_id("llvm.x86.avx512.permvar.sf.512"), v, idx, dtype="float32x16")

    return SimpleNamespace(ubase=ubase, uvalid=uvalid, silu_mul=silu_mul, h_row=h_row, h_end=h_end, prefetch_at=prefetch_at,
                           codes=codes, hmask=hmask, hshift=hshift, hscale=hscale, idx_vec=idx_vec, svec=svec, zvec=zvec, vdot=vdot, perm=perm)


def _row_task_macro(g: SimpleNamespace, e: SimpleNamespace) -> Any:
    """Macro ``row_task``: one task's rows (its iterations of ``units`` units), then the epilogue's h."""
    from tvm.script import tirx as T

    A, BT, ECH, F, FR, ITERS, KP, LG, M, MM, N, N2, NCH, NGP = _take(g, "A BT ECH F FR ITERS KP LG M MM N N2 NCH NGP")
    PF_LOC, QKW, QW, RPU, RW, S, SPC, SPD, SW, TS, UG, bits = _take(g, "PF_LOC QKW QW RPU RW S SPC SPD SW TS UG bits")
    epilogue, offset, prefetch, split, sym, units, unroll = _take(g, "epilogue offset prefetch split sym units unroll")
    zconst, ZW = g.zconst, g.ZW
    codes, h_end, h_row, hscale, idx_vec, perm = _take(e, "codes h_end h_row hscale idx_vec perm")
    prefetch_at, silu_mul, svec, ubase, uvalid, vdot = _take(e, "prefetch_at silu_mul svec ubase uvalid vdot")
    zvec = e.zvec

    @T.macro
    def step_fma(acc, cb, Q, XQ, unit, u, s_abs, si, idx):
        # one 64-column step of unit `unit` (the iteration's u-th) for every activation row: vpdpbusd of
        # its codes and x's, then the FMA with the chunk's per-lane scales into accumulator si % A
        for bm in T.unroll(M):
            for h in T.unroll(RPU):
                acc[T.Ramp((((bm * units + u) * RPU + h) * A + si % A) * 16, 1, 16)] = acc.vload(
                    [(((bm * units + u) * RPU + h) * A + si % A) * 16], "float32x16") + T.Cast(
                    "float32x16",
                    vdot(codes(Q, unit, s_abs, h), XQ.vload([bm * KP + s_abs * STEP], "int8x64")),
                ) * perm(cb.vload([((bm * units + u) * RPU + h) * 16], "float32x16"), idx)

    @T.macro
    def step_dot(iacc, Q, XQ, unit, u, s_abs):
        # 6-bit (lane-group order): one step's vpdpbusd added into the rows' int32 lanes, each lane one
        # group of the chunk
        for bm in T.unroll(M):
            for h in T.unroll(RPU):
                iacc[T.Ramp(((bm * units + u) * RPU + h) * 16, 1, 16)] = vdot(
                    codes(Q, unit, s_abs, h), XQ.vload([bm * KP + s_abs * STEP], "int8x64"),
                    iacc.vload([((bm * units + u) * RPU + h) * 16], "int32x16"))

    @T.macro
    def chunk_fold(acc, cb, iacc):
        # 6-bit: the chunk's group sums scaled once (lane l is group l, as in cb: no permute), then reset
        for i in T.unroll(M * RW):
            acc[T.Ramp(i * A * 16, 1, 16)] = acc.vload([i * A * 16], "float32x16") + T.Cast(
                "float32x16", iacc.vload([i * 16], "int32x16")) * cb.vload([i * 16], "float32x16")
            iacc[T.Ramp(i * 16, 1, 16)] = T.Broadcast(T.int32(0), 16)

    @T.macro
    def chunk_terms(t, it, c, acc, cb, Sc, Z, DXC, DSC, Scf, Zf, Sdf, Zdf):
        # chunk c's scales of the iteration's rows: cb = s_w * dx (16 groups), the zero/min term into acc
        for u in T.unroll(units):
            for h in T.unroll(RPU):
                if SPD > 0:
                    T.evaluate(prefetch_at(T.address_of(Scf[T.min(((ubase(t, it) + u) * RPU + h)
                                               * SW + T.min(c * 16, NGP - 16) + SPD, N2 * SW - 16)]), 3))
                    if (offset and ZW == SW) or not (offset or sym or bits == 8):  # (Q2_K: mins in Sc's lines)
                        T.evaluate(prefetch_at(T.address_of(Zf[T.min(((ubase(t, it) + u) * RPU
                                                   + h) * SW + T.min(c * 16, NGP - 16) + SPD,
                                                  N2 * SW - 16)]), 3))
                for bm in T.unroll(M):
                    cb[T.Ramp(((bm * units + u) * RPU + h) * 16, 1, 16)] = svec(
                        Sc, Sdf, (ubase(t, it) + u) * RPU + h, T.min(c * 16, NGP - 16)
                    ) * (DXC.vload([(bm * NCH + c) * 16], "float32x16")
                         * T.Broadcast(hscale(h), 16))
                    if offset:
                        acc[T.Ramp(((bm * units + u) * RPU + h) * A * 16, 1, 16)] = acc.vload(
                            [((bm * units + u) * RPU + h) * A * 16], "float32x16") + zvec(
                            Sc, Z, Zdf, (ubase(t, it) + u) * RPU + h, T.min(c * 16, NGP - 16)) * DSC.vload([(bm * NCH + c) * 16], "float32x16")
                    elif sym or bits == 8:
                        acc[T.Ramp(((bm * units + u) * RPU + h) * A * 16, 1, 16)] = acc.vload(
                            [((bm * units + u) * RPU + h) * A * 16], "float32x16") - T.Broadcast(
                            T.float32(zconst), 16) * svec(
                            Sc, Sdf, (ubase(t, it) + u) * RPU + h, T.min(c * 16, NGP - 16)
                        ) * DSC.vload([(bm * NCH + c) * 16], "float32x16")
                    else:
                        acc[T.Ramp(((bm * units + u) * RPU + h) * A * 16, 1, 16)] = acc.vload(
                            [((bm * units + u) * RPU + h) * A * 16], "float32x16") - T.Cast(
                            "float32x16",
                            Sc.vload([(ubase(t, it) + u) * RPU + h,
                                      T.min(c * 16, NGP - 16)], "float16x16"),
                        ) * T.Cast(
                            "float32x16",
                            Z.vload([(ubase(t, it) + u) * RPU + h,
                                     T.min(c * 16, NGP - 16)], "uint8x16"),
                        ) * DSC.vload([(bm * NCH + c) * 16], "float32x16")

    @T.macro
    def chunk_steps(t, it, c, acc, cb, iacc, Q, XQ, Qf):
        # chunk c's 64-column steps (a full chunk: unrolled by `unroll`, codes prefetched; the tail: TS steps)
        if c < F:
            for so in T.serial(SPC // unroll):
                for si in T.unroll(unroll):
                    for u in T.unroll(units):
                        if prefetch > 0 and QKW > KP:
                            # a 6-bit quad's / 3-, 5-bit octet's one stream (formats.vnni_lowbit.interleave_parts):
                            # its step's lines, `prefetch` lines ahead; unclamped (a prefetch past the
                            # array never faults, and a clamp costs 4 instructions a line)
                            for j in T.unroll(QKW // KP):
                                T.evaluate(prefetch_at(T.address_of(Qf[(ubase(t, it) + u) * QKW + step_part_byte(
                                    QKW // KP, c * SPC + so * unroll + si, j + prefetch)]), PF_LOC))
                        elif prefetch > 0:
                            T.evaluate(prefetch_at(T.address_of(Qf[T.min((ubase(t, it) + u) * QKW
                                                      + (c * SPC + so * unroll + si + prefetch) * STEP,
                                                      QW * QKW - STEP)]), PF_LOC))
                        if LG:
                            step_dot(iacc, Q, XQ, ubase(t, it) + u, u, c * SPC + so * unroll + si)
                        else:
                            step_fma(acc, cb, Q, XQ, ubase(t, it) + u, u,
                                     c * SPC + so * unroll + si, si, idx_vec(so * UG, si))
            if LG:
                chunk_fold(acc, cb, iacc)
        else:
            for si in T.unroll(TS):
                for u in T.unroll(units):
                    step_fma(acc, cb, Q, XQ, ubase(t, it) + u, u,
                             F * SPC + si, si, idx_vec(T.int32(F * 16 - BT), si))

    @T.macro
    def row_sums(t, it, acc, red, Y):
        # 3. horizontal sums (the split accumulators first added into the first) into the rows of y
        for i in T.unroll(M * RW):
            for a in T.unroll(A - 1):
                acc[T.Ramp(i * A * 16, 1, 16)] = acc.vload([i * A * 16], "float32x16") + acc.vload(
                    [(i * A + a + 1) * 16], "float32x16")
        for u in T.unroll(units):
            for h in T.unroll(RPU):
                for bm in T.unroll(M):
                    red[T.Ramp(0, 1, 4)] = T.vectorlow("float32x4", T.vectorlow(
                        "float32x8", acc.vload([((bm * units + u) * RPU + h) * A * 16], "float32x16")) + T.vectorhigh(
                        "float32x8", acc.vload([((bm * units + u) * RPU + h) * A * 16], "float32x16"))) + T.vectorhigh(
                        "float32x4", T.vectorlow(
                            "float32x8", acc.vload([((bm * units + u) * RPU + h) * A * 16], "float32x16")) + T.vectorhigh(
                            "float32x8", acc.vload([((bm * units + u) * RPU + h) * A * 16], "float32x16")))
                    if (ubase(t, it) + u) * RPU + h < N:
                        Y[bm // MM, bm % MM, (ubase(t, it) + u) * RPU + h] = (
                            red[0] + red[2]) + (red[1] + red[3])

    @T.macro
    def swiglu_h(t, Y, H):
        # h over the task's gate rows j0 .. j1 (and the up rows FR later, also its own): y read back
        # from this core's cache, 16 lanes at a time; a short last chunk lane by lane
        for c in T.serial(ECH):
            if h_row(t, c, 16) <= h_end(t):
                for ln in T.vectorized(16):
                    H[0, 0, h_row(t, c, ln)] = silu_mul(Y[0, 0, h_row(t, c, ln)], Y[0, 0, h_row(t, c, ln) + FR])
            else:
                for ln in T.serial(16):
                    if h_row(t, c, ln) < h_end(t):
                        H[0, 0, h_row(t, c, ln)] = silu_mul(Y[0, 0, h_row(t, c, ln)], Y[0, 0, h_row(t, c, ln) + FR])



    @T.macro
    def row_task(t, Q, Sc, Z, Y, H, XQ, DXC, DSC, Qf, Scf, Zf, Sdf, Zdf):
        # task t's rows: its ITERS iterations of `units` units each (ubase), then the epilogue's h
        acc = T.decl_buffer((M * RW * A * 16,), "float32", scope="local")
        cb = T.decl_buffer((M * RW * 16,), "float32", scope="local")
        iacc = T.decl_buffer((M * RW * 16,), "int32", scope="local")  # (6-bit: the chunk's int32 group sums)
        red = T.decl_buffer((4,), "float32", scope="local")
        for it in T.serial(ITERS):
            if uvalid(t, it):
                for i in T.unroll(M * RW * A):
                    acc[T.Ramp(i * 16, 1, 16)] = T.Broadcast(T.float32(0), 16)
                if LG:
                    for i in T.unroll(M * RW):
                        iacc[T.Ramp(i * 16, 1, 16)] = T.Broadcast(T.int32(0), 16)
                for c in T.serial(NCH):
                    chunk_terms(t, it, c, acc, cb, Sc, Z, DXC, DSC, Scf, Zf, Sdf, Zdf)
                    chunk_steps(t, it, c, acc, cb, iacc, Q, XQ, Qf)
                row_sums(t, it, acc, red, Y)
        if epilogue == "swiglu":
            swiglu_h(t, Y, H)
    return row_task


def _body_macro(g: SimpleNamespace, e: SimpleNamespace, make_x: Any, chunk_scales: Any, row_task: Any) -> Any:
    """Macro ``body``: x quantized once before the fork, or by every task (``tquant``), then the row tasks."""
    from tvm.script import tirx as T

    DT, DW, K, KP, M, N2, NCH, NGE, NU, PF_LOC, PRO, PRO_S = _take(g, "DT DW K KP M N2 NCH NGE NU PF_LOC PRO PRO_S")
    QKW, QW, RPU, ST, SW, ZT, prefetch, tasks, tquant = _take(g, "QKW QW RPU ST SW ZT prefetch tasks tquant")
    units, ZW = g.units, g.ZW
    codes, prefetch_at, ubase = _take(e, "codes prefetch_at ubase")

    @T.macro
    def body(X, PB, PW, SUM, Q, Sc, Z, Y, H):
        # flat views: the prefetch runs on past a row's end into the next rows of the task
        Qf = T.decl_buffer((QW * QKW,), "uint8", data=Q.data)
        Scf = T.decl_buffer((N2 * SW,), ST, data=Sc.data)
        Zf = T.decl_buffer((N2 * ZW,), ZT, data=Z.data)
        Sdf = T.decl_buffer((N2 * SW // DW,), DT, data=Sc.data)
        Zdf = T.decl_buffer((N2 * ZW // 2,), "float16", data=Z.data)
        if tquant > 0:
            # every task quantizes x for itself: no serial quantization before the fork, the workers
            # read x itself (meant for tasks == threads: one quantization per thread)
            for t in T.parallel(tasks):
                # the task's first codes requested before it quantizes x: the weight stream's first
                # misses overlap the quantization instead of following it
                for s in T.serial(PRO):
                    T.evaluate(prefetch_at(T.address_of(Qf[T.min(T.min(ubase(t, 0), NU - units) * QKW + s * STEP, QW * QKW - STEP)]), PF_LOC))
                for s in T.serial(PRO_S):
                    T.evaluate(prefetch_at(T.address_of(Scf[T.min(T.min(ubase(t, 0), NU - units) * RPU * SW + s * 32, N2 * SW - 32)]), 3))
                XQ = T.decl_buffer((M * KP,), "int8", scope="local")
                DXC = T.decl_buffer((M * NCH * 16,), "float32", scope="local")
                DSC = T.decl_buffer((M * NCH * 16,), "float32", scope="local")
                gdx = T.decl_buffer((M * NGE,), "float32", scope="local")
                gds = T.decl_buffer((M * NGE,), "float32", scope="local")
                make_x(X, PB, PW, SUM, XQ, gdx, gds, t == 0)
                chunk_scales(gdx, gds, DXC, DSC)
                row_task(t, Q, Sc, Z, Y, H, XQ, DXC, DSC, Qf, Scf, Zf, Sdf, Zdf)
        else:
            XQ = T.decl_buffer((M * KP,), "int8")
            DXC = T.decl_buffer((M * NCH * 16,), "float32")
            DSC = T.decl_buffer((M * NCH * 16,), "float32")
            gdx = T.decl_buffer((M * NGE,), "float32")
            gds = T.decl_buffer((M * NGE,), "float32")
            # 1. int8 activations per group (x beyond K counts as 0), on the calling thread
            make_x(X, PB, PW, SUM, XQ, gdx, gds, True)
            chunk_scales(gdx, gds, DXC, DSC)
            # 2. rows
            for t in T.parallel(tasks):
                row_task(t, Q, Sc, Z, Y, H, XQ, DXC, DSC, Qf, Scf, Zf, Sdf, Zdf)

    return body


def _gemv_prim_func(g: SimpleNamespace, body: Any) -> Any:
    """The PrimFunc of ``body`` for the form of x (plain, add_rms_norm / swiglu prologue, swiglu epilogue)."""
    from tvm.script import tirx as T

    B, FR, K, MM, N, N2, QKW, QW, ST, SW, ZT, epilogue = _take(g, "B FR K MM N N2 QKW QW ST SW ZT epilogue")
    ZW = g.ZW
    prologue = g.prologue

    # One PrimFunc per form of x; each takes a zero/min array, which int8 codes do not have: their
    # function drops that parameter (``_without_zero``; the body then reads the scales in its place).
    if prologue == "add_rms_norm" and epilogue:

        @T.prim_func(private=True)
        def qv_gemv_add_rms_norm_swiglu(a_h: T.handle, b_h: T.handle, w_h: T.handle, q_h: T.handle, s_h: T.handle,
                                        z_h: T.handle, sum_h: T.handle, y_h: T.handle, h_h: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            PA = T.match_buffer(a_h, (T.int64(1), T.int64(1), T.int64(K)), "float32")
            PB = T.match_buffer(b_h, (T.int64(1), T.int64(1), T.int64(K)), "float32")
            PW = T.match_buffer(w_h, (T.int64(K),), "float32")
            Q = T.match_buffer(q_h, (T.int64(QW), T.int64(QKW)), "uint8")
            Sc = T.match_buffer(s_h, (T.int64(N2), T.int64(SW)), ST)
            Z = T.match_buffer(z_h, (T.int64(N2), T.int64(ZW)), ZT)
            SUM = T.match_buffer(sum_h, (T.int64(1), T.int64(1), T.int64(K)), "float32")
            Y = T.match_buffer(y_h, (T.int64(1), T.int64(1), T.int64(N)), "float32")
            H = T.match_buffer(h_h, (T.int64(1), T.int64(1), T.int64(FR)), "float32")
            body(PA, PB, PW, SUM, Q, Sc, Z, Y, H)

        func = qv_gemv_add_rms_norm_swiglu
    elif epilogue:

        @T.prim_func(private=True)
        def qv_gemv_then_swiglu(x_h: T.handle, q_h: T.handle, s_h: T.handle, z_h: T.handle, y_h: T.handle,
                                h_h: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            X = T.match_buffer(x_h, (T.int64(1), T.int64(1), T.int64(K)), "float32")
            Q = T.match_buffer(q_h, (T.int64(QW), T.int64(QKW)), "uint8")
            Sc = T.match_buffer(s_h, (T.int64(N2), T.int64(SW)), ST)
            Z = T.match_buffer(z_h, (T.int64(N2), T.int64(ZW)), ZT)
            Y = T.match_buffer(y_h, (T.int64(1), T.int64(1), T.int64(N)), "float32")
            H = T.match_buffer(h_h, (T.int64(1), T.int64(1), T.int64(FR)), "float32")
            body(X, X, X, X, Q, Sc, Z, Y, H)

        func = qv_gemv_then_swiglu
    elif prologue == "add_rms_norm":

        @T.prim_func(private=True)
        def qv_gemv_add_rms_norm(a_h: T.handle, b_h: T.handle, w_h: T.handle, q_h: T.handle, s_h: T.handle,
                                 z_h: T.handle, sum_h: T.handle, y_h: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            PA = T.match_buffer(a_h, (T.int64(1), T.int64(1), T.int64(K)), "float32")
            PB = T.match_buffer(b_h, (T.int64(1), T.int64(1), T.int64(K)), "float32")
            PW = T.match_buffer(w_h, (T.int64(K),), "float32")
            Q = T.match_buffer(q_h, (T.int64(QW), T.int64(QKW)), "uint8")
            Sc = T.match_buffer(s_h, (T.int64(N2), T.int64(SW)), ST)
            Z = T.match_buffer(z_h, (T.int64(N2), T.int64(ZW)), ZT)
            SUM = T.match_buffer(sum_h, (T.int64(1), T.int64(1), T.int64(K)), "float32")
            Y = T.match_buffer(y_h, (T.int64(1), T.int64(1), T.int64(N)), "float32")
            body(PA, PB, PW, SUM, Q, Sc, Z, Y, Y)

        func = qv_gemv_add_rms_norm
    elif prologue == "swiglu":

        @T.prim_func(private=True)
        def qv_gemv_swiglu(x_h: T.handle, q_h: T.handle, s_h: T.handle, z_h: T.handle, y_h: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            X = T.match_buffer(x_h, (T.int64(1), T.int64(1), T.int64(2 * K)), "float32")
            Q = T.match_buffer(q_h, (T.int64(QW), T.int64(QKW)), "uint8")
            Sc = T.match_buffer(s_h, (T.int64(N2), T.int64(SW)), ST)
            Z = T.match_buffer(z_h, (T.int64(N2), T.int64(ZW)), ZT)
            Y = T.match_buffer(y_h, (T.int64(1), T.int64(1), T.int64(N)), "float32")
            body(X, X, X, X, Q, Sc, Z, Y, Y)

        func = qv_gemv_swiglu
    else:

        @T.prim_func(private=True)
        def qv_gemv(x_h: T.handle, q_h: T.handle, s_h: T.handle, z_h: T.handle, y_h: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            X = T.match_buffer(x_h, (T.int64(B), T.int64(MM), T.int64(K)), "float32")
            Q = T.match_buffer(q_h, (T.int64(QW), T.int64(QKW)), "uint8")
            Sc = T.match_buffer(s_h, (T.int64(N2), T.int64(SW)), ST)
            Z = T.match_buffer(z_h, (T.int64(N2), T.int64(ZW)), ZT)
            Y = T.match_buffer(y_h, (T.int64(B), T.int64(MM), T.int64(N)), "float32")
            body(X, X, X, X, Q, Sc, Z, Y, Y)

        func = qv_gemv
    return func



def _without_zero(func: Any, scales: str = "Sc") -> Any:
    """``func`` without its zero/min parameter (buffer ``Z``; int8 codes have none), bound to the
    scales (the buffer named ``scales``; ``PrimFunc.specialize``): the body's only reference to it, a
    flat view it declares, is never read through. One builder then serves both signatures (this
    file's GEMV, ``_vnni_dequant``, the int8 kernels of ``gemv_int8_cpu``)."""
    z = next(p for p in func.params if p.name == "Z")
    sc = next(p for p in func.params if p.name == scales)
    return func.specialize({z: sc})


def transpose_tile(rows: list[Any]) -> list[Any]:
    """Columns of an n x n tile (n a power of two) given as n row vectors: log2(n) stages of
    2-input shuffles, each swapping the off-diagonal b x b blocks of every 2b x 2b block (one
    instruction per shuffle, n log2(n) in all; an n-way gather per column costs n moves)."""
    from tvm import tirx

    n = len(rows)
    m = list(rows)
    b = n // 2
    while b:
        nxt = list(m)
        for r in range(n):
            if not r & b:
                lo = [c if not c & b else n + c - b for c in range(n)]
                hi = [c + b if not c & b else n + c for c in range(n)]
                nxt[r] = tirx.Shuffle([m[r], m[r + b]], lo)
                nxt[r + b] = tirx.Shuffle([m[r], m[r + b]], hi)
        m = nxt
        b //= 2
    return m
