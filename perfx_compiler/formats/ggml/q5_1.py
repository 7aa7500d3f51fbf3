"""Q5_1: 32-weight blocks of 5-bit codes with an f16 scale and an f16 offset.

Block (24 bytes): d (f16), m (f16), qh (u32, bit j: weight j's fifth bit), qs[16] (weight j < 16:
qs[j]'s low nibble, j + 16: its high nibble). w = d * q + m, q in 0..31.
As SubScaled: sb = group = 32, scales = mins = 1 and dmin = -m (negating an f16 is exact), so
(d * 1) * q - (dmin * 1) is d * q + m bit for bit.
"""

from __future__ import annotations

import numpy as np

from perfx_compiler.formats.ggml._format import GGMLFormat, SubScaled, blocks, f16, field, ones, rows, split_bits


def unpack(raw: np.ndarray, shape: tuple[int, int]) -> SubScaled:
    n, k = shape
    b = blocks(raw, shape, FORMAT.name, FORMAT.block_weights, FORMAT.block_bytes)
    qh = field(b, 4, 4).view("<u4")  # [N, nb, 1]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8)
    low = split_bits(field(b, 8, 16), 4).reshape(high.shape)
    return SubScaled(codes=rows(low | (high << np.uint8(4)), n), scales=ones(n, k // 32), mins=ones(n, k // 32),
                     d=f16(b, 0), dmin=-f16(b, 2), group=32, sb=32)


FORMAT = GGMLFormat("Q5_1", 32, 24, 6.0, unpack, f16_fields=(0, 2))
