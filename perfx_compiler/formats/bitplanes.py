"""2-, 3-, 5- and 6-bit codes as bit planes, one row at a time: the float-activation CPU layout of GGUF
Q6_K, Q5_K, Q5_1, Q5_0, Q3_K and Q2_K (``formats/int8.py``'s ``code_bits``), at the file's own bits a weight where a
byte a code took 8.

A row's codes [K] (unsigned 0..2^b-1) are cut into planes: a 6-bit code is a 4-bit plane (the low
nibble) and a 2-bit plane (the high 2 bits), a 5-bit code a 4-bit plane and a 1-bit plane, a 3-bit
code a 2-bit and a 1-bit plane, a 2-bit code one 2-bit plane; 4-bit codes (one plane) are IQ4_NL /
IQ4_XS indices into ggml's non-linear table (``formats/vnni.KVALUES_IQ4NL``). A plane of
w-bit fields stores runs of ``WIDTH`` = 16 bytes; run ``c // (16 * 8/w)`` holds column c in byte
``c % 16``, field ``(c // 16) % (8/w)`` (bits w*f..w*f+w-1). So L <= 16 consecutive columns starting
at a multiple of L are L consecutive bytes shifted by one constant: one vector load, shift and mask a
plane, whatever the vector width (x86, NEON, RVV). The planes follow each other in the row (4-bit
first), each padded to whole runs: K = 576 (Q5_0) takes 5 one-bit runs for its 4.5.

Rows are independent (merged projections concatenate rows), and padding fields hold 0.
"""

from __future__ import annotations

from typing import Any

import numpy as np

WIDTH = 16  # bytes a plane run holds; vectors of at most 16 lanes read within one run
PLANES = {6: (4, 2), 5: (4, 1), 4: (4,), 3: (2, 1), 2: (2,)}  # code bits -> plane field widths, low bits first


