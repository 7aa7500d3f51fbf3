"""Q4_K: 256-weight superblocks of 8 sub-blocks of 32, 4-bit codes with 6-bit scales and mins.

Block (144 bytes): d (f16), dmin (f16), scales[12] (eight 6-bit scales and eight 6-bit mins packed
as in llama.cpp's get_scale_min_k4), qs[128]. Chunk j (64 weights, j = 0..3) is qs[32j : 32j + 32]:
low nibbles are sub-block 2j, high nibbles sub-block 2j + 1.
w = (d * sc[s]) * q - (dmin * m[s]), q in 0..15.
"""

from __future__ import annotations

import numpy as np

from perfx_compiler.formats.ggml._format import GGMLFormat, SubScaled, blocks, f16, field, rows, split_bits


def scale_min_k4(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """scales[12] [..., 12] uint8 -> (sc, m), each [..., 8] int8 in 0..63 (get_scale_min_k4).

    Sub-blocks 0..3: low 6 bits of bytes 0..3 (scale) and 4..7 (min). Sub-blocks 4..7: the low
    (scale) / high (min) nibble of bytes 8..11, with bytes 0..3 / 4..7's top 2 bits on top."""
    lo, mid, hi = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    m = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    return sc.astype(np.int8), m.astype(np.int8)


def low_codes(qs: np.ndarray) -> np.ndarray:
    """qs [N, nb, 128] -> 4-bit codes [N, nb, 8, 32] (sub-block 2j: low nibbles of chunk j, 2j + 1: high)."""
    n, nb, _ = qs.shape
    return split_bits(qs.reshape(n, nb, 4, 32), 4).reshape(n, nb, 8, 32)


def unpack(raw: np.ndarray, shape: tuple[int, int]) -> SubScaled:
    n = shape[0]
    b = blocks(raw, shape, FORMAT.name, FORMAT.block_weights, FORMAT.block_bytes)
    sc, m = scale_min_k4(field(b, 4, 12))
    return SubScaled(codes=rows(low_codes(field(b, 16, 128)), n), scales=rows(sc, n), mins=rows(m, n),
                     d=f16(b, 0), dmin=f16(b, 2), group=32, sb=256)


FORMAT = GGMLFormat("Q4_K", 256, 144, 4.5, unpack, f16_fields=(0, 2))
