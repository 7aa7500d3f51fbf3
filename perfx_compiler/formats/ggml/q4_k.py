"""Q4_K: 256-weight superblocks of 8 sub-blocks of 32, 4-bit codes with 6-bit scales and mins.

Block (144 bytes): d (f16), dmin (f16), scales[12] (eight 6-bit scales and eight 6-bit mins packed
as in llama.cpp's get_scale_min_k4), qs[128]. Chunk j (64 weights, j = 0..3) is qs[32j : 32j + 32]:
low nibbles are sub-block 2j, high nibbles sub-block 2j + 1.
w = (d * sc[s]) * q - (dmin * m[s]), q in 0..15.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

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


def seqsum(a: np.ndarray) -> np.ndarray:
    """Sum over the last axis in float32, left to right, as C's ``for (...) s += a[i]`` (numpy's
    own sum is pairwise, so it rounds differently; the last cumulative sum is the sequential one)."""
    return np.cumsum(a, axis=-1, dtype=np.float32)[..., -1]


def nearest_int(x: np.ndarray) -> np.ndarray:
    """llama.cpp's nearest_int (adding 1.5 * 2^23): round half to even, as int32."""
    return np.rint(x).astype(np.int32)


def make_qkx2_quants(x: np.ndarray, weights: np.ndarray, nmax: int, rmin: float, rdelta: float,
                     nstep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's make_qkx2_quants (use_mad = false) over groups x [..., n] float32 at once:
    (scale [...], min [...] (the positive amount subtracted: ``the_min``), codes L [..., n] uint8).
    Every sum is accumulated left to right in float32 as in C, so the choices match llama.cpp's."""
    f32 = np.float32
    lo = np.minimum(x.min(axis=-1), f32(0))
    hi = x.max(axis=-1)
    flat = hi == lo
    span = np.where(flat, f32(1), hi - lo)  # flat groups: all codes 0, scale 0 (fixed up below)
    sum_w = seqsum(weights)
    sum_x = seqsum(weights * x)

    def codes(iscale: np.ndarray, mn: np.ndarray) -> np.ndarray:  # nearest_int in float32: same integers
        return np.clip(np.rint(iscale[..., None] * (x - mn[..., None])), f32(0), f32(nmax))

    def error(scale: np.ndarray, mn: np.ndarray, q: np.ndarray) -> np.ndarray:
        diff = scale[..., None] * q + mn[..., None] - x
        return seqsum(weights * (diff * diff))

    iscale = f32(nmax) / span
    scale = f32(1) / iscale
    mn = lo.copy()
    best_q = codes(iscale, mn)
    best = error(scale, mn, best_q)
    with np.errstate(divide="ignore", invalid="ignore"):
        for step in range(nstep + 1):
            # as in C, a trial that wins moves ``min`` and so the range the later trials divide
            span = np.where(flat, f32(1), hi - mn)
            q = codes((f32(rmin) + f32(rdelta) * f32(step) + f32(nmax)) / span, mn)
            wq = weights * q
            sum_l, sum_l2, sum_xl = seqsum(wq), seqsum(wq * q), seqsum(wq * x)
            det = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            pos = this_min > 0
            this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
            this_min = np.where(pos, f32(0), this_min)
            cur = error(this_scale, this_min, q)
            better = (det > 0) & (cur < best)
            best_q = np.where(better[..., None], q, best_q)
            best = np.where(better, cur, best)
            scale = np.where(better, this_scale, scale)
            mn = np.where(better, this_min, mn)
    scale = np.where(flat, f32(0), scale)
    mn = np.where(flat, lo, mn)
    best_q = np.where(flat[..., None], f32(0), best_q)
    return scale.astype(f32), (-mn).astype(f32), best_q.astype(np.uint8)


def pack_scale_min_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Inverse of :func:`scale_min_k4`: 6-bit scales and mins [..., 8] uint8 -> scales[12] [..., 12] uint8."""
    return np.concatenate([ls[..., :4] | ((ls[..., 4:] >> 4) << 6),
                           lm[..., :4] | ((lm[..., 4:] >> 4) << 6),
                           (ls[..., 4:] & 0xF) | ((lm[..., 4:] & 0xF) << 4)], axis=-1).astype(np.uint8)


def six_bits(values: np.ndarray, top: np.ndarray) -> np.ndarray:
    """nearest_int(63 / top * v) stored in a uint8 and capped at 63, as quantize_row_q4_K_ref does."""
    inv = np.where(top > 0, np.float32(63) / np.where(top > 0, top, np.float32(1)), np.float32(0))
    return np.minimum(nearest_int(inv[..., None] * values) & 0xFF, 63).astype(np.uint8)


def quantize(w: np.ndarray, compiled: bool | None = None) -> np.ndarray:
    """float32 [N, K] (K % 256 == 0) -> raw Q4_K blocks uint8 [N, K // 256 * 144]: llama.cpp's
    quantize_row_q4_K_ref (no importance matrix), vectorized over all blocks. ``compiled``: the search
    as a compiled kernel (True), as this module's numpy reference (False), or the kernel where it can run (None).

    Each sub-block of 32 gets a scale and min from make_qkx2_quants (weights av_x + |x|, 21 trial
    scales); the superblock's d and dmin are the largest scale / min over 63 (f16), the sub-block
    ones their 6-bit multiples, and the codes are requantized against those rounded factors."""
    x = np.asarray(w, dtype=np.float32)
    n, k = x.shape
    if k % 256:
        raise ValueError(f"Q4_K quantizes rows of whole 256-weight superblocks; got K = {k}")
    return in_row_chunks(partial(_quantize_rows, compiled=compiled), x, CHUNK_WEIGHTS,
                         threads=1)  # (the search kernel runs threads of its own)


CHUNK_WEIGHTS = 1 << 20  # weights a chunk: the search's temporaries stay ~100 MB
THREADS = min(8, os.cpu_count() or 1)


def use_kernel(compiled: bool | None) -> bool:
    """Whether a quantizer runs its compiled search (``compiled`` None: where the kernel can run)."""
    from perfx_compiler.kernels import kquant_search

    return kquant_search.compiled() if compiled is None else compiled


def in_row_chunks(fn: Callable[[np.ndarray], np.ndarray], x: np.ndarray, chunk: int | None = None,
                  threads: int = THREADS) -> np.ndarray:
    """fn over chunks of ~``chunk`` weights of whole rows, on up to ``threads`` threads (numpy's
    operations on large arrays release the GIL), joined in row order."""
    step = max(1, (chunk or CHUNK_WEIGHTS) // x.shape[1])
    parts = [x[r : r + step] for r in range(0, x.shape[0], step)]
    if len(parts) == 1 or threads == 1:
        return np.concatenate([fn(p) for p in parts], axis=0)
    with ThreadPoolExecutor(min(threads, len(parts))) as pool:
        return np.concatenate(list(pool.map(fn, parts)), axis=0)


def sub_min_quants(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int,
                   compiled: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
    """What quantize_row_q4_K_ref and quantize_row_q5_K_ref share, for float32 [N, K] rows: (the block heads
    uint8 [N, K / 256, 16]: d, dmin, scales[12]; the codes uint8 [N, K / 256, 8, 32] in 0..``nmax``).
    Q4_K searches 0..15 (rmin -1, rdelta 0.1, 20 steps), Q5_K 0..31 (-0.5, 0.1, 15 steps)."""
    # make_qkx2_quants compiled where it can be (this module's numpy version is its reference; TVM: compile time only)
    from perfx_compiler.kernels import kquant_search

    search = kquant_search.make_qkx2_quants if use_kernel(compiled) else make_qkx2_quants
    f32 = np.float32
    n, k = x.shape
    x = x.reshape(n, k // 256, 8, 32)
    av_x = np.sqrt(seqsum(x * x) / f32(32))
    scales, mins, q = search(x, av_x[..., None] + np.abs(x), nmax, rmin, rdelta, nstep)
    max_scale = np.maximum(scales.max(axis=-1), f32(0))
    max_min = np.maximum(mins.max(axis=-1), f32(0))
    packed = pack_scale_min_k4(six_bits(scales, max_scale), six_bits(mins, max_min))
    d = (max_scale / f32(63)).astype(np.float16)
    dmin = (max_min / f32(63)).astype(np.float16)
    sc, m = scale_min_k4(packed)
    ds = d.astype(f32)[..., None] * sc.astype(f32)
    dm = dmin.astype(f32)[..., None] * m.astype(f32)
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(nearest_int((x + dm[..., None]) / ds[..., None]), 0, nmax).astype(np.uint8)
    q = np.where((ds != 0)[..., None], requant, q)  # a zero sub-block scale keeps the search's codes
    head = np.concatenate([d[..., None].astype("<f2").view(np.uint8), dmin[..., None].astype("<f2").view(np.uint8),
                           packed], axis=-1)
    return head, q


def nibble_chunks(q: np.ndarray) -> np.ndarray:
    """Codes [N, nb, 8, 32] -> qs [N, nb, 128]: the low nibbles of sub-blocks 2j and 2j + 1 in chunk j's bytes."""
    n, nb = q.shape[:2]
    pairs = (q & np.uint8(0xF)).reshape(n, nb, 4, 2, 32)
    return (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << np.uint8(4))).reshape(n, nb, 128)


def _quantize_rows(x: np.ndarray, compiled: bool | None = None) -> np.ndarray:
    head, q = sub_min_quants(x, 15, -1.0, 0.1, 20, compiled)
    return np.concatenate([head, nibble_chunks(q)], axis=-1).reshape(x.shape[0], -1)
