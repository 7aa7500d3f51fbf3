"""GGUF superblock weights (``formats/ggml``: K-quants, IQ4_XS, and the one-level IQ4_NL / Q5_1) in
the float-activation CPU layouts of ``formats/int4.py`` and ``formats/int8.py``, values moved as they
are (never requantized); ``.vnni`` gives the same weight in the VNNI layout (``formats/vnni.py``).

* Q4_K: the int4 interleaved codes, min variant with superblock scales.
* Q6_K, Q3_K, IQ4_XS: int8 signed codes, superblock scales: w = code * (sc * d); Q6_K's and Q3_K's codes
  in 6- and 3-bit planes (``formats/bitplanes.py``, stored + 32 / + 4), IQ4_XS's the table values as int8.
  Q3_K's d lies in its group values' low bits (``vnni_lowbit.pack_scales_d_low``, as its VNNI layout):
  its scale array is int8 [N, K/16], no d tail.
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
another layout of the same values: codes in word planes, factors in ``formats/gpu_factors.py``'s arrays
(:func:`subscaled_packed`'s ``gpu``; docs/decisions/gguf-superblocks.md).
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


# CPU codes in formats/bitplanes.py (4: IQ4 table indices)
PLANE_BITS = {"Q6_K": 6, "Q5_K": 5, "Q5_1": 5, "Q3_K": 3, "Q2_K": 2, "IQ4_XS": 4, "IQ4_NL": 4}


def subscaled_packed(sub: Any, qtype: str, gpu: bool = False, words: bool = False) -> Any:
    """The :class:`~perfx_compiler.formats.Packed` of a ``formats.ggml`` ``SubScaled`` tensor for the
    float-activation CPU kernels (module docstring); ``.vnni()`` is :func:`~perfx_compiler.formats.vnni.subscaled_vnni_packed`.

    ``gpu``: the GPU layout (dlight's GEMV rules need one read per array per weight, and OpenCL
    devices without cl_khr_fp16 cannot read float16): codes in uint32 word planes, one array a plane
    (``bitplanes.pack_word_planes``; Q4_K: int4 lanes 1, eight consecutive columns a word), the superblock
    factors in ``formats/gpu_factors.py``'s uint32 arrays (info ``gpu_factors: true``). ``words`` (with
    ``gpu``; WGSL, no 8-bit types): marks the kernels ``words: true`` (every array is uint32 already). The
    one-level types keep their float16
    tables (IQ4_NL: the classic int8 layout, Q5_1: float16 scale and min)."""
    from perfx_compiler.formats import Packed
    from perfx_compiler.formats.bitplanes import pack_planes, pack_word_planes
    from perfx_compiler.formats.gpu_factors import GpuFactors
    from perfx_compiler.formats.int4 import Int4Format, int4_matmul_compute, pack_int4
    from perfx_compiler.formats.int8 import int8_matmul_compute, int8_packed
    from perfx_compiler.formats.vnni import (
        NIBBLE_TYPES,
        subscaled_vnni_packed,
        table_indices,
    )
    from perfx_compiler.formats.vnni_lowbit import pack_q2_scales, pack_scales_d_low

    vnni_of = sub

    def vnni() -> Any:
        return subscaled_vnni_packed(vnni_of, qtype)

    # 2-, 3-, 5- and 6-bit codes in bit planes (signed ones + 2^(bits-1)), the file's bits a weight, read
    # by the int8 kernels: per row in runs on CPUs, a uint32 array a plane on GPUs (word planes)
    code_bits = PLANE_BITS.get(qtype, 8)
    n, k = sub.codes.shape
    g, offset = int(sub.group), sub.mins is not None
    sb = 0 if int(sub.sb) == g else int(sub.sb)
    ng = k // g

    words = words and gpu
    if not sb and not offset:  # IQ4_NL: w = code * d, the classic int8 layout
        pk = int8_packed(np.asarray(sub.codes, dtype=np.int8), np.asarray(sub.d, dtype=np.float16), g, words=words,
                         code_bits=code_bits, word_planes=gpu)
        pk.vnni = vnni
        return pk
    factors = GpuFactors.of(qtype, n, k, g, sb, offset) if gpu and sb else None
    if factors is not None:  # every factor array uint32 (formats/gpu_factors.py)
        scale = third = None
    elif sb and code_bits == 2:  # Q2_K: the file's scale bytes sc | m << 4, the min array dmin alone
        scale, third = pack_q2_scales(sub.scales, sub.mins, sub.d, sub.dmin, ng, n)
    elif sb and code_bits == 3:  # Q3_K: d in the group values' low bits (as its VNNI layout), no d tail
        scale, third = pack_scales_d_low(sub.scales, sub.d, n), None
    elif sb:
        scale = pack_superblock_scales(sub.scales, sub.d, ng, n)
        third = pack_superblock_scales(sub.mins, sub.dmin, ng, n) if offset else None
    else:  # Q5_1: scale d, min -dmin (both exact float16)
        scale = np.ascontiguousarray(sub.d, dtype=np.float16)
        third = np.ascontiguousarray(-np.asarray(sub.dmin, dtype=np.float16))
    tag = qtype.lower().replace("_", "")

    def factor_arrays(prefix: str) -> list[tuple[str, np.ndarray]]:
        if factors is not None:
            packed = factors.pack(sub.scales, sub.mins, sub.d, sub.dmin)
            return [(f"{prefix}_{name}", a) for name, a in zip(factors.names(), packed, strict=True)]
        return [(f"{prefix}_scale", scale)] + ([(f"{prefix}_min", third)] if offset else [])

    if qtype in NIBBLE_TYPES and code_bits == 8:
        if not (sb and offset):
            raise ValueError(f"internal: {qtype} in the int4 layout needs superblock scales and mins")
        # GPU: 8 consecutive columns a word (lanes 1): dlight's GEMV rules split K only so
        lanes = 1 if gpu else Int4Format(g, False, True).lanes(k)
        arrays = [("_q4", pack_int4(np.asarray(sub.codes, dtype=np.uint8), lanes)), *factor_arrays("_q4")]

        def compute4(kind: str, rows: tuple[int | None, int | None], ids_dtype: str = "int64") -> Any:
            return int4_matmul_compute(n, k, g, lanes, False, kind=kind, rows=rows, offset=True,
                                       ids_dtype=ids_dtype, sb=sb, words=words, gpu_factors=factors)

        return Packed("q4", tag, n, k, arrays, compute4, vnni)
    if qtype not in PLANE_BITS:
        raise ValueError(f"internal: {qtype} has no bit-plane code layout")
    codes = np.ascontiguousarray(sub.codes, dtype=np.uint8 if offset else np.int8)
    if code_bits == 4:  # IQ4_XS: the table values' indices
        codes = table_indices(codes, "iq4nl")
    else:
        codes = codes.astype(np.int16) + (0 if offset else 1 << (code_bits - 1))
    planes = pack_word_planes(codes, code_bits) if gpu else [pack_planes(codes, code_bits)]
    arrays = [("_q8", planes[0]), *[("_q8_hi", p) for p in planes[1:]], *factor_arrays("_q8")]

    def compute8(kind: str, rows: tuple[int | None, int | None], ids_dtype: str = "int64") -> Any:
        return int8_matmul_compute(n, k, g, kind=kind, rows=rows, ids_dtype=ids_dtype, offset=offset, sb=sb,
                                   words=words, gpu_factors=factors, code_bits=code_bits, word_planes=gpu)

    return Packed("q8", tag, n, k, arrays, compute8, vnni)
