"""The sub-byte code rows of the VNNI kernels (``formats/vnni.py`` describes the 5- and 6-bit ones; GGUF Q6_K,
Q5_K / Q5_1 / Q5_0, Q3_K, Q2_K): their packing, the byte offsets the kernels read them at (``part_byte``,
``q6_byte``), and the per-row code unpacking the kernels share for the 2-, 3- and 5-bit layouts.

* 2-bit (``q2v``, GGUF Q2_K with its min): codes uint8 [ceil(N/4), KP], one code row per quad of rows:
  byte k holds the four rows' codes of column k (row 4q+r in bits 2r..2r+1): 2 bits a weight.
* 3-bit (``q3v``, GGUF Q3_K as ``code + 4``, zero point 4): codes uint8 [ceil(N/8), 3 * KP], one code
  row per octet of rows, in three parts per 64-column step, side by side (``part_byte``: one
  forward stream): two 2-bit quad parts of the codes' low 2 bits (rows 8o..8o+3, then 8o+4..8o+7, as
  ``q2v``), then one part whose byte holds the eight rows' third bits of its column (row 8o+r in bit
  r): 3 bits a weight. Row r's codes: ``(quad >> 2 (r % 4)) & 3 | ((hb >> r) & 1) << 2``.
* Q2_K's scales (2-bit layout): a group's 4-bit scale and 4-bit min share one byte (``sc | m << 4``)
  of the scale array [N2, NGP + 2 K/256], whose row then holds the superblocks' d as float16 bytes; the
  min array [N2, 2 K/256] holds only the superblocks' dmin. 2.625 bits a weight, the file's own size
  (an int8 scale array and an int8 min array took 3.125). Readers: :func:`group_nibble`.
* Q3_K's scales (3-bit layout): d in the low bits of the group values, see :func:`pack_scales_d_low`.

Padding rows and columns hold code 0.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from perfx_compiler.formats.vnni import STEP, pack_q4_pairs, padded_k, unpack_q4_pairs

Q6_CHUNK = 256  # columns of a 6-bit lane-group chunk: 16 groups of 16, one a lane, over 4 steps


def lane_groups(bits: int) -> bool:
    """Whether ``bits``-bit codes are stored in lane-group order (``q6_lane_order``): then a GEMV lane sums
    one group over a chunk in int32 and scales once a chunk, so its float accumulator is not split."""
    return bits == 6


def q6_lane_order(codes: np.ndarray) -> np.ndarray:
    """[..., KP] columns in natural order -> the 6-bit layout's order: in each 256-column chunk, step s
    (0..3) holds in its lane l (4 bytes) columns 4s..4s+3 of group l (``q6_byte``)."""
    lead, kp = codes.shape[:-1], codes.shape[-1]
    if kp % Q6_CHUNK:
        raise ValueError(f"the 6-bit layout takes rows of whole {Q6_CHUNK}-column chunks (got {kp})")
    c = codes.reshape(*lead, kp // Q6_CHUNK, 16, 4, 4)  # chunk, group l, step s, byte j
    return np.ascontiguousarray(np.swapaxes(c, -3, -2).reshape(*lead, kp))


def q6_natural_order(codes: np.ndarray) -> np.ndarray:
    """The inverse of :func:`q6_lane_order`."""
    lead, kp = codes.shape[:-1], codes.shape[-1]
    c = codes.reshape(*lead, kp // Q6_CHUNK, 4, 16, 4)  # chunk, step s, lane l, byte j
    return np.ascontiguousarray(np.swapaxes(c, -3, -2).reshape(*lead, kp))


def interleave_parts(parts: list[np.ndarray]) -> np.ndarray:
    """P code parts [units, KP] -> [units, P * KP], stored 64-column step by step with the P parts of a
    step side by side (``step_part_byte``): a unit's codes are one forward stream."""
    units, kp = parts[0].shape
    return np.ascontiguousarray(np.stack([p.reshape(units, kp // STEP, STEP) for p in parts], axis=2)
                                .reshape(units, len(parts) * kp))


def split_parts(packed: np.ndarray, count: int) -> list[np.ndarray]:
    """The inverse of :func:`interleave_parts`: ``count`` parts [units, KP]."""
    units, kp = packed.shape[0], packed.shape[1] // count
    steps = packed.reshape(units, kp // STEP, count, STEP)
    return [np.ascontiguousarray(steps[:, :, j].reshape(units, kp)) for j in range(count)]


def pack_q6_quads(codes: np.ndarray) -> np.ndarray:
    """Unsigned 6-bit codes [N, K] (0..63) -> uint8 [ceil(N/4), 3 * KP] (see the module docstring)."""
    n, k = codes.shape
    kp, n4 = padded_k(k), -(-n // 4) * 4
    c = np.zeros((n4, kp), dtype=np.uint8)
    c[:n, :k] = codes
    c = q6_lane_order(c)
    lo = pack_q4_pairs(c & np.uint8(15)).reshape(n4 // 4, 2 * kp)
    hi = c >> np.uint8(4)
    high = hi[0::4] | (hi[1::4] << np.uint8(2)) | (hi[2::4] << np.uint8(4)) | (hi[3::4] << np.uint8(6))
    return interleave_parts([lo[:, :kp], lo[:, kp:], high])


def unpack_q6_quads(packed: np.ndarray, n: int, k: int) -> np.ndarray:
    q, kp = packed.shape[0], packed.shape[1] // 3
    lo01, lo23, high = split_parts(packed, 3)
    lo = unpack_q4_pairs(np.stack([lo01, lo23], axis=1).reshape(-1, kp), q * 4, kp)
    hi = np.stack([(high >> np.uint8(2 * r)) & np.uint8(3) for r in range(4)], axis=1).reshape(-1, kp)
    return q6_natural_order(lo | (hi << np.uint8(4)))[:n, :k]


def pack_q5_octets(codes: np.ndarray) -> np.ndarray:
    """Unsigned 5-bit codes [N, K] (0..31) -> uint8 [ceil(N/8), 5 * KP] (see the module docstring)."""
    n, k = codes.shape
    kp, n8 = padded_k(k), -(-n // 8) * 8
    c = np.zeros((n8, kp), dtype=np.uint8)
    c[:n, :k] = codes
    lo = pack_q4_pairs(c & np.uint8(15)).reshape(n8 // 8, 4, kp)
    hi = (c >> np.uint8(4)) & np.uint8(1)
    high = np.zeros((n8 // 8, kp), dtype=np.uint8)
    for r in range(8):
        high |= hi[r::8] << np.uint8(r)
    return interleave_parts([*(lo[:, j] for j in range(4)), high])


def unpack_q5_octets(packed: np.ndarray, n: int, k: int) -> np.ndarray:
    kp = packed.shape[1] // 5
    *pairs, high = split_parts(packed, 5)
    lo = unpack_q4_pairs(np.stack(pairs, axis=1).reshape(-1, kp), packed.shape[0] * 8, kp)
    hi = np.stack([(high >> np.uint8(r)) & np.uint8(1) for r in range(8)], axis=1).reshape(-1, kp)
    return np.ascontiguousarray((lo | (hi << np.uint8(4)))[:n, :k])


def step_part_byte(parts: int, step: Any, part: Any) -> Any:
    """Offset in a code row of ``parts`` interleaved parts (:func:`interleave_parts`: 6-bit quads, 5- and
    3-bit octets) of stored 64-column step ``step``'s ``part``. Ints or TIR expressions."""
    return step * (parts * STEP) + part * STEP


def part_byte(parts: int, part: Any, col: Any) -> Any:
    """Offset of column ``col``'s byte of ``part`` in such a code row (stored in column order: 5-, 3-bit)."""
    return step_part_byte(parts, col // STEP, part) + col % STEP


def q6_step_byte(step: Any, part: Any) -> Any:
    """Offset in a 6-bit quad's code row of stored 64-column step ``step``'s ``part`` (0, 1: the low
    nibbles of rows 4q, 4q+1 / 4q+2, 4q+3; 2: the four rows' high bits): the kernels read stored steps
    in order. Ints or TIR expressions."""
    return step_part_byte(3, step, part)


def q6_byte(part: Any, col: Any) -> Any:
    """Offset in a 6-bit quad's code row of (natural) column ``col``'s byte of ``part``: stored step
    4 (col // 256) + (col % 16) // 4, lane (col % 256) // 16 (the group), byte col % 4. Ints or TIR
    expressions."""
    return q6_step_byte((col // Q6_CHUNK) * 4 + (col % 16) // 4, part) + ((col % Q6_CHUNK) // 16) * 4 + col % 4


def _padded(codes: np.ndarray, rows: int) -> np.ndarray:
    n, k = codes.shape
    c = np.zeros((-(-n // rows) * rows, padded_k(k)), dtype=np.uint8)
    c[:n, :k] = codes
    return c


def pack_q2_quads(codes: np.ndarray) -> np.ndarray:
    """Unsigned 2-bit codes [N, K] (0..3) -> uint8 [ceil(N/4), KP] (see the module docstring)."""
    c = _padded(codes, 4)
    out = np.zeros((c.shape[0] // 4, c.shape[1]), dtype=np.uint8)
    for r in range(4):
        out |= (c[r::4] & np.uint8(3)) << np.uint8(2 * r)
    return out


def unpack_q2_quads(packed: np.ndarray, n: int, k: int) -> np.ndarray:
    q = np.stack([(packed >> np.uint8(2 * r)) & np.uint8(3) for r in range(4)], axis=1).reshape(-1, packed.shape[1])
    return np.ascontiguousarray(q[:n, :k])


def pack_q3_octets(codes: np.ndarray) -> np.ndarray:
    """Unsigned 3-bit codes [N, K] (0..7) -> uint8 [ceil(N/8), 3 * KP] (see the module docstring)."""
    c = _padded(codes, 8)
    kp = c.shape[1]
    lo = pack_q2_quads(c & np.uint8(3)).reshape(-1, 2, kp)
    high = np.zeros((c.shape[0] // 8, kp), dtype=np.uint8)
    for r in range(8):
        high |= ((c[r::8] >> np.uint8(2)) & np.uint8(1)) << np.uint8(r)
    return interleave_parts([lo[:, 0], lo[:, 1], high])


def unpack_q3_octets(packed: np.ndarray, n: int, k: int) -> np.ndarray:
    kp = packed.shape[1] // 3
    quads0, quads1, high = split_parts(packed, 3)
    lo = unpack_q2_quads(np.stack([quads0, quads1], axis=1).reshape(-1, kp), packed.shape[0] * 8, kp)
    hi = np.stack([(high >> np.uint8(r)) & np.uint8(1) for r in range(8)], axis=1).reshape(-1, kp)
    return np.ascontiguousarray((lo | (hi << np.uint8(2)))[:n, :k])


def scalar_code(bits: int, q: Any, row: Any, col: Any) -> Any:
    """uint8 code (row, col) of the 2-, 3- or 5-bit layout; ``q(unit, byte)`` loads one code byte (a TE
    placeholder's or a buffer's)."""
    from tvm import tirx

    def part(unit: Any, at: Any, shift: Any, mask: int) -> Any:
        return (q(unit, at) >> shift.astype("uint8")) & tirx.const(mask, "uint8")

    if bits == 2:
        return part(row // 4, col, (row % 4) * 2, 3)
    if bits == 3:
        lo = part(row // 8, part_byte(3, (row % 8) // 4, col), (row % 4) * 2, 3)
        return lo | (part(row // 8, part_byte(3, 2, col), row % 8, 1) << tirx.const(2, "uint8"))
    lo = part(row // 8, part_byte(5, (row % 8) // 2, col), (row % 2) * 4, 15)
    return lo | (part(row // 8, part_byte(5, 4, col), row % 8, 1) << tirx.const(4, "uint8"))


def code_exponent(bits: int, r: Any) -> Any:
    """e of :func:`unit_codes`' ``scaled`` codes of row r (2, 3 bits): they are code * 2^e (e <= 4)."""
    from tvm import tirx

    return 2 * (r % 4) - (tirx.Select(r % 4 == 3, 2, 0) if bits == 3 else 0)


def code_scale(bits: int, r: Any) -> Any:
    """float32 2^-e: what the GEMV's row scales take for the ``scaled`` codes of row r (exact)."""
    from tvm.script import tirx as T

    return T.float32(1) / T.Cast("float32", T.shift_left(T.int32(1), code_exponent(bits, r)))


def unit_codes(bits: int, Q8: Any, unit: Any, col: Any, r: Any, scaled: bool = False) -> Any:  # noqa: N803
    """uint8x64: the codes of row r of code row ``unit`` (a quad for 2 bits, an octet for 3 and 5),
    columns col..col+63: the row's bits of its low-bits row (2 / 2 / 4 of them), with (3, 5 bits) bit
    r of the high-bits row on top. ``scaled`` (2, 3 bits): code * 2^e instead (:func:`code_exponent`), the
    row's 2-bit field masked where it lies (no shift; row 3 of a quad two bits down to leave room for the
    third bit): one shift fewer a row, the GEMV folds 2^-e into the row's scales (exact). ``r`` must fold
    to a constant once the loops unroll (no byte-vector shift by a variable count)."""
    from tvm.script import tirx as T

    def part(at: Any, shift: Any, mask: Any) -> Any:
        return T.shift_right(Q8.vload([unit, at], "uint8x64"), T.Broadcast(T.Cast("uint8", shift), 64)) & T.Broadcast(
            T.Cast("uint8", mask), 64)

    if scaled and bits in (2, 3):
        e = code_exponent(bits, r)
        lo = part(col if bits == 2 else part_byte(3, r // 4, col), 2 * (r % 4) - e, T.shift_left(T.int32(3), e))
        if bits == 2:
            return lo
        hb = T.shift_left(T.shift_right(Q8.vload([unit, part_byte(3, 2, col)], "uint8x64"), T.Broadcast(
            T.Cast("uint8", T.max(r - e - 2, 0)), 64)), T.Broadcast(T.Cast("uint8", T.max(e + 2 - r, 0)), 64))
        return lo | (hb & T.Broadcast(T.Cast("uint8", T.shift_left(T.int32(4), e)), 64))
    if bits == 2:
        return part(col, 2 * r, 3)
    lb = 2 if bits == 3 else 4  # bits of a code in its low-bits part
    rows = 8 // lb  # rows a low-bits part holds
    lo = part(part_byte(lb + 1, r // rows, col), lb * (r % rows), (1 << lb) - 1)
    return lo | T.shift_left(part(part_byte(lb + 1, lb, col), r, 1), T.Broadcast(T.uint8(lb), 64))


def pack_q2_scales(scales: np.ndarray, mins: np.ndarray, d: np.ndarray, dmin: np.ndarray, groups: int,
                   rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Q2_K's 4-bit group scales and mins [N, K/16] and float16 d, dmin [N, K/256] -> (scale array int8
    [rows, groups + 2 K/256]: ``sc | m << 4`` then d's bytes; min array int8 [rows, 2 K/256]: dmin's bytes)."""
    from perfx_compiler.formats.superblocks import pack_superblock_scales

    sc, m = np.asarray(scales, np.int16), np.asarray(mins, np.int16)
    if min(sc.min(initial=0), m.min(initial=0)) < 0 or max(sc.max(initial=0), m.max(initial=0)) > 15:
        raise ValueError("pack_q2_scales: group scales and mins must be 4-bit (0..15)")
    both = (sc | (m << 4)).astype(np.uint8).view(np.int8)
    dm = np.zeros((rows, 2 * dmin.shape[1]), dtype=np.int8)
    dm[: dmin.shape[0]] = np.ascontiguousarray(dmin, dtype="<f2").view(np.int8)
    return pack_superblock_scales(both, d, groups, rows), dm


def min_width(bits: int, k: int, sb: int, scale_width: int) -> int:
    """Columns of a superblock layout's min array: Q2_K's (2-bit) holds only dmin's bytes, the others
    are as wide as the scale array."""
    return 2 * (k // sb) if bits == 2 and sb else scale_width


def group_nibble(v: Any, high: bool, lanes: int = 1) -> Any:
    """int8 (x ``lanes``) Q2_K group value of scale bytes ``sc | m << 4``: m (``high``) or sc, 0..15."""
    from tvm.script import tirx as T

    def c(x: int) -> Any:
        return T.int8(x) if lanes == 1 else T.Broadcast(T.int8(x), lanes)

    return (T.shift_right(v, c(4)) if high else v) & c(15)


# Q3_K's scale array (3-bit layout): int8 [N2, K/16], each 6-bit group value (-32..31) times 4 (bits
# 2..7, so the byte with its low 2 bits cleared is 4 sc, sign and all), and each superblock's float16 d
# in the low 2 bits of its first 8 values (bits 2i..2i+1 of d in value i): no d tail, 0.5 bits a weight
# where the int8 values and d took 0.5625 (Q3_K: 3.5 bits a weight, the file 3.4375). The readers take
# (4 sc) * (d / 4): exact, as sc * d.
D_LOW_MASK = 0x0303030303030303  # the low 2 bits of 8 bytes: d's 16 bits


def pack_scales_d_low(values: np.ndarray, d: np.ndarray, rows: int) -> np.ndarray:
    """6-bit int8 group values [N, K/16] and float16 d [N, K/256] -> int8 [rows, K/16] (above)."""
    n, ng = values.shape
    if ng != 16 * d.shape[1] or ng < 16 or not (-32 <= values.min(initial=0) and values.max(initial=0) <= 31):
        raise ValueError("pack_scales_d_low: 16 six-bit group values per superblock, K >= 256")
    out = np.zeros((rows, ng), dtype=np.uint8)
    out[:n] = values.astype(np.uint8) << np.uint8(2)
    d16 = np.ascontiguousarray(d, dtype="<f2").view(np.uint16)
    for i in range(8):
        out[:n, i::16] |= ((d16 >> np.uint16(2 * i)) & np.uint16(3)).astype(np.uint8)
    return out.view(np.int8)


def scale_times_4(v: Any, lanes: int = 1) -> Any:
    """int8 (x ``lanes``) 4 sc of scale bytes: the low 2 bits (d's) cleared (``lanes`` 0: v as it is)."""
    from tvm.script import tirx as T

    if lanes == 0:
        return v
    return v & (T.int8(-4) if lanes == 1 else T.Broadcast(T.int8(-4), lanes))


def d_of_word(word: Any) -> Any:
    """float32 d / 4 of a superblock from the uint64 of its first 8 scale bytes: the 2-bit fields folded
    together by three shift-or-mask steps (8-bit stride -> 4 bits a 16-bit lane -> 8 bits a 32-bit half
    -> 16 bits), on any ISA (``pext`` does it in one on x86 with BMI2: no faster here, stop 42)."""
    from tvm.script import tirx as T

    w = word & T.uint64(D_LOW_MASK)
    w = (w | T.shift_right(w, T.uint64(6))) & T.uint64(0x000F000F000F000F)
    w = (w | T.shift_right(w, T.uint64(12))) & T.uint64(0x000000FF000000FF)
    w = (w | T.shift_right(w, T.uint64(24))) & T.uint64(0xFFFF)
    return T.Cast("float32", T.reinterpret("float16", T.Cast("uint16", w))) * T.float32(0.25)


def te_factor_d_low(a: Any, row: Any, g: Any) -> Any:
    """(TE reference) group ``g``'s factor sc * d of a scale array laid out by :func:`pack_scales_d_low`,
    as (4 sc) * (d / 4): exact, as sc * d."""
    return scale_times_4(a[row, g]).astype("float32") * d_of_bytes(lambda r, c: a[r, c], row, g)


def d_of_bytes(load: Any, row: Any, g: Any) -> Any:
    """float32 d / 4 of group g's superblock from its first 8 scale bytes (``load(row, col)``; scalar)."""
    from tvm import tirx

    first = g // 16 * 16
    d16 = tirx.const(0, "uint16")
    for i in range(8):
        d16 = d16 | ((load(row, first + i).astype("uint8") & tirx.const(3, "uint8")).astype("uint16")
                     << tirx.const(2 * i, "uint16"))
    return tirx.reinterpret("float16", d16).astype("float32") * tirx.const(0.25, "float32")
