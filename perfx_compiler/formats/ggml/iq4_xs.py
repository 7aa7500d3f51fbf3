"""IQ4_XS: 256-weight superblocks of 8 sub-blocks of 32, IQ4_NL's table with 6-bit sub-block scales.

Block (136 bytes): d (f16), scales_h (u16), scales_l[4], qs[128]. Sub-block s's scale: nibble
(s % 2) of scales_l[s // 2], plus bits 2s..2s+1 of scales_h on top; minus 32. Sub-block s's codes
are qs[16s : 16s + 16]: low nibbles weights 0..15, high nibbles 16..31.
w = (d * (ls - 32)) * KVALUES[q].
"""

from __future__ import annotations

import numpy as np

from perfx_compiler.formats.ggml._format import GGMLFormat, SubScaled, blocks, f16, field, rows, split_bits
from perfx_compiler.formats.ggml.iq4_nl import KVALUES


def unpack(raw: np.ndarray, shape: tuple[int, int]) -> SubScaled:
    n = shape[0]
    b = blocks(raw, shape, FORMAT.name, FORMAT.block_weights, FORMAT.block_bytes)
    nb = b.shape[1]
    codes = KVALUES[split_bits(field(b, 8, 128).reshape(n, nb, 8, 16), 4)]
    low = split_bits(field(b, 4, 4), 4).swapaxes(-1, -2).reshape(n, nb, 8)  # byte-major: 2i low, 2i+1 high
    high = (field(b, 2, 2).view("<u2") >> np.arange(0, 16, 2, dtype=np.uint16)) & np.uint16(3)
    scales = (low | (high.astype(np.uint8) << np.uint8(4))).astype(np.int8) - np.int8(32)
    return SubScaled(codes=rows(codes, n), scales=rows(scales, n), mins=None,
                     d=f16(b, 0), dmin=None, group=32, sb=256)


FORMAT = GGMLFormat("IQ4_XS", 256, 136, 4.25, unpack)
