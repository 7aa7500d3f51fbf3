"""IQ4_NL: 32-weight blocks of 4-bit indices into ggml's fixed non-linear table, one f16 scale.

Block (18 bytes): d (f16), qs[16]: weight j < 16 is qs[j]'s low nibble, weight j + 16 its high nibble.
w = d * KVALUES[q]. Single level: sb = group = 32, scales all 1.
"""

from __future__ import annotations

import numpy as np

from perfx_compiler.formats.ggml._format import GGMLFormat, SubScaled, blocks, f16, field, ones, rows, split_bits

# kvalues_iq4nl from ggml-common.h
KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def unpack(raw: np.ndarray, shape: tuple[int, int]) -> SubScaled:
    n, k = shape
    b = blocks(raw, shape, FORMAT.name, FORMAT.block_weights, FORMAT.block_bytes)
    codes = KVALUES[split_bits(field(b, 2, 16), 4)]
    return SubScaled(codes=rows(codes, n), scales=ones(n, k // 32), mins=None,
                     d=f16(b, 0), dmin=None, group=32, sb=32)


FORMAT = GGMLFormat("IQ4_NL", 32, 18, 4.5, unpack)