def _span(width: int) -> int:
    """Columns one run of a plane of ``width``-bit fields covers."""
    return WIDTH * (8 // width)


def plane_offsets(k: int, bits: int) -> list[tuple[int, int]]:
    """(field width, byte offset in the row) of each plane of ``bits``-bit codes over ``k`` columns."""
    out, at = [], 0
    for width in PLANES[bits]:
        out.append((width, at))
        at += -(-k // _span(width)) * WIDTH
    return out


def row_bytes(k: int, bits: int) -> int:
    """Bytes a row of ``k`` ``bits``-bit codes takes (every plane padded to whole runs)."""
    width, at = plane_offsets(k, bits)[-1]
    return at + -(-k // _span(width)) * WIDTH


def _checked(codes: np.ndarray, bits: int, who: str) -> np.ndarray:
    """``codes`` as an array, after checking they are unsigned ``bits``-bit values with a plane layout."""
    codes = np.asarray(codes)
    if bits not in PLANES:
        raise ValueError(f"{who}: {bits}-bit codes have no plane layout ({', '.join(map(str, sorted(PLANES)))})")
    if codes.size and (int(codes.min()) < 0 or int(codes.max()) >= 1 << bits):
        raise ValueError(f"{who}: codes must be unsigned {bits}-bit values")
    return codes


def pack_planes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes [N, K] (0..2^bits-1) -> uint8 [N, row_bytes(K, bits)] (module docstring)."""
    codes = _checked(codes, bits, "pack_planes")
    n, k = codes.shape
    out = np.zeros((n, row_bytes(k, bits)), dtype=np.uint8)
    low = 0
    for width, at in plane_offsets(k, bits):
        span = _span(width)
        runs = -(-k // span)
        field = np.zeros((n, runs * span), dtype=np.uint8)
        field[:, :k] = (codes.astype(np.uint8) >> np.uint8(low)) & np.uint8((1 << width) - 1)
        field = field.reshape(n, runs, 8 // width, WIDTH)  # [row, run, field, byte]
        run_bytes = np.zeros((n, runs, WIDTH), dtype=np.uint8)
        for f in range(8 // width):
            run_bytes |= field[:, :, f, :] << np.uint8(width * f)
        out[:, at : at + runs * WIDTH] = run_bytes.reshape(n, runs * WIDTH)
        low += width
    return out


def unpack_planes(packed: np.ndarray, k: int, bits: int) -> np.ndarray:
    """uint8 [N, row_bytes(K, bits)] -> the unsigned codes uint8 [N, K] (the exact input of pack_planes)."""
    n = packed.shape[0]
    out = np.zeros((n, k), dtype=np.uint8)
    low = 0
    for width, at in plane_offsets(k, bits):
        span = _span(width)
        runs = -(-k // span)
        run_bytes = packed[:, at : at + runs * WIDTH].reshape(n, runs, 1, WIDTH)
        shifts = (np.arange(8 // width, dtype=np.uint8) * np.uint8(width)).reshape(1, 1, -1, 1)
        field = (run_bytes >> shifts) & np.uint8((1 << width) - 1)
        out |= field.reshape(n, runs * span)[:, :k] << np.uint8(low)
        low += width
    return out


def plane_code(load: Any, row: Any, base: Any, lane: Any, k: int, bits: int) -> Any:
    """int32 code of column ``base + lane`` of row ``row``; ``load(row, byte)`` reads one uint8 byte (a TE
    placeholder's or a buffer's). Kernels pass a ``base`` that is a multiple of their L <= 16 lanes and the
    vector lane as ``lane``, so the byte index is the run's start + ``base % 16`` + lane (a contiguous
    vector load) and the shift a scalar; the TE reference passes the column as ``base`` and 0."""
    from tvm import tirx

    code, low = None, 0
    for width, at in plane_offsets(k, bits):
        span = _span(width)
        # widened before the shifts: x86 has no byte-vector shifts
        byte = load(row, at + base // span * WIDTH + base % WIDTH + lane).astype("int32")
        shift = width * (base // WIDTH % (8 // width))  # the run's field of this column
        shift = shift if isinstance(shift, int) else shift.astype("int32")
        # the field lands at bit ``low`` of the code: (byte << low) >> shift, masked there
        field = ((byte << low) if low else byte) >> shift & tirx.const(((1 << width) - 1) << low, "int32")
        code = field if code is None else code | field
        low += width
    return code


# GPU layout: each plane an array of its own, fields in consecutive order (no runs). dlight's GEMV rules
# need one read per array per weight and no interleave: column c of a w-bit plane is field c % (32/w) of
# uint32 word c // (32/w), as the int4 GPU layout's eight consecutive columns a word.


def pack_word_planes(codes: np.ndarray, bits: int) -> list[np.ndarray]:
    """Unsigned codes [N, K] (0..2^bits-1) -> one uint32 [N, K * w / 32] array per plane of
    ``PLANES[bits]`` (low bits first); K * w must be a multiple of 32."""
    codes = _checked(codes, bits, "pack_word_planes")
    n, k = codes.shape
    out, low = [], 0
    for width in PLANES[bits]:
        per = 32 // width
        if k % per:
            raise ValueError(f"pack_word_planes: K={k} is not a multiple of {per} ({width}-bit fields a word)")
        field = ((codes.astype(np.uint32) >> np.uint32(low)) & np.uint32((1 << width) - 1)).reshape(n, k // per, per)
        shifts = (np.arange(per, dtype=np.uint32) * np.uint32(width)).reshape(1, 1, per)
        out.append(np.ascontiguousarray(np.bitwise_or.reduce(field << shifts, axis=2), dtype=np.uint32))
        low += width
    return out


def unpack_word_planes(planes: list[np.ndarray], k: int, bits: int) -> np.ndarray:
    """The inverse of :func:`pack_word_planes`: uint8 codes [N, K]."""
    out, low = None, 0
    for width, words in zip(PLANES[bits], planes, strict=True):
        per = 32 // width
        shifts = (np.arange(per, dtype=np.uint32) * np.uint32(width)).reshape(1, 1, per)
        field = (words[:, :, None] >> shifts) & np.uint32((1 << width) - 1)
        part = field.reshape(words.shape[0], -1)[:, :k] << np.uint32(low)
        out = part if out is None else out | part
        low += width
    return out.astype(np.uint8)


def word_plane_code(planes: list[Any], row: Any, col: Any, bits: int) -> Any:
    """(TE) int32 code of column ``col`` of row ``row`` from the uint32 plane placeholders of
    :func:`pack_word_planes`: one read of each plane."""
    from tvm import tirx

    code, low = None, 0
    for width, plane in zip(PLANES[bits], planes, strict=True):
        per = 32 // width
        shift = ((col % per) * width).astype("uint32")
        field = ((plane[row, col // per] >> shift) & tirx.const((1 << width) - 1, "uint32")).astype("int32")
        field = field << low if low else field
        code = field if code is None else code | field
        low += width
    return code
