"""GGUF superblock weights (``formats/ggml``: K-quants, IQ4_XS, and the one-level IQ4_NL / Q5_1) in
the float-activation CPU layouts of ``formats/int4.py`` and ``formats/int8.py``, values moved as they
are (never requantized); ``.vnni`` gives the same weight in the VNNI layout (``formats/vnni.py``).

* Q4_K: the int4 interleaved codes, min variant with superblock scales.
* Q6_K, Q3_K, IQ4_XS: int8 signed codes, superblock scales: w = code * (sc * d); Q6_K's and Q3_K's codes
  in 6- and 3-bit planes (``formats/bitplanes.py``, stored + 32 / + 4), IQ4_XS's the table values as int8.
* Q5_K, Q2_K: int8 offset variant (5- / 2-bit plane codes and a min), superblock scales:
  w = code * (sc * d) - (m * dmin); Q2_K's scale bytes are the file's sc | m << 4 (then d), its min
  array dmin alone (``vnni_lowbit.pack_q2_scales``, as the VNNI layout).
* Q5_1 (one level, sc = m = 1): int8 offset variant (5-bit plane codes) with float16 group tables
  scale = d, min = -dmin.
* IQ4_NL (one level, sc = 1): the classic int8 format (float16 scale = d: GGUF Q8_0's layout), and IQ4_XS
  with superblock scales; on CPUs their codes are 4-bit indices into the table (one plane).

Superblock scale arrays are int8 [N, NG + 2 * K/sb]: the group values (sc, or m), then the row's
superblock factor (d, or dmin) as little-endian float16 bytes; the kernels read the float16 through a
view of the same buffer, as the VNNI kernels do. Every product (sc * d, m * dmin, code * (sc * d)) is
exact in float32, so dequantize and gather reproduce ``ggml.weights`` bit for bit. GPU targets take
another layout of the same values (Q2_K and Q3_K as int4 codes there, Q3_K's zero as a min) (:func:`subscaled_packed`'s ``gpu``; docs/decisions/gguf-superblocks.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def pack_superblock_scales(values: np.ndarray, d: np.ndarray, groups: int, rows: int) -> np.ndarray:
    """int8 group values [N, K/G] and float16 superblock factors [N, K/sb] -> int8 [rows, groups + 2 K/sb]:
    the values in columns 0..K/G-1 (zero-padded to ``groups`` columns, rows past N zero), then d's bytes."""
    n = values.shape[0]
    out = np.zeros((rows, groups + 2 * d.shape[1]), dtype=np.int8)
    out[:n, : values.shape[1]] = values
    out[: d.shape[0], groups:] = np.ascontiguousarray(d, dtype="<f2").view(np.int8)
    return out


def te_f16(a: Any, row: Any, at: Any) -> Any:
    """(TE reference) the little-endian float16 in bytes ``at``, ``at + 1`` of an int8 array's row, as float32."""
    from tvm import tirx

    d16 = a[row, at].astype("uint8").astype("uint16") | (a[row, at + 1].astype("uint8").astype("uint16") << 8)
    return tirx.reinterpret("float16", d16).astype("float32")


