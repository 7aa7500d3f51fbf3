"""GGUF superblock weights (``formats/ggml``: K-quants, IQ4_XS, and the one-level IQ4_NL / Q5_1) in
the float-activation CPU layouts of ``formats/int4.py`` and ``formats/int8.py``, values moved as they
are (never requantized); ``.vnni`` gives the same weight in the VNNI layout (``formats/vnni.py``).

* Q4_K, Q2_K, Q3_K (``vnni.NIBBLE_TYPES``; Q3_K's signed codes + 4, the zero as a min): the int4
  interleaved codes, min variant with superblock scales.
* Q6_K, IQ4_XS: int8 signed codes, superblock scales: w = code * (sc * d).
* Q5_K: int8 offset variant (uint8 codes and a min), superblock scales: w = code * (sc * d) - (m * dmin).
* Q5_1 (one level, sc = m = 1): int8 offset variant with float16 group tables scale = d, min = -dmin.
* IQ4_NL (one level, sc = 1): the classic int8 format (float16 scale = d: GGUF Q8_0's layout).

Superblock scale arrays are int8 [N, NG + 2 * K/sb]: the group values (sc, or m), then the row's
superblock factor (d, or dmin) as little-endian float16 bytes; the kernels read the float16 through a
view of the same buffer, as the VNNI kernels do. Every product (sc * d, m * dmin, code * (sc * d)) is
exact in float32, so dequantize and gather reproduce ``ggml.weights`` bit for bit.
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


def te_factor(a: Any, row: Any, g: Any, groups: int, group: int, sb: int) -> Any:
    """(TE reference) group ``g``'s factor sc * d of an int8 superblock scale array as float32."""
    from tvm import tirx

    at = groups + 2 * (g // (sb // group))
    d16 = a[row, at].astype("uint8").astype("uint16") | (a[row, at + 1].astype("uint8").astype("uint16") << 8)
    return a[row, g].astype("float32") * tirx.reinterpret("float16", d16).astype("float32")


def subscaled_packed(sub: Any, qtype: str) -> Any:
    """The :class:`~perfx_compiler.formats.Packed` of a ``formats.ggml`` ``SubScaled`` tensor for the
    float-activation CPU kernels (module docstring); ``.vnni()`` is :func:`~perfx_compiler.formats.vnni.subscaled_vnni_packed`."""
    from perfx_compiler.formats import Packed
    from perfx_compiler.formats.int4 import Int4Format, int4_matmul_compute, pack_int4
    from perfx_compiler.formats.int8 import int8_matmul_compute, int8_packed
    from perfx_compiler.formats.vnni import (
        NIBBLE_TYPES,
        SIGNED_NIBBLE_TYPES,
        signed_nibbles_with_min,
        subscaled_vnni_packed,
    )

    def vnni() -> Any:
        return subscaled_vnni_packed(sub, qtype)

    if qtype in SIGNED_NIBBLE_TYPES:
        sub = signed_nibbles_with_min(sub, SIGNED_NIBBLE_TYPES[qtype])
    n, k = sub.codes.shape
    g, offset = int(sub.group), sub.mins is not None
    sb = 0 if int(sub.sb) == g else int(sub.sb)
    ng = k // g

    if not sb and not offset:  # IQ4_NL: w = code * d, the classic int8 layout
        pk = int8_packed(np.asarray(sub.codes, dtype=np.int8), np.asarray(sub.d, dtype=np.float16), g)
        pk.vnni = vnni
        return pk
    if sb:
        scale = pack_superblock_scales(sub.scales, sub.d, ng, n)
        third = pack_superblock_scales(sub.mins, sub.dmin, ng, n) if offset else None
    else:  # Q5_1: scale d, min -dmin (both exact float16)
        scale = np.ascontiguousarray(sub.d, dtype=np.float16)
        third = np.ascontiguousarray(-np.asarray(sub.dmin, dtype=np.float16))
    tag = qtype.lower().replace("_", "")
    if qtype in NIBBLE_TYPES:
        if not (sb and offset):
            raise ValueError(f"internal: {qtype} in the int4 layout needs superblock scales and mins")
        lanes = Int4Format(g, False, True).lanes(k)
        arrays = [("_q4", pack_int4(np.asarray(sub.codes, dtype=np.uint8), lanes)), ("_q4_scale", scale),
                  ("_q4_min", third)]

        def compute4(kind: str, rows: tuple[int | None, int | None], ids_dtype: str = "int64") -> Any:
            return int4_matmul_compute(n, k, g, lanes, False, kind=kind, rows=rows, offset=True,
                                       ids_dtype=ids_dtype, sb=sb)

        return Packed("q4", tag, n, k, arrays, compute4, vnni)
    codes = np.ascontiguousarray(sub.codes, dtype=np.uint8 if offset else np.int8)
    arrays = [("_q8", codes), ("_q8_scale", scale)] + ([("_q8_min", third)] if offset else [])

    def compute8(kind: str, rows: tuple[int | None, int | None], ids_dtype: str = "int64") -> Any:
        return int8_matmul_compute(n, k, g, kind=kind, rows=rows, ids_dtype=ids_dtype, offset=offset, sb=sb)

    return Packed("q8", tag, n, k, arrays, compute8, vnni)
