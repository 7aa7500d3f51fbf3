"""Q3_K: 256-weight superblocks of 16 sub-blocks of 16, signed 3-bit codes, 6-bit scales, no mins.

Block (110 bytes): hmask[32], qs[64], scales[12], d (f16). Half h (128 weights): bits 2t..2t+1 of
qs[32h + l] are the low bits of the half's weight 32t + l; bit i of hmask[l] belongs to weight
32i + l, and when it is CLEAR the code is 4 lower. Scales: sub-block s's low nibble is nibble
(s // 8) of byte s % 8, its top 2 bits are bits 2(s // 4)..+1 of byte 8 + s % 4; scale = that - 32.
w = (d * (sc - 32)) * q, q = low bits - (4 if hmask bit clear) in -4..3.
"""

from __future__ import annotations

import numpy as np

from perfx_compiler.formats.ggml._format import GGMLFormat, SubScaled, blocks, f16, field, rows, split_bits


def unpack(raw: np.ndarray, shape: tuple[int, int]) -> SubScaled:
    n = shape[0]
    b = blocks(raw, shape, FORMAT.name, FORMAT.block_weights, FORMAT.block_bytes)
    nb = b.shape[1]
    hbit = split_bits(field(b, 0, 32), 1).reshape(n, nb, 256)
    low = split_bits(field(b, 32, 64).reshape(n, nb, 2, 32), 2).reshape(n, nb, 256)
    codes = low.astype(np.int8) - ((hbit ^ np.uint8(1)) << np.uint8(2)).astype(np.int8)
    packed = field(b, 96, 12)
    sc_lo = split_bits(packed[:, :, 0:8], 4).reshape(n, nb, 16)
    sc_hi = split_bits(packed[:, :, 8:12], 2).reshape(n, nb, 16)
    scales = (sc_lo | (sc_hi << np.uint8(4))).astype(np.int8) - np.int8(32)
    return SubScaled(codes=rows(codes, n), scales=rows(scales, n), mins=None,
                     d=f16(b, 108), dmin=None, group=16, sb=256)


FORMAT = GGMLFormat("Q3_K", 256, 110, 3.4375, unpack, f16_fields=(108,))
