"""Q2_K: 256-weight superblocks of 16 sub-blocks of 16, 2-bit codes with 4-bit scales and mins.

Block (84 bytes): scales[16] (low nibble: scale, high nibble: min), qs[64], d (f16), dmin (f16).
Half h (128 weights): bits 2t..2t+1 of qs[32h + l] are the half's weight 32t + l.
w = (d * sc[s]) * q - (dmin * m[s]), q in 0..3.
"""

from __future__ import annotations

import numpy as np

from perfx_compiler.formats.ggml._format import GGMLFormat, SubScaled, blocks, f16, field, rows, split_bits


def unpack(raw: np.ndarray, shape: tuple[int, int]) -> SubScaled:
    n = shape[0]
    b = blocks(raw, shape, FORMAT.name, FORMAT.block_weights, FORMAT.block_bytes)
    nb = b.shape[1]
    codes = split_bits(field(b, 16, 64).reshape(n, nb, 2, 32), 2)
    packed = field(b, 0, 16)
    return SubScaled(codes=rows(codes, n), scales=rows((packed & 0x0F).astype(np.int8), n),
                     mins=rows((packed >> 4).astype(np.int8), n), d=f16(b, 80), dmin=f16(b, 82), group=16, sb=256)


FORMAT = GGMLFormat("Q2_K", 256, 84, 2.625, unpack, f16_fields=(80, 82))
