"""GGUF Q4_0 / Q4_1 / Q5_0 / Q8_0 blocks -> the layouts PerfX's quantized kernels read (no requantization).

ggml blocks hold 32 consecutive weights of a row:

* Q4_0 (18 bytes): d (f16), 16 bytes of nibbles; weight j < 16 is byte j's low nibble, weight
  j + 16 its high nibble; w = (q - 8) * d. -> int4 symmetric, groups of 32: scale d, zero 8.
* Q4_1 (20 bytes): d (f16), m (f16), 16 bytes of nibbles as Q4_0; w = q * d + m.
  -> int4 offset format, groups of 32: scale d, min m.
* Q8_0 (34 bytes): d (f16), 32 int8; w = q * d. -> int8, groups of 32: scale d.
* Q5_0 (22 bytes): d (f16), qh (32 high bits, little-endian), 16 bytes of low nibbles as Q4_0;
  w = (q - 16) * d with q = nibble | high bit << 4. -> int8 codes q - 16 in -16..15, scale d: Q8_0's
  table and kernels, the codes stored as q in 5-bit planes on CPUs (``formats/bitplanes.py``: 5.5 bits a
  weight, as the file; GPUs read a byte a code, 8.5); under int8
  activations (``vnni``) the 5-bit row octets of ``formats/vnni.py`` with zero point 16 and the
  float16 d table instead (5.5 bits a weight, as the file).

Every value (code, scale, min) is copied bit for bit, so the kernels compute with exactly the
weights the GGUF file describes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from perfx_compiler.errors import PerfXError
from perfx_compiler.formats.int4 import Int4Format, int4_packed
from perfx_compiler.formats.int8 import int8_packed

BLOCK = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q8_0": 34}
# types whose blocks become the int8 table (codes, scale)
INT8_TYPES = ("Q8_0", "Q5_0")
Q4_0 = Int4Format(32, symmetric=True)
Q4_1 = Int4Format(32, symmetric=False, offset=True)


def _blocks(qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    n, k = shape
    if qtype not in BLOCK_BYTES:
        raise PerfXError(f"GGUF passthrough reads {', '.join(BLOCK_BYTES)} tensors, not {qtype}")
    if k % BLOCK:
        raise PerfXError(f"internal: a {qtype} tensor of shape {shape} is not made of whole 32-blocks")
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // BLOCK, BLOCK_BYTES[qtype])
    return b


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(b[:, :, at : at + 2]).view(np.float16)[:, :, 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    n, nb, _ = qs.shape
    return np.concatenate([qs & 15, qs >> 4], axis=2).reshape(n, nb * BLOCK).astype(np.uint8)


def _q5_codes(b: np.ndarray) -> np.ndarray:
    """Q5_0 blocks [N, nb, 22] -> int8 codes q - 16 [N, nb * 32]."""
    n, nb, _ = b.shape
    high = np.ascontiguousarray(b[:, :, 2:6]).view("<u4")[:, :, 0]  # bit j: weight j's fifth bit
    bits = ((high[:, :, None] >> np.arange(BLOCK, dtype=np.uint32)) & 1).astype(np.uint8)
    low = _nibbles(b[:, :, 6:]).reshape(n, nb, BLOCK)
    return ((low | (bits << 4)).astype(np.int16) - 16).astype(np.int8).reshape(n, nb * BLOCK)


def unpack_blocks(qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, ...]:
    """Q4_0 -> (codes, scale, zero); Q4_1 -> (codes, scale, min); Q8_0 / Q5_0 -> (int8 codes, scale)."""
    b = _blocks(qtype, raw, shape)
    if qtype == "Q8_0":
        return np.ascontiguousarray(b[:, :, 2:]).view(np.int8).reshape(shape), _f16(b, 0)
    if qtype == "Q5_0":
        return _q5_codes(b), _f16(b, 0)
    if qtype == "Q4_0":
        d = _f16(b, 0)
        return _nibbles(b[:, :, 2:]), d, np.full(d.shape, 8, dtype=np.uint8)
    return _nibbles(b[:, :, 4:]), _f16(b, 0), _f16(b, 2)


def dequantize_blocks(qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Float32 weights of the blocks, computed from the unpacked arrays (checks the unpacking)."""
    parts = unpack_blocks(qtype, raw, shape)
    idx = np.arange(shape[1]) // BLOCK
    if qtype in INT8_TYPES:
        return parts[0].astype(np.float32) * parts[1].astype(np.float32)[:, idx]
    codes, d, third = parts
    c, s = codes.astype(np.float32), d.astype(np.float32)[:, idx]
    if qtype == "Q4_0":
        return (c - 8.0) * s
    return c * s + third.astype(np.float32)[:, idx]


def packed_from_blocks(
    qtype: str, raw: np.ndarray, shape: tuple[int, int], words8: bool = False, vnni: bool = False, gpu: bool = False,
    rows: int | None = None,
) -> Any:
    """The :class:`~perfx_compiler.formats.Packed` of a GGUF tensor (``words8``: Q8_0 codes and Q4_0 zeros as uint32 words, for WGSL;
    ``vnni``: its int8-activation variant directly, the same arrays ``Packed.vnni()`` would give; Q5_0's codes
    in 5-bit planes, ``formats/bitplanes.py``, per row on CPUs, a uint32 array a plane with ``gpu``; ``rows``, with
    ``vnni``: the whole weight's N when ``raw`` holds a chunk of its rows, ``formats.vnni.ROW_CHUNKS``)."""
    if qtype == "Q8_0" and vnni:  # the blocks' code bytes as a view, no int8 [N, K] copy (Gemma 3's embedding: 168 MB)
        from perfx_compiler.formats.vnni import q8_vnni_packed

        b = _blocks(qtype, raw, shape)
        return q8_vnni_packed(b[:, :, 2:].view(np.int8), _f16(b, 0), BLOCK, rows=rows)
    parts = unpack_blocks(qtype, raw, shape)
    if qtype == "Q5_0" and vnni:
        from perfx_compiler.formats.ggml._format import SubScaled
        from perfx_compiler.formats.vnni import subscaled_vnni_packed

        ones = np.ones(parts[1].shape, dtype=np.int8)  # one level: sub-scale 1, d the block's scale
        sub = SubScaled(codes=parts[0], scales=ones, mins=None, d=parts[1], dmin=None, group=BLOCK, sb=BLOCK)
        return subscaled_vnni_packed(sub, qtype, rows=rows)
    if qtype in INT8_TYPES:
        if vnni:
            from perfx_compiler.formats.vnni import q8_vnni_packed

            return q8_vnni_packed(parts[0], parts[1], BLOCK, rows=rows)
        bits = 5 if qtype == "Q5_0" else 8
        return int8_packed(parts[0], parts[1], BLOCK, words=words8, code_bits=bits, word_planes=gpu)
    fmt = Q4_0 if qtype == "Q4_0" else Q4_1
    if vnni:
        from perfx_compiler.formats.vnni import q4_vnni_packed

        return q4_vnni_packed(*parts, fmt, rows=rows)
    return int4_packed(*parts, fmt, words=words8)