def te_factor(a: Any, row: Any, g: Any, groups: int, group: int, sb: int) -> Any:
    """(TE reference) group ``g``'s factor sc * d of an int8 superblock scale array as float32."""
    return a[row, g].astype("float32") * te_f16(a, row, groups + 2 * (g // (sb // group)))


def te_nibble_factors(s: Any, z: Any, row: Any, g: Any, groups: int, group: int, sb: int) -> tuple[Any, Any]:
    """(TE reference, Q2_K: ``formats/vnni_lowbit.pack_q2_scales``) group ``g``'s (sc * d, m * dmin) from
    its scale byte sc | m << 4, d in the scale row's tail and dmin alone in the min array ``z``."""
    from perfx_compiler.formats.vnni_lowbit import group_nibble

    sup = 2 * (g // (sb // group))
    return (group_nibble(s[row, g], False).astype("float32") * te_f16(s, row, groups + sup),
            group_nibble(s[row, g], True).astype("float32") * te_f16(z, row, sup))


def d_words(d: np.ndarray) -> np.ndarray:
    """float16 superblock factors [N, K/sb] -> uint32 [N, K/sb]: each one's float32 bits (exact)."""
    return np.ascontiguousarray(np.asarray(d, dtype=np.float16).astype(np.float32)).view(np.uint32)


def byte_words(a: np.ndarray) -> np.ndarray:
    """int8 / uint8 [N, C] -> uint32 [N, ceil(C/4)]: the bytes as they are, column c in byte c % 4 of word
    c // 4 (little-endian, the last word zero-padded): ``formats.int4.zero_words`` of any byte array."""
    from perfx_compiler.formats.int4 import zero_words

    return zero_words(np.ascontiguousarray(a).view(np.uint8))


def te_byte(a: Any, row: Any, col: Any, words: bool, signed: bool) -> Any:
    """(TE reference) byte ``col`` of row ``row`` as int32: from an 8-bit array, or from its uint32 words."""
    from tvm import tirx

    if not words:
        return a[row, col].astype("int32")
    byte = ((a[row, col // 4] >> ((col % 4) * 8).astype("uint32")) & tirx.const(255, "uint32")).astype("int32")
    return (byte ^ 128) - 128 if signed else byte  # sign-extend without 8-bit types


def te_factor_apart(a: Any, ad: Any, row: Any, g: Any, group: int, sb: int, words: bool = False) -> Any:
    """(TE reference, GPU layout) group ``g``'s factor sc * d: sc from the int8 group values ``a`` (or
    their words), d the float32 bits in uint32 ``ad`` [N, K/sb] (:func:`d_words`). One read per array
    per weight, as dlight's GEMV rules need, and no float16 (OpenCL without cl_khr_fp16, WGSL)."""
    from tvm import tirx

    d = tirx.reinterpret("float32", ad[row, g // (sb // group)])
    return te_byte(a, row, g, words, True).astype("float32") * d


# CPU codes in formats/bitplanes.py (4: IQ4 table indices)
PLANE_BITS = {"Q6_K": 6, "Q5_K": 5, "Q5_1": 5, "Q3_K": 3, "Q2_K": 2, "IQ4_XS": 4, "IQ4_NL": 4}


def subscaled_packed(sub: Any, qtype: str, gpu: bool = False, words: bool = False) -> Any:
    """The :class:`~perfx_compiler.formats.Packed` of a ``formats.ggml`` ``SubScaled`` tensor for the
    float-activation CPU kernels (module docstring); ``.vnni()`` is :func:`~perfx_compiler.formats.vnni.subscaled_vnni_packed`.

    ``gpu``: the GPU layout (dlight's GEMV rules need one read per array per weight, and OpenCL
    devices without cl_khr_fp16 cannot read float16): each superblock scale (min) array is split into
    the int8 group values [N, K/G] (``_scale`` / ``_min``) and the superblock d (dmin) as float32 bits,
    uint32 [N, K/sb] (``_scale_d`` / ``_min_d``, right after each); info ``d_words: true``; int4 codes
    with lanes 1 (eight consecutive columns a word). ``words``
    (with ``gpu``; WGSL, no 8-bit types): every 8-bit array (int8 / uint8 codes, group values) as
    uint32 words (:func:`byte_words`); info ``words: true``. The one-level types keep their float16
    tables (IQ4_NL: the classic int8 layout, Q5_1: float16 scale and min)."""
    from perfx_compiler.formats import Packed
    from perfx_compiler.formats.bitplanes import pack_planes
    from perfx_compiler.formats.int4 import Int4Format, int4_matmul_compute, pack_int4
    from perfx_compiler.formats.int8 import int8_matmul_compute, int8_packed
    from perfx_compiler.formats.vnni import (
        NIBBLE_TYPES,
        SIGNED_NIBBLE_TYPES,
        signed_nibbles_with_min,
        subscaled_vnni_packed,
        table_indices,
    )
    from perfx_compiler.formats.vnni_lowbit import pack_q2_scales

    vnni_of = sub

    def vnni() -> Any:
        return subscaled_vnni_packed(vnni_of, qtype)

    # CPU: 2-, 3-, 5- and 6-bit codes in bit planes (signed ones + 2^(bits-1)), the file's bits a
    # weight, read by the int8 kernels; GPUs read a byte (int4: a nibble) a code
    code_bits = 8 if gpu else PLANE_BITS.get(qtype, 8)
    if qtype in SIGNED_NIBBLE_TYPES and code_bits == 8:
        sub = signed_nibbles_with_min(sub, SIGNED_NIBBLE_TYPES[qtype])
    n, k = sub.codes.shape
    g, offset = int(sub.group), sub.mins is not None
    sb = 0 if int(sub.sb) == g else int(sub.sb)
    ng = k // g

    words = words and gpu
    if not sb and not offset:  # IQ4_NL: w = code * d, the classic int8 layout
        pk = int8_packed(np.asarray(sub.codes, dtype=np.int8), np.asarray(sub.d, dtype=np.float16), g, words=words,
                         code_bits=code_bits)
        pk.vnni = vnni
        return pk
    split = gpu and bool(sb)
    if split:  # (group values, d bits) per array
        def apart(values: np.ndarray, d: np.ndarray) -> list[np.ndarray]:
            v = np.ascontiguousarray(values, dtype=np.int8)
            return [byte_words(v) if words else v, d_words(d)]

        scale = apart(sub.scales, sub.d)
        third = apart(sub.mins, sub.dmin) if offset else None
    elif sb and code_bits == 2:  # Q2_K: the file's scale bytes sc | m << 4, the min array dmin alone
        scale, third = pack_q2_scales(sub.scales, sub.mins, sub.d, sub.dmin, ng, n)
    elif sb:
        scale = pack_superblock_scales(sub.scales, sub.d, ng, n)
        third = pack_superblock_scales(sub.mins, sub.dmin, ng, n) if offset else None
    else:  # Q5_1: scale d, min -dmin (both exact float16)
        scale = np.ascontiguousarray(sub.d, dtype=np.float16)
        third = np.ascontiguousarray(-np.asarray(sub.dmin, dtype=np.float16))
    tag = qtype.lower().replace("_", "")

    def named(prefix: str, what: str, a: Any) -> list[tuple[str, np.ndarray]]:
        return [(f"{prefix}_{what}", a[0]), (f"{prefix}_{what}_d", a[1])] if split else [(f"{prefix}_{what}", a)]

    if qtype in NIBBLE_TYPES and code_bits == 8:
        if not (sb and offset):
            raise ValueError(f"internal: {qtype} in the int4 layout needs superblock scales and mins")
        # GPU: 8 consecutive columns a word (lanes 1): dlight's GEMV rules split K only so
        lanes = 1 if gpu else Int4Format(g, False, True).lanes(k)
        arrays = [("_q4", pack_int4(np.asarray(sub.codes, dtype=np.uint8), lanes)), *named("_q4", "scale", scale),
                  *named("_q4", "min", third)]

        def compute4(kind: str, rows: tuple[int | None, int | None], ids_dtype: str = "int64") -> Any:
            return int4_matmul_compute(n, k, g, lanes, False, kind=kind, rows=rows, offset=True,
                                       ids_dtype=ids_dtype, sb=sb, words=words, d_words=split)

        return Packed("q4", tag, n, k, arrays, compute4, vnni)
    codes = np.ascontiguousarray(sub.codes, dtype=np.uint8 if offset else np.int8)
    if code_bits == 4:  # IQ4_XS: the table values' indices
        codes = pack_planes(table_indices(codes, "iq4nl"), 4)
    elif code_bits != 8:
        codes = pack_planes(codes.astype(np.int16) + (0 if offset else 1 << (code_bits - 1)), code_bits)
    if words:
        codes = byte_words(codes)
    arrays = [("_q8", codes), *named("_q8", "scale", scale)] + (named("_q8", "min", third) if offset else [])

    def compute8(kind: str, rows: tuple[int | None, int | None], ids_dtype: str = "int64") -> Any:
        return int8_matmul_compute(n, k, g, kind=kind, rows=rows, ids_dtype=ids_dtype, offset=offset, sb=sb,
                                   words=words, d_words=split, code_bits=code_bits)

    return Packed("q8", tag, n, k, arrays, compute8, vnni)
