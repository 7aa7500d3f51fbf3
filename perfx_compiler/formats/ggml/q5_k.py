"""Q5_K: Q4_K plus a fifth code bit per weight.

Block (176 bytes): d (f16), dmin (f16), scales[12] (as Q4_K), qh[32], qs[128] (as Q4_K).
Bit s of qh[l] is the high bit of weight l of sub-block s (s = 0..7, l = 0..31).
w = (d * sc[s]) * q - (dmin * m[s]), q = nibble | high bit << 4 in 0..31.
"""

from __future__ import annotations

import numpy as np

from perfx_compiler.formats.ggml._format import GGMLFormat, SubScaled, blocks, f16, field, rows, split_bits
from perfx_compiler.formats.ggml.q4_k import low_codes, scale_min_k4


def unpack(raw: np.ndarray, shape: tuple[int, int]) -> SubScaled:
    n = shape[0]
    b = blocks(raw, shape, FORMAT.name, FORMAT.block_weights, FORMAT.block_bytes)
    sc, m = scale_min_k4(field(b, 4, 12))
    high = split_bits(field(b, 16, 32), 1)  # [N, nb, 8 (sub-block), 32]
    codes = low_codes(field(b, 48, 128)) | (high << np.uint8(4))
    return SubScaled(codes=rows(codes, n), scales=rows(sc, n), mins=rows(m, n),
                     d=f16(b, 0), dmin=f16(b, 2), group=32, sb=256)


FORMAT = GGMLFormat("Q5_K", 256, 176, 5.5, unpack, f16_fields=(0, 2))
