"""The unpacked form of GGUF superblock tensors, and the byte-level helpers the per-type modules share.

Every type unpacks into one shape (``SubScaled``): integer codes, integer sub-block scales/mins and
f16 superblock scales, copied bit for bit from the file. Kernels read those arrays; the float
weight is always ``(d * scale) * code - (dmin * min)`` in float32, the order ggml's own
dequantizers use, so dequantizing from the unpacked arrays reproduces ggml bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from perfx_compiler.errors import ModelFormatError


@dataclass
class SubScaled:
    """A GGUF tensor's blocks unpacked, values copied bit for bit (nothing recomputed):
    weight[r, c] = d[r, c // sb] * scales[r, c // group] * codes[r, c] - dmin[r, c // sb] * mins[r, c // group]
    computed in float32 in exactly that order: (d*sc)*code - (dmin*m) (d*sc, dmin*m and the product
    with the code are exact in float32)."""

    codes: np.ndarray  # [N, K]: uint8 (0..2^b-1) for formats with mins; int8 signed values for the others
    scales: np.ndarray  # [N, K // group] int8 sub-block scales (already minus any bias)
    mins: np.ndarray | None  # [N, K // group] int8 sub-block mins, or None
    d: np.ndarray  # [N, K // sb] float16 superblock scale
    dmin: np.ndarray | None  # [N, K // sb] float16 superblock min scale, or None
    group: int  # sub-block size: 16 or 32
    sb: int  # superblock size: 256 (K-quants, IQ4_XS), or 32 for single-level types (scales all 1)


@dataclass(frozen=True)
class GGMLFormat:
    """One ggml block type: its sizes and its unpacker into ``SubScaled``."""

    name: str  # ggml type name, e.g. "Q4_K"
    block_weights: int  # weights per block (256 or 32)
    block_bytes: int
    bits: float  # bits per weight in the file
    unpack: Callable[[np.ndarray, tuple[int, int]], SubScaled]
    # byte offsets of the f16 d/dmin fields inside a block: check_finite reads only these
    f16_fields: tuple[int, ...] = (0,)


def blocks(raw: np.ndarray, shape: tuple[int, int], name: str, block_weights: int, block_bytes: int) -> np.ndarray:
    """Raw tensor bytes (flat or [N, row bytes]) -> uint8 [N, K // block_weights, block_bytes]."""
    n, k = shape
    if k % block_weights:
        raise ModelFormatError(f"a {name} tensor of shape {shape} has rows of {k} weights, not whole "
                               f"{block_weights}-weight blocks; the file is corrupt")
    want = n * (k // block_weights) * block_bytes
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.size != want:
        got = raw.size * raw.dtype.itemsize
        raise ModelFormatError(f"a {name} tensor of shape {shape} needs {want} bytes, got {got}; "
                               "the tensor data is truncated or mislabelled")
    return np.ascontiguousarray(raw).reshape(n, k // block_weights, block_bytes)


def field(b: np.ndarray, at: int, nbytes: int) -> np.ndarray:
    """Bytes [at, at + nbytes) of every block: [N, nb, nbytes] uint8 (contiguous, so it can be viewed)."""
    return np.ascontiguousarray(b[:, :, at : at + nbytes])


def f16(b: np.ndarray, at: int) -> np.ndarray:
    """The little-endian f16 at byte ``at`` of every block: [N, nb] float16."""
    return field(b, at, 2).view("<f2")[:, :, 0]


def split_bits(x: np.ndarray, width: int) -> np.ndarray:
    """uint8 [..., m] -> [..., 8 // width, m]: the width-bit fields of each byte, lowest first."""
    shifts = np.arange(0, 8, width, dtype=np.uint8)[:, None]
    return (x[..., None, :] >> shifts) & np.uint8((1 << width) - 1)


def rows(x: np.ndarray, n: int) -> np.ndarray:
    """[N, nb, ...] -> [N, nb * ...]: a row's values in weight order."""
    return x.reshape(n, -1)


def ones(n: int, count: int) -> np.ndarray:
    """int8 [n, count] of ones: the sub-block scales (or mins) of a single-level type."""
    return np.ones((n, count), dtype=np.int8)
