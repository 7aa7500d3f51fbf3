"""Q6_K: 256-weight superblocks of 16 sub-blocks of 16, signed 6-bit codes, int8 scales, no mins.

Block (210 bytes): ql[128], qh[64], scales[16] (int8), d (f16). Half h (128 weights, h = 0..1):
ql[64h : 64h + 64] low nibbles are weights 0..63 of the half, high nibbles 64..127; bits 2t..2t+1
of qh[32h + l] are the top two bits of the half's weight 32t + l.
w = (d * sc[s]) * (q - 32), q = nibble | top bits << 4 in 0..63.
"""

from __future__ import annotations

import numpy as np

from perfx_compiler.formats.ggml._format import GGMLFormat, SubScaled, blocks, f16, field, rows, split_bits


def unpack(raw: np.ndarray, shape: tuple[int, int]) -> SubScaled:
    n = shape[0]
    b = blocks(raw, shape, FORMAT.name, FORMAT.block_weights, FORMAT.block_bytes)
    nb = b.shape[1]
    low = split_bits(field(b, 0, 128).reshape(n, nb, 2, 64), 4)  # [N, nb, half, nibble, 64]
    high = split_bits(field(b, 128, 64).reshape(n, nb, 2, 32), 2)  # [N, nb, half, shift, 32]
    q = low.reshape(n, nb, 256) | (high.reshape(n, nb, 256) << np.uint8(4))
    codes = q.astype(np.int8) - np.int8(32)
    return SubScaled(codes=rows(codes, n), scales=rows(field(b, 192, 16).view(np.int8), n), mins=None,
                     d=f16(b, 208), dmin=None, group=16, sb=256)


FORMAT = GGMLFormat("Q6_K", 256, 210, 6.5625, unpack, f16_fields=(208,))
