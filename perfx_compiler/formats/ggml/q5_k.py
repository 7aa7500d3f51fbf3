"""Q5_K: Q4_K plus a fifth code bit per weight.

Block (176 bytes): d (f16), dmin (f16), scales[12] (as Q4_K), qh[32], qs[128] (as Q4_K).
Bit s of qh[l] is the high bit of weight l of sub-block s (s = 0..7, l = 0..31).
w = (d * sc[s]) * q - (dmin * m[s]), q = nibble | high bit << 4 in 0..31.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from perfx_compiler.formats.ggml._format import GGMLFormat, SubScaled, blocks, f16, field, rows, split_bits
from perfx_compiler.formats.ggml.q4_k import (
    CHUNK_WEIGHTS,
    in_row_chunks,
    low_codes,
    nibble_chunks,
    scale_min_k4,
    sub_min_quants,
)


def unpack(raw: np.ndarray, shape: tuple[int, int]) -> SubScaled:
    n = shape[0]
    b = blocks(raw, shape, FORMAT.name, FORMAT.block_weights, FORMAT.block_bytes)
    sc, m = scale_min_k4(field(b, 4, 12))
    high = split_bits(field(b, 16, 32), 1)  # [N, nb, 8 (sub-block), 32]
    codes = low_codes(field(b, 48, 128)) | (high << np.uint8(4))
    return SubScaled(codes=rows(codes, n), scales=rows(sc, n), mins=rows(m, n),
                     d=f16(b, 0), dmin=f16(b, 2), group=32, sb=256)


FORMAT = GGMLFormat("Q5_K", 256, 176, 5.5, unpack, f16_fields=(0, 2))


def quantize(w: np.ndarray, compiled: bool | None = None) -> np.ndarray:
    """float32 [N, K] (K % 256 == 0) -> raw Q5_K blocks uint8 [N, K // 256 * 176]: llama.cpp's
    quantize_row_q5_K_ref (no importance matrix): Q4_K's search and requantization over codes 0..31
    (``q4_k.sub_min_quants``), the fifth bits into qh. ``compiled``: as ``q4_k.quantize``'s."""
    x = np.asarray(w, dtype=np.float32)
    if x.shape[1] % 256:
        raise ValueError(f"Q5_K quantizes rows of whole 256-weight superblocks; got K = {x.shape[1]}")
    return in_row_chunks(partial(_quantize_rows, compiled=compiled), x, CHUNK_WEIGHTS,
                         threads=1)  # (the search kernel runs threads of its own)


def _quantize_rows(x: np.ndarray, compiled: bool | None = None) -> np.ndarray:
    head, q = sub_min_quants(x, 31, -0.5, 0.1, 15, compiled)
    bit = np.arange(8, dtype=np.uint8).reshape(8, 1)
    qh = np.bitwise_or.reduce(((q >> np.uint8(4)) & np.uint8(1)) << bit, axis=2)  # bit s of qh[l]: sub-block s
    return np.concatenate([head, qh.astype(np.uint8), nibble_chunks(q)], axis=-1).reshape(x.shape[0], -1)
