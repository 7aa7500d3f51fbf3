"""Weight layouts for the x86 VNNI kernels (int8 activations, ``schedules/gemv_qvnni_cpu.py``).

``vpdpbusd`` multiplies 64 unsigned bytes by 64 signed bytes and adds each group of 4 products
into one of 16 int32 lanes. The kernels quantize the activation row to int8 per weight group
(scale ``dx = amax / 127``), so a 64-column step is: one 64-byte weight load, one 64-byte
activation load, a ``vpdpbusd``; lanes 0-7 hold columns 0-31 of the step, lanes 8-15 columns
32-63 (one weight group each when G = 32).

Layouts, for W [N, K] (K padded with zero columns to KP, a multiple of 64):

* int4 (``q4v``): codes uint8 [ceil(N/2), KP]. Byte k of pair p holds row 2p's code of column k
  in its low nibble and row 2p+1's in its high nibble, so ``v & 15`` and ``v >> 4`` are the two
  rows' 64 codes in column order (no shuffles). An odd N gets a zero padding row.
* int8 (``q8v``): codes uint8 [N, KP] = signed code + 128 (vpdpbusd's unsigned operand); the
  kernel removes the offset like an int4 zero point: ``sum((q+128) x) - 128 sum(x)``.
* scale / zero / min: [N2, NGP] (N2 = N rounded up to the pair), NGP = max(ceil(KP/G), 16)
  groups, zero-padded: the kernel reads 16 groups with one vector load (the last chunk of a
  row overlaps the one before it instead of reading past the row).

* 6-bit (``q6v``, GGUF Q6_K): codes uint8 [ceil(N/4), 3 * KP], one code row per quad of rows, in
  three parts per 64-column step, side by side (``q6_byte``): the codes' low nibbles of rows 4q, 4q+1
  (as ``q4v``), those of rows 4q+2, 4q+3, then a part whose byte holds the four rows' high 2 bits of
  its column (row 4q+r in bits 2r..2r+1): 6 bits a weight, where int8 codes would take 8. A quad is one
  forward stream, as a row pair is (three streams a KP apart read 16% slower, Q6_K ffn_down,
  docs/decisions/gemv-qvnni-cpu.md). Columns are in lane-group order (``q6_lane_order``): in each
  256-column chunk (16 groups of 16), step s's lane l (4 bytes, one ``vpdpbusd`` sum) holds columns
  4s..4s+3 of group l, so a lane sums one group over the chunk's 4 steps in int32 and the GEMV scales
  once a chunk instead of once a step (x is quantized into the same order). KP must be whole chunks
  (Q6_K rows are). Codes are unsigned (zero point 32).
* 5-bit (``q5v``, GGUF Q5_K / Q5_1 with their min, Q5_0 with zero point 16): codes uint8
  [ceil(N/8), 5 * KP], one code row per octet of rows, in five parts per 64-column step, side by side
  (``part_byte``): four int4 pair parts of the codes' low nibbles (rows 8o, 8o+1, then 8o+2, 8o+3, ...
  as ``q4v``), then one part whose byte holds the eight rows' fifth bits of its column (row 8o+r in bit
  r): 5 bits a weight, where uint8 codes took 8. Row r's codes: ``nibble | ((hb >> r) & 1) << 4``.
  Codes are unsigned 0..31. An octet is one forward stream, as a 6-bit quad is.
* 2-bit (``q2v``, GGUF Q2_K with its min) and 3-bit (``q3v``, GGUF Q3_K as code + 4, zero point 4):
  one code row per quad / octet of rows; 2 / 3 bits a weight. The 2-, 3-, 5- and 6-bit code rows are
  packed and addressed in ``formats/vnni_lowbit.py``.
* int4 table indices (``lut: iq4nl``: GGUF IQ4_XS / IQ4_NL): the row-pair nibbles of ``q4v`` hold
  4-bit indices into ggml's 16-value non-linear table (``kvalues_iq4nl``, -127..113); the kernels
  map them with one ``vpshufb`` of a register holding the table + 128 (``LUT_U8``) into the int8
  layout's unsigned code + 128, so everything after the lookup is the int8 path (no zero array).
  4.3125 / 4.5 bits a weight (file: 4.25 / 4.5), where int8 codes took 8.3 / 8.5.
* int8 with a min (``bits 8, offset``): codes uint8 [N, KP] are the unsigned codes themselves
  (no +128); w = code * scale + min. (GGUF Q5_1 / Q5_K took it before the 5-bit layout.)
* superblock scales (info ``sb: 256``: GGUF K-quants and IQ4_XS, ``formats/ggml``): the group
  (sub-block, G = 16 or 32) scale is an int8 ``sc`` times a float16 ``d`` per 256 columns, and the
  min likewise ``m`` times ``dmin``: w = (d * sc) * code - dmin * m, every product exact in float32.
  The scale array is int8 [N2, SW] with SW = NGP + 2 * K/256: columns 0..NGP-1 the group values
  (zero-padded), then the row's superblock d values as little-endian float16 bytes; the min array
  (formats with mins) has the same shape with m and dmin. 4.625 bits a weight for Q4_K (4.5 in the
  file), where float16 group scales would need 5.0 and lose d * sc's low bits. (Q2_K's 4-bit sc and m
  share one scale byte and its min array holds only dmin; Q3_K's d lies in its values' low bits: both
  in ``formats/vnni_lowbit.py``.)

Codes, scales, zeros and mins are the format's own values moved, never recomputed: the
unpacking functions below give back the exact input arrays (tests check this bit for bit).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from perfx_compiler.errors import PerfXError
from perfx_compiler.formats import QUANT_ATTR

STEP = 64  # columns per vpdpbusd step
CHUNK = 16  # groups per scale vector


def padded_k(k: int) -> int:
    return -(-k // STEP) * STEP


def groups_padded(k: int, group: int) -> tuple[int, int]:
    """(groups over the padded row, stored group columns >= 16)."""
    ng = -(-padded_k(k) // group)
    return ng, max(ng, CHUNK)


def pack_q4_pairs(codes: np.ndarray) -> np.ndarray:
    """codes uint8 [N, K] (0..15) -> uint8 [ceil(N/2), KP] (row pairs in the two nibbles)."""
    n, k = codes.shape
    kp = padded_k(k)
    c = np.zeros((n + n % 2, kp), dtype=np.uint8)
    c[:n, :k] = codes
    return np.ascontiguousarray(c[0::2] | (c[1::2] << np.uint8(4)))


def unpack_q4_pairs(packed: np.ndarray, n: int, k: int) -> np.ndarray:
    rows = np.stack([packed & np.uint8(15), packed >> np.uint8(4)], axis=1).reshape(-1, packed.shape[1])
    return np.ascontiguousarray(rows[:n, :k])


def pack_q8_offset(codes: np.ndarray) -> np.ndarray:
    """int8 codes [N, K] (or [N, K / 32, 32]: a view of the GGUF blocks' code bytes) -> uint8 [N, KP] =
    code + 128 (padding columns hold 128: weight 0), with no [N, K] temporary."""
    n, k = codes.shape[0], int(np.prod(codes.shape[1:]))
    out = np.full((n, padded_k(k)), 128, dtype=np.uint8)
    dst = out[:, :k].reshape(codes.shape)  # (splits the last axis: a view)
    assert np.may_share_memory(dst, out), "internal: the code view of the packed array was copied"
    np.bitwise_xor(codes.view(np.uint8), np.uint8(0x80), out=dst)
    return out


def unpack_q8_offset(packed: np.ndarray, k: int) -> np.ndarray:
    return np.ascontiguousarray((packed[:, :k] ^ np.uint8(0x80)).view(np.int8))


def scale_width(k: int, group: int, sb: int = 0) -> int:
    """Columns of a scale / min array: the padded groups, then (``sb``) 2 bytes of d per superblock."""
    _, ngp = groups_padded(k, group)
    return ngp + (2 * (k // sb) if sb else 0)


def pack_subscales(values: np.ndarray, d: np.ndarray, k: int, group: int, rows: int, sb: int) -> np.ndarray:
    """int8 group values [N, K/G] and float16 superblock factors [N, K/sb] -> int8 [rows, SW]."""
    from perfx_compiler.formats.superblocks import pack_superblock_scales

    _, ngp = groups_padded(k, group)
    assert d.shape[1] == k // sb
    return pack_superblock_scales(values, d, ngp, rows)


def unpack_subscales(packed: np.ndarray, n: int, k: int, group: int, sb: int) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`pack_subscales`: (values int8 [N, K/G], d float16 [N, K/sb])."""
    _, ngp = groups_padded(k, group)
    d = np.ascontiguousarray(packed[:n, ngp:]).view("<f2").astype(np.float16)
    return np.ascontiguousarray(packed[:n, : k // group]), d


def pad_groups(a: np.ndarray, k: int, group: int, rows: int) -> np.ndarray:
    """[N, ng] per-group array -> [rows, NGP], zero-padded."""
    _, ngp = groups_padded(k, group)
    out = np.zeros((rows, ngp), dtype=a.dtype)
    out[: a.shape[0], : a.shape[1]] = a
    return out


def vnni_info(n: int, k: int, group: int, bits: int, symmetric: bool, offset: bool, kind: str,
              prologue: str = "", eps: float = 0.0, epilogue: str = "", sb: int = 0, lut: str = "") -> str:
    ng, ngp = groups_padded(k, group)
    info = {"bits": bits, "N": n, "K": k, "KP": padded_k(k), "group": group, "NGP": ngp,
            "sym": symmetric, "offset": offset, "kind": kind, "layout": "vnni", "act": "int8"}
    if sb:  # only then: the classic formats' facts (and so their tuning keys) stay as they were
        info["sb"] = sb
    if lut:  # likewise only then (the other layouts' tuning keys stay as they were)
        info["lut"] = lut
    if prologue:
        info.update(prologue=prologue, eps=eps)
    if epilogue:
        info.update(epilogue=epilogue)
    return json.dumps(info, sort_keys=True)


def q4_vnni_packed(codes: np.ndarray, scale: np.ndarray, third: np.ndarray, fmt: Any, rows: int | None = None) -> Any:
    """The :class:`~perfx_compiler.formats.Packed` of int4 codes in the VNNI pair layout (``fmt``: ``formats.int4.Int4Format``;
    ``rows``: the whole weight's N when ``codes`` are a chunk of its rows, see :data:`ROW_CHUNKS`)."""
    from perfx_compiler.formats import Packed

    n, k = codes.shape
    n2 = n + n % 2
    arrays = [("_q4", pack_q4_pairs(codes)),
              ("_q4_scale", pad_groups(np.asarray(scale, dtype=np.float16), k, fmt.group, n2))]
    if fmt.offset:
        arrays.append(("_q4_min", pad_groups(np.asarray(third, dtype=np.float16), k, fmt.group, n2)))
    elif not fmt.symmetric:  # (symmetric: zero point 8, no array)
        arrays.append(("_q4_zero", pad_groups(np.asarray(third, dtype=np.uint8), k, fmt.group, n2)))

    n = rows or n

    def compute(kind: str, rows: tuple[int | None, int | None], ids_dtype: str = "int64") -> Any:
        return vnni_compute(n, k, fmt.group, 4, fmt.symmetric, fmt.offset, kind, rows, ids_dtype)

    return Packed("q4", f"{fmt.tag}v", n, k, arrays, compute)


def q8_vnni_packed(codes: np.ndarray, scale: np.ndarray, group: int, rows: int | None = None) -> Any:
    """The :class:`~perfx_compiler.formats.Packed` of int8 codes in the VNNI layout (``rows``: as for
    :func:`q4_vnni_packed`)."""
    from perfx_compiler.formats import Packed

    n, k = codes.shape[0], int(np.prod(codes.shape[1:]))  # (codes [N, K] or [N, K / 32, 32])
    arrays = [("_q8", pack_q8_offset(np.asarray(codes, dtype=np.int8))),
              ("_q8_scale", pad_groups(np.asarray(scale, dtype=np.float16), k, group, n))]

    n = rows or n

    def compute(kind: str, rows: tuple[int | None, int | None], ids_dtype: str = "int64") -> Any:
        return vnni_compute(n, k, group, 8, True, False, kind, rows, ids_dtype)

    return Packed("q8", f"g{group}v", n, k, arrays, compute)


def code_row_bytes(bits: int, kp: int) -> int:
    """Bytes of one code row (int4 pair, 2-bit / 6-bit quad, 3-bit / 5-bit octet, int8 row) of a KP-column layout."""
    return {3: 3 * kp, 5: 5 * kp, 6: 3 * kp}.get(bits, kp)


def pack_q8_raw(codes: np.ndarray) -> np.ndarray:
    """Unsigned codes [N, K] (int8 with a min: Q5_1 / Q5_K) -> uint8 [N, KP] as they are (padding 0:
    the padded activations are 0, and so is their share of the min term)."""
    n, k = codes.shape
    out = np.zeros((n, padded_k(k)), dtype=np.uint8)
    out[:, :k] = codes
    return out


# GGUF types whose codes are nibbles (the float-activation layout; under VNNI LOWBIT_TYPES below take Q2_K, Q3_K)
NIBBLE_TYPES = ("Q4_K", "Q2_K", "Q3_K")
# GGUF types whose codes are indices into a fixed table (int4 row pairs of the indices, see above)
LUT_TYPES = {"IQ4_XS": "iq4nl", "IQ4_NL": "iq4nl"}
# kvalues_iq4nl (ggml-common.h) + 128: what vpdpbusd's unsigned operand takes for the int8 path
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
LUT_U8 = {"iq4nl": tuple(v + 128 for v in KVALUES_IQ4NL)}


def table_indices(codes: np.ndarray, lut: str) -> np.ndarray:
    """The table values ``codes`` (int8) as uint8 indices into table ``lut`` (every code must be in it)."""
    table = np.asarray(LUT_U8[lut], dtype=np.int16) - 128
    idx = np.searchsorted(table, np.asarray(codes, dtype=np.int16))
    if idx.max(initial=0) > 15 or not np.array_equal(table[np.minimum(idx, 15)], codes):
        raise PerfXError(f"internal: codes outside the {lut} table")
    return idx.astype(np.uint8)


SIXBIT_TYPES = ("Q6_K",)
# 5-bit row octets: with their min (Q5_K, Q5_1), or signed with zero point 16 (Q5_0, formats/gguf_blocks.py)
FIVEBIT_TYPES = ("Q5_K", "Q5_1", "Q5_0")
# 2-bit row quads (Q2_K, with its min) and 3-bit row octets (Q3_K's code + 4, zero point 4): formats/vnni_lowbit.py
LOWBIT_TYPES = {"Q2_K": 2, "Q3_K": 3}
ROWS_PER_UNIT = {2: 4, 3: 8, 4: 2, 5: 8, 6: 4, 8: 1}  # rows one code row holds
# Every VNNI layout's arrays run over the rows on axis 0 (code units, scale / min rows), padded at the end
# only: a weight packed in chunks of a multiple of ROW_CHUNKS rows, concatenated on axis 0, is the weight
# packed whole (passes/gguf_passthrough.py packs large weights so; tests/formats check it per type).
ROW_CHUNKS = 64


def subscaled_vnni_packed(sub: Any, qtype: str, rows: int | None = None) -> Any:
    """The :class:`~perfx_compiler.formats.Packed` of a GGUF tensor unpacked by ``formats.ggml``
    (``SubScaled``) in the VNNI layout: codes as int4 row pairs (Q4_K), 2-bit row quads (Q2_K), 3-bit
    row octets (Q3_K, zero point 4), 6-bit row quads
    (Q6_K), 5-bit row octets (Q5_K, Q5_1 with a min; Q5_0 with zero point 16) or int4 table indices
    (IQ4_XS, IQ4_NL); superblock scales as described above, or for one-level types (sb == group: Q5_1,
    Q5_0, IQ4_NL, whose sub-scale is 1) float16 group tables. ``rows``: as for :func:`q4_vnni_packed`."""
    from perfx_compiler.formats import Packed
    from perfx_compiler.formats.vnni_lowbit import (
        pack_q2_quads,
        pack_q2_scales,
        pack_q3_octets,
        pack_q5_octets,
        pack_q6_quads,
        pack_scales_d_low,
    )

    n, k = sub.codes.shape
    g, offset = int(sub.group), sub.mins is not None
    sb = 0 if int(sub.sb) == g else int(sub.sb)
    lut = LUT_TYPES.get(qtype, "")
    bits = LOWBIT_TYPES.get(qtype) or (4 if qtype in NIBBLE_TYPES or lut else 6 if qtype in SIXBIT_TYPES and not offset
                                       else 5 if qtype in FIVEBIT_TYPES else 8)
    n2 = -(-n // ROWS_PER_UNIT[bits]) * ROWS_PER_UNIT[bits]
    if bits == 2:  # unsigned 0..3 with the min
        codes = pack_q2_quads(sub.codes)
    elif bits == 3:  # signed -4..3 -> unsigned, zero point 4 (the same correction as a min d * (4 sc), exactly)
        codes = pack_q3_octets((np.asarray(sub.codes, dtype=np.int16) + 4).astype(np.uint8))
    elif lut:
        codes = pack_q4_pairs(table_indices(sub.codes, lut))
    elif bits == 4:
        codes = pack_q4_pairs(sub.codes)
    elif bits == 6:  # signed codes -32..31 -> unsigned, zero point 32
        codes = pack_q6_quads((np.asarray(sub.codes, dtype=np.int16) + 32).astype(np.uint8))
    elif bits == 5:  # unsigned with a min as they are; signed (Q5_0: -16..15) -> zero point 16
        codes = pack_q5_octets(sub.codes if offset else (np.asarray(sub.codes, dtype=np.int16) + 16).astype(np.uint8))
    elif offset:
        codes = pack_q8_raw(sub.codes)
    else:
        codes = pack_q8_offset(np.asarray(sub.codes, dtype=np.int8))
    if sb and bits == 2:  # (Q2_K: scale and min nibbles in one byte, dmin alone in the min array)
        scale, third = pack_q2_scales(sub.scales, sub.mins, sub.d, sub.dmin, groups_padded(k, g)[1], n2)
    elif sb:
        scale = (pack_scales_d_low(sub.scales, sub.d, n2) if bits == 3  # (Q3_K: d in the values' low bits)
                 else pack_subscales(sub.scales, sub.d, k, g, n2, sb))
        third = pack_subscales(sub.mins, sub.dmin, k, g, n2, sb) if offset else None
    else:  # one level: scale d, min -dmin (both exact float16)
        scale = pad_groups(np.asarray(sub.d, dtype=np.float16), k, g, n2)
        third = pad_groups(-np.asarray(sub.dmin, dtype=np.float16), k, g, n2) if offset else None
    fam = f"q{bits}"
    arrays = [(f"_{fam}", codes), (f"_{fam}_scale", scale)] + ([(f"_{fam}_min", third)] if offset else [])

    n = rows or n

    def compute(kind: str, rows: tuple[int | None, int | None], ids_dtype: str = "int64") -> Any:
        return vnni_compute(n, k, g, bits, not offset, offset, kind, rows, ids_dtype, sb=sb, lut=lut)

    return Packed(fam, f"{qtype.lower().replace('_', '')}v", n, k, arrays, compute)


def quantize_activations(x: np.ndarray, k: int, group: int) -> np.ndarray:
    """What the VNNI kernels multiply with: each row of x [..., K] quantized to int8 per group
    (dx = amax / 127 in float32, q = rint(x * (127 / amax))) and scaled back, as float64."""
    x = np.asarray(x, dtype=np.float32)
    lead = x.shape[:-1]
    kp = padded_k(k)
    ng = -(-kp // group)
    xp = np.zeros((*lead, ng * group), dtype=np.float32)
    xp[..., :k] = x
    g = xp.reshape(*lead, ng, group)
    amax = np.abs(g).max(axis=-1, keepdims=True).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0)).astype(np.float32)
    q = np.rint((g * inv).astype(np.float32))
    dx = (amax / np.float32(127.0)).astype(np.float32)
    return (q.astype(np.float64) * dx.astype(np.float64)).reshape(*lead, ng * group)[..., :k]


def _int8_activations(x: Any, b: Any, m: Any, k: int, group: int) -> Any:
    """x rounded to int8 per group (dx = amax / 127, q = round(x * (127 / amax))), scaled back."""
    from tvm import te, tirx

    ng = -(-k // group)
    r = te.reduce_axis((0, group), name="r")
    amax = te.compute(
        (b, m, ng),
        lambda bi, i, g: te.max(
            tirx.Select(g * group + r < k, tirx.abs(x[bi, i, tirx.min(g * group + r, k - 1)]), tirx.const(0.0, "float32")),
            axis=r),
        name="amax")

    def dq(bi: Any, i: Any, c: Any) -> Any:
        a = amax[bi, i, c // group]
        inv = tirx.Select(a > tirx.const(0.0, "float32"), tirx.const(127.0, "float32") / a, tirx.const(0.0, "float32"))
        return tirx.round(x[bi, i, c] * inv) * (a / tirx.const(127.0, "float32"))

    return te.compute((b, m, k), dq, name="x_int8")


def vnni_compute(
    n: int, k: int, group: int, bits: int, symmetric: bool, offset: bool, kind: str = "matmul",
    rows: tuple[int | None, int | None] = (1, None), ids_dtype: str = "int64", prologue: str = "", eps: float = 0.0,
    epilogue: str = "", sb: int = 0, lut: str = "",
) -> Any:
    """Reference PrimFunc over the VNNI layouts, tagged ``perfx.quant`` with ``layout: vnni``. The
    matmul multiplies with x quantized to int8 per group exactly as the kernel does
    (:func:`quantize_activations`), so the tuner's check of a candidate against this function holds
    the kernel to its own semantics. ``prologue`` (matmul of one row): x is made in the same function,
    ``"add_rms_norm"`` from (a, b, w) (and ``a + b`` is returned too: (a, b, w, codes..., sum, y)),
    ``"swiglu"`` from [gate | up] (x [1, 1, 2K]): see ``passes/fuse_gemv_prologue.py``. ``epilogue``
    ``"swiglu"`` (y = [gate | up]): ``h = silu(gate) * up`` [.., N/2], returned after y for one row (the
    GEMV), alone for more (the GEMM: ``passes/fuse_gemm_swiglu.py``)."""
    from tvm import te, tirx

    kp = padded_k(k)
    _, ngp = groups_padded(k, group)
    rpu = ROWS_PER_UNIT[bits]
    nu = -(-n // rpu)
    q = te.placeholder((nu, code_row_bytes(bits, kp)), "uint8", name="q")
    sw = scale_width(k, group, 0 if bits == 3 else sb)  # (3-bit: d in the values' low bits, no d tail)
    s = te.placeholder((nu * rpu, sw), "int8" if sb else "float16", name="scale")
    z = None
    if (bits == 4 and not lut and not symmetric) or offset:  # (symmetric int4: zero point 8, no array)
        from perfx_compiler.formats.vnni_lowbit import min_width

        z = te.placeholder((nu * rpu, min_width(bits, k, sb, sw)), ("int8" if sb else "float16") if offset else "uint8",
                           name="min" if offset else "zero")

    def factor(a: Any, row: Any, g: Any) -> Any:
        """Group g's scale (or min) of the row as float32: the float16 value, or sc * d."""
        if not sb:
            return a[row, g].astype("float32")
        if bits == 3:
            from perfx_compiler.formats.vnni_lowbit import te_factor_d_low

            return te_factor_d_low(a, row, g)
        from perfx_compiler.formats.superblocks import te_f16, te_nibble_factors

        if bits == 2:  # Q2_K: scale bytes sc | m << 4, the min array dmin alone
            sc, mn = te_nibble_factors(s, z, row, g, ngp, group, sb)
            return mn if a is z else sc
        return a[row, g].astype("float32") * te_f16(a, row, ngp + 2 * (g // (sb // group)))

    def w(row: Any, col: Any) -> Any:
        g = col // group
        sc = factor(s, row, g)
        if bits == 6:
            from perfx_compiler.formats.vnni_lowbit import q6_byte

            lo = (q[row // 4, q6_byte((row % 4) // 2, col)] >> ((row % 2) * 4).astype("uint8")) & tirx.const(15, "uint8")
            hi = (q[row // 4, q6_byte(2, col)] >> ((row % 4) * 2).astype("uint8")) & tirx.const(3, "uint8")
            return ((lo | (hi << tirx.const(4, "uint8"))).astype("float32") - tirx.const(32.0, "float32")) * sc
        if bits in (2, 3, 5):
            from perfx_compiler.formats.vnni_lowbit import scalar_code

            code = scalar_code(bits, lambda u, at: q[u, at], row, col).astype("float32")
            if offset:
                return code * sc + (-factor(z, row, g) if sb else factor(z, row, g))
            return (code - tirx.const({3: 4.0, 5: 16.0}[bits], "float32")) * sc
        if bits == 8:
            if offset:  # unsigned codes as they are, then the min
                mn = -factor(z, row, g) if sb else factor(z, row, g)
                return q[row, col].astype("float32") * sc + mn
            return (q[row, col].astype("float32") - tirx.const(128.0, "float32")) * sc
        byte = q[row // 2, col]
        nib = (byte >> ((row % 2) * 4).astype("uint8")) & tirx.const(15, "uint8")
        if lut:
            return (table_value(nib, lut).astype("float32") - tirx.const(128.0, "float32")) * sc
        code = nib.astype("float32")
        if offset:
            return code * sc + (-factor(z, row, g) if sb else factor(z, row, g))
        return (code - (z[row, g].astype("float32") if z is not None else tirx.const(8.0, "float32"))) * sc

    ins = [q, s] + ([z] if z is not None else [])
    b = tirx.Var("b", "int64") if rows[0] is None else rows[0]
    m = tirx.Var("m", "int64") if rows[1] is None else rows[1]
    if kind == "dequant":
        out = te.compute((n, k), lambda row, col: w(row, col), name="dequant_vnni")
        func = te.create_prim_func([*ins, out])
    elif kind == "take":
        if ids_dtype != "int64":  # the VNNI targets (x86) index in int64; the kernels read int64 ids
            raise PerfXError(f"internal: VNNI gather with {ids_dtype} ids")
        ids = te.placeholder((b, m), "int64", name="ids")
        out = te.compute((b, m, k), lambda bi, i, c: w(ids[bi, i], c), name="take_vnni")
        func = te.create_prim_func([*ins, ids, out])
    else:
        head, x, tail = _prologue(prologue, b, m, k, eps)
        xq = _int8_activations(x, b, m, k, group)
        r = te.reduce_axis((0, k), name="k")
        out = te.compute((b, m, n), lambda bi, i, j: te.sum(xq[bi, i, r] * w(j, r), axis=r), name="matmul_vnni")
        outs = [out]
        if epilogue:
            if epilogue != "swiglu" or n % 2:
                raise PerfXError(f"internal: VNNI matmul epilogue {epilogue!r} needs swiglu and an even N")
            f = n // 2
            h = te.compute((b, m, f), lambda bi, i, c: out[bi, i, c] * tirx.sigmoid(out[bi, i, c])
                           * out[bi, i, c + f], name="swiglu")
            # the one-row GEMV returns y too (its tasks read their y rows back); more rows: h alone
            outs = [out, h] if (b, m) == (1, 1) else [h]
        func = te.create_prim_func([*head, *ins, *tail, *outs])
    return func.with_attr(QUANT_ATTR, vnni_info(n, k, group, bits, symmetric, offset, kind, prologue, eps, epilogue, sb,
                                                   lut))


def table_value(nib: Any, lut: str, dtype: str = "uint8") -> Any:
    """uint8 ``LUT_U8[lut][nib]`` of a uint8 index expression (scalar or vector) as a select chain
    (the references, dequantize and gather; the GEMV / GEMM use ``vpshufb``). ``dtype`` "int32": an int32
    index and the signed table value (``LUT_U8 - 128``; GPUs, WGSL has no 8-bit types)."""
    from tvm import tirx

    vals = LUT_U8[lut] if dtype == "uint8" else [v - 128 for v in LUT_U8[lut]]
    out = tirx.const(vals[15], dtype)
    for i in range(14, -1, -1):
        out = tirx.Select(nib == tirx.const(i, dtype), tirx.const(vals[i], dtype), out)
    return out


def lookup_isa(target: Any) -> str:
    """The 16-byte table-lookup instruction a CPU target has: "pshufb" (x86-64-v2 and later: SSSE3),
    "tbl" (AArch64), or "" (a select chain then: RISC-V, baseline x86-64)."""
    import platform

    tt = getattr(target, "tvm_target", None) or {}
    triple = str(tt.get("mtriple") or platform.machine())
    if triple.startswith(("aarch64", "arm64")):
        return "tbl"
    if triple.startswith(("x86_64", "amd64", "AMD64")) and str(tt.get("mcpu", "")) not in ("", "x86-64"):
        return "pshufb"
    return ""


def table_value_lanes(nib: Any, lane: Any, lut: str, isa: str) -> Any:
    """uint8 ``LUT_U8[lut][nib]`` inside a loop over ``lane`` vectorized by 16: one ``pshufb`` / ``tbl``
    (``isa``, :func:`lookup_isa`) of the table as a 16-byte vector (the vectorizer widens the call and
    folds the per-lane table into a constant), else :func:`table_value`'s select chain."""
    from tvm import tirx
    from tvm.script import tirx as T

    if not isa:
        return table_value(nib, lut)
    vals = [v - 256 if v > 127 else v for v in LUT_U8[lut]]
    table = tirx.const(vals[15], "int8")
    for i in range(14, -1, -1):
        table = tirx.Select(lane == i, tirx.const(vals[i], "int8"), table)
    name = "llvm.x86.ssse3.pshuf.b.128" if isa == "pshufb" else "llvm.aarch64.neon.tbl1"
    return T.reinterpret("uint8", T.call_llvm_pure_intrin("int8", name, table, T.reinterpret("int8", nib)))


def lut_bytes(lut: str, nib: Any) -> Any:
    """uint8x64: ``LUT_U8[lut][nib]`` for 64 indices 0..15 (uint8x64): one ``vpshufb`` of a constant
    register holding the 16 table bytes in each 128-bit lane (the shuffle indexes within a lane by
    the low 4 bits; an index's bit 7 would zero the byte, and nibbles never set it)."""
    from tvm import tirx
    from tvm.script import tirx as T

    vals = LUT_U8[lut]
    pos = T.Ramp(T.int32(0), 1, 64) % T.Broadcast(T.int32(16), 64)
    table = T.Broadcast(T.int8(vals[15] - 256 if vals[15] > 127 else vals[15]), 64)
    for i in range(14, -1, -1):  # constant after folding: the table register (a constant-pool load)
        v = vals[i] - 256 if vals[i] > 127 else vals[i]
        table = tirx.Select(pos == T.Broadcast(T.int32(i), 64), T.Broadcast(T.int8(v), 64), table)
    out = T.call_llvm_pure_intrin(T.llvm_lookup_intrinsic_id("llvm.x86.avx512.pshuf.b.512"), table,
                                  T.reinterpret("int8x64", nib), dtype="int8x64")
    return T.reinterpret("uint8x64", out)


def _prologue(prologue: str, b: Any, m: Any, k: int, eps: float) -> tuple[list[Any], Any, list[Any]]:
    """(inputs before the codes, x, outputs before y) of the matmul: x itself, or x made by the fused
    op (``add_rms_norm``: rmsnorm(a + b) * w as ``kernels/rms_norm.rms_norm_kernel`` computes it, the sum
    returned; ``swiglu``: silu(gate) * up)."""
    from tvm import te, tirx

    if not prologue:
        x = te.placeholder((b, m, k), "float32", name="x")
        return [x], x, []
    if (b, m) != (1, 1):
        raise PerfXError(f"internal: a fused {prologue} takes one activation row, not {b} x {m}")
    if prologue == "swiglu":
        gu = te.placeholder((1, 1, 2 * k), "float32", name="gate_up")
        x = te.compute((1, 1, k), lambda bi, i, c: gu[bi, i, c] * tirx.sigmoid(gu[bi, i, c]) * gu[bi, i, c + k],
                       name="swiglu")
        return [gu], x, []
    if prologue != "add_rms_norm":
        raise PerfXError(f"internal: unknown GEMV prologue {prologue!r}")
    a = te.placeholder((1, 1, k), "float32", name="a")
    bb = te.placeholder((1, 1, k), "float32", name="b")
    wn = te.placeholder((k,), "float32", name="norm_weight")
    ssum = te.compute((1, 1, k), lambda bi, i, c: a[bi, i, c] + bb[bi, i, c], name="residual_sum")
    r = te.reduce_axis((0, k), name="r")
    sq = te.compute((1, 1), lambda bi, i: te.sum(ssum[bi, i, r] * ssum[bi, i, r], axis=r), name="sum_sq")
    x = te.compute((1, 1, k), lambda bi, i, c: ssum[bi, i, c] / tirx.sqrt(
        sq[bi, i] * tirx.const(1.0 / k, "float32") + tirx.const(eps, "float32")) * wn[c], name="rms_norm")
    return [a, bb, wn], x, [ssum]


# CPUs whose LLVM name implies AVX-512 VNNI (a target file may also list "+avx512vnni" in mattr).
_VNNI_CPUS = ("cascadelake", "cooperlake", "icelake-client", "icelake-server", "tigerlake", "sapphirerapids",
              "emeraldrapids", "graniterapids", "znver4", "znver5")


def has_avx512_vnni(target: Any) -> bool:
    """Whether ``target`` (a TargetDescription) runs AVX-512 VNNI: its LLVM mcpu/mattr say so and,
    for a target detected as this machine (``host``), /proc/cpuinfo agrees."""
    tt = getattr(target, "tvm_target", None) or {}
    if tt.get("kind") != "llvm":
        return False
    mattr = [str(a) for a in (tt.get("mattr") or [])]
    if "-avx512vnni" in mattr:
        return False
    if "+avx512vnni" not in mattr and str(tt.get("mcpu", "")) not in _VNNI_CPUS:
        return False
    if (getattr(target, "raw", None) or {}).get("detected_as"):
        from perfx_compiler.targets import cpu_flags

        return "avx512_vnni" in cpu_flags()
    return True
