"""The GPU layout of the GGUF superblock factors (K-quants, IQ4_XS): group values in bit planes and the
superblock d (dmin) in 32-bit words, every array uint32, at the file's own bits.

dlight's GEMV rules need one read per array per weight (so a group value and its d cannot share an
array as in the CPU layouts), OpenCL devices without cl_khr_fp16 (PoCL, some phones) cannot read
float16, and WGSL has no 8-bit types. So, per weight [N, K] with groups of G and superblocks of 256:

* ``scale`` (``scale_hi``): the group values sc [N, K/G] in the word planes of
  ``bitplanes.pack_word_planes`` at their own width (``VALUE_BITS``: 6 for Q4_K / Q5_K / Q3_K / IQ4_XS,
  4 for Q2_K; Q6_K's 8-bit values as bytes in words, ``superblocks.byte_words``); signed values stored
  + 2^(bits-1). Columns are padded to whole words.
* ``min`` (``min_hi``): the min values m likewise (Q4_K, Q5_K, Q2_K).
* ``scale_d`` uint32 [N, K/256]: d's float32 bits, or with a min d's float16 bits | dmin's << 16,
  decoded with integer operations (``kernels/half_bits.te_half``).

Bytes against the file: Q6_K 1.0095 (d as 32 bits), Q3_K 1.018, IQ4_XS 1.015, Q4_K, Q5_K, Q2_K 1.0.
Every product (sc * d, m * dmin) is exact in float32, as on CPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from perfx_compiler.formats import bitplanes
from perfx_compiler.kernels.half_bits import te_half

# bits of a group value (sc, m) per type; signed ones are stored + 2^(bits-1)
VALUE_BITS = {"Q6_K": 8, "Q5_K": 6, "Q4_K": 6, "Q3_K": 6, "Q2_K": 4, "IQ4_XS": 6}
SIGNED_VALUES = {"Q6_K", "Q3_K", "IQ4_XS"}


def _widths(bits: int) -> tuple[int, ...]:
    return (8,) if bits == 8 else bitplanes.PLANES[bits]


@dataclass(frozen=True)
class GpuFactors:
    """The factor arrays' shapes of one weight: ``bits`` a group value (signed: stored + 2^(bits-1)),
    ``offset``: a min array and a d | dmin word."""

    n: int
    k: int
    group: int
    sb: int
    bits: int
    signed: bool
    offset: bool

    @staticmethod
    def of(qtype: str, n: int, k: int, group: int, sb: int, offset: bool) -> GpuFactors:
        return GpuFactors(n, k, group, sb, VALUE_BITS[qtype], qtype in SIGNED_VALUES, offset)

    def _cols(self, width: int) -> int:
        """Words a row of one plane takes: the groups padded to whole words of the narrowest plane."""
        if self.bits == 8:
            return -(-(self.k // self.group) // 4)
        per = 32 // min(_widths(self.bits))
        return -(-(self.k // self.group) // per) * per * width // 32

    def names(self) -> list[str]:
        """Kernel parameter names (array suffixes without the leading ``_``), argument order."""
        planes = ["", "_hi"][: len(_widths(self.bits))]
        out = [f"scale{p}" for p in planes] + ([f"min{p}" for p in planes] if self.offset else [])
        return out + ["scale_d"]

    def placeholders(self) -> list[Any]:
        from tvm import te

        widths = _widths(self.bits)
        shapes = [(self.n, self._cols(w)) for w in widths] * (2 if self.offset else 1) + [(self.n, self.k // self.sb)]
        return [te.placeholder(s, "uint32", name=nm) for nm, s in zip(self.names(), shapes, strict=True)]

    def pack(self, values: np.ndarray, mins: np.ndarray | None, d: np.ndarray, dmin: np.ndarray | None) -> list[np.ndarray]:
        """The arrays of :meth:`names` from the unpacked group values, mins and float16 d / dmin."""
        out = self._planes(values) + (self._planes(mins) if self.offset else [])
        d16 = np.ascontiguousarray(d, dtype="<f2")
        if self.offset:
            pair = d16.view(np.uint16).astype(np.uint32) | np.ascontiguousarray(dmin, dtype="<f2").view(
                np.uint16).astype(np.uint32) << np.uint32(16)
            return out + [np.ascontiguousarray(pair)]
        return out + [np.ascontiguousarray(d16.astype(np.float32)).view(np.uint32)]

    def _planes(self, values: np.ndarray) -> list[np.ndarray]:
        from perfx_compiler.formats.superblocks import byte_words

        v = np.asarray(values).astype(np.int16) + ((1 << (self.bits - 1)) if self.signed else 0)
        if self.bits == 8:
            return [byte_words(v.astype(np.uint8))]
        per = 32 // min(_widths(self.bits))
        padded = np.zeros((v.shape[0], -(-v.shape[1] // per) * per), dtype=np.int16)
        padded[:, : v.shape[1]] = v
        return bitplanes.pack_word_planes(padded, self.bits)

    def factors(self, arrays: list[Any], row: Any, g: Any) -> tuple[Any, Any]:
        """(TE) group ``g``'s (sc * d, m * dmin) as float32 (the second None without a min)."""
        from tvm import tirx

        nv = len(_widths(self.bits))
        dw = arrays[-1][row, g // (self.sb // self.group)]

        def value(planes: list[Any]) -> Any:
            if self.bits == 8:
                from perfx_compiler.formats.superblocks import te_byte

                v = te_byte(planes[0], row, g, True, False)
            else:
                v = bitplanes.word_plane_code(planes, row, g, self.bits)
            return (v - (1 << (self.bits - 1)) if self.signed else v).astype("float32")

        if not self.offset:
            return value(arrays[:nv]) * tirx.reinterpret("float32", dw), None
        d = te_half(dw & tirx.const(0xFFFF, "uint32"))
        dmin = te_half(dw >> tirx.const(16, "uint32"))
        return value(arrays[:nv]) * d, value(arrays[nv: 2 * nv]) * dmin
