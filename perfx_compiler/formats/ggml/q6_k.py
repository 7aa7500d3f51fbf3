"""Q6_K: 256-weight superblocks of 16 sub-blocks of 16, signed 6-bit codes, int8 scales, no mins.

Block (210 bytes): ql[128], qh[64], scales[16] (int8), d (f16). Half h (128 weights, h = 0..1):
ql[64h : 64h + 64] low nibbles are weights 0..63 of the half, high nibbles 64..127; bits 2t..2t+1
of qh[32h + l] are the top two bits of the half's weight 32t + l.
w = (d * sc[s]) * (q - 32), q = nibble | top bits << 4 in 0..63.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from perfx_compiler.formats.ggml._format import GGMLFormat, SubScaled, blocks, f16, field, rows, split_bits
from perfx_compiler.formats.ggml.q4_k import in_row_chunks, nearest_int, seqsum, use_kernel


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


def make_qx_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's make_qx_quants with rmse_type 1 (weights x^2, no importance matrix) over groups
    x [..., n] float32 at once: (scale [...], codes L [..., n] uint8 = q + nmax; 0 for an all-zero group).
    Sums run left to right in float32 as in C; the 18 trial scales are tried in C's order."""
    f32 = np.float32
    at = np.argmax(np.abs(x), axis=-1)[..., None]  # the first largest |x|, as C's strict '>'
    top = np.take_along_axis(x, at, axis=-1)[..., 0]
    zero = np.abs(top) < f32(1e-15)
    top = np.where(zero, f32(1), top)
    wx = x * x * x  # C: w * x[i] with w = x[i] * x[i]
    w = x * x

    def trial(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # nearest_int in float32
        q = np.clip(np.rint(iscale[..., None] * x), f32(-nmax), f32(nmax - 1))
        return q, seqsum(wx * q), seqsum(w * q * q)

    with np.errstate(divide="ignore", invalid="ignore"):
        q, sumlx, suml2 = trial(f32(-nmax) / top)
        scale = np.where(suml2 != 0, sumlx / suml2, f32(0))
        best = scale * sumlx
        for step in (*range(-9, 0), *range(1, 10)):
            cand, slx, sl2 = trial(-(f32(nmax) + f32(0.1) * f32(step)) / top)
            better = (sl2 > 0) & (slx * slx > best * sl2)
            q = np.where(better[..., None], cand, q)
            scale = np.where(better, slx / sl2, scale)
            best = np.where(better, scale * slx, best)
    codes = np.where(zero[..., None], 0, q + f32(nmax)).astype(np.uint8)
    return np.where(zero, f32(0), scale).astype(f32), codes


def quantize(w: np.ndarray, compiled: bool | None = None) -> np.ndarray:
    """float32 [N, K] (K % 256 == 0) -> raw Q6_K blocks uint8 [N, K // 256 * 210]: llama.cpp's
    quantize_row_q6_K_ref (no importance matrix), vectorized over all blocks.

    Each sub-block of 16 gets a scale from make_qx_quants; d = -(largest-magnitude scale) / 128
    (f16), the sub-block scales its int8 multiples, and the codes are requantized against d * sc.
    ``compiled``: as ``q4_k.quantize``'s."""
    x = np.asarray(w, dtype=np.float32)
    n, k = x.shape
    if k % 256:
        raise ValueError(f"Q6_K quantizes rows of whole 256-weight superblocks; got K = {k}")
    return in_row_chunks(partial(_quantize_rows, compiled=compiled), x, CHUNK_WEIGHTS,
                         threads=1)  # (the search kernel runs threads of its own)


CHUNK_WEIGHTS = 1 << 20  # weights a chunk: the search's temporaries stay ~100 MB


def _quantize_rows(x: np.ndarray, compiled: bool | None = None) -> np.ndarray:
    f32 = np.float32
    n, k = x.shape
    nb = k // 256
    x = x.reshape(n, nb, 16, 16)
    # make_qx_quants compiled where it can be (this module's numpy version is its reference; TVM: compile time only)
    from perfx_compiler.kernels import kquant_search

    search = kquant_search.make_qx_quants if use_kernel(compiled) else make_qx_quants

    scales, q = search(x, 32)
    at = np.argmax(np.abs(scales), axis=-1)[..., None]
    top = np.take_along_axis(scales, at, axis=-1)[..., 0]
    zero = np.abs(top) < f32(1e-15)  # an all-zero block: every byte 0
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(zero, f32(0), f32(-128) / np.where(zero, f32(1), top))
        d = np.where(zero, f32(0), f32(1) / iscale).astype(np.float16)
        sc = np.minimum(nearest_int(iscale[..., None] * scales), 127).astype(np.int8)
        ds = d.astype(f32)[..., None] * sc.astype(f32)
        requant = (np.clip(nearest_int(x / ds[..., None]), -32, 31) + 32).astype(np.uint8)
    q = np.where((ds != 0)[..., None], requant, q)  # a zero sub-block scale keeps the search's codes
    q = np.where(zero[..., None, None], np.uint8(0), q).reshape(n, nb, 2, 4, 32)  # [half, quarter, l]
    lo = q & np.uint8(0xF)
    ql = np.concatenate([lo[:, :, :, 0] | (lo[:, :, :, 2] << 4), lo[:, :, :, 1] | (lo[:, :, :, 3] << 4)], axis=-1)
    hi = (q >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]
    qh = np.bitwise_or.reduce(hi, axis=3)
    sc = np.where(zero[..., None], np.int8(0), sc)
    return np.concatenate([ql.reshape(n, nb, 128), qh.reshape(n, nb, 64), sc.view(np.uint8),
                           d[..., None].astype("<f2").view(np.uint8)], axis=-1).reshape(n, -1)
