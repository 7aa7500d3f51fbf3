"""The image layout of GGUF superblock weights (K-quants, IQ4_XS) on Adreno's texture path: which
types have one, how their GPU arrays (``formats/superblocks.py``'s ``gpu``, ``formats/gpu_factors.py``)
pack into RGBA32UI texels, and the TIR expressions that decode a superblock's fields from them. The
kernels reading the images are ``kernels/texture_superblocks.py``.

Superblocks (256 weights of one row) keep the file's bits in runs of RGBA32UI texels in the row's
image (``kernels/gemv_texture.py``'s rows, layers and limits). A run is one head texel, then the code
texels of each superblock it heads:

* a superblock's code texels: each code plane's words of the superblock (``bitplanes.pack_word_planes``,
  low bits first; Q4_K's 4-bit codes and IQ4_XS's table indices are one plane), ``2 * bits`` texels;
* its head: the group values (sc, then m with a min) as fields of their own width, plane by plane
  (6-bit values: the low 4 bits of every group, then the top 2), widest first so no field crosses a
  word; then, when the values leave a word free (Q4_K, Q5_K, Q3_K), the superblock's d word as
  ``formats/gpu_factors.py`` stores it (d's float32 bits, or d | dmin << 16 as float16 bits).
* Q6_K and Q2_K fill the head texel with their values (16 bytes); their d words go to a second image,
  four superblocks a texel. IQ4_XS's head is 64 bits (48 of values, d's float16 bits): two
  superblocks share a head texel (a row's last run may hold one).

Bytes against the file: Q4_K, Q5_K, Q2_K, IQ4_XS 1.0; Q6_K 1.0095 (d as 32 bits, as on the buffer
path); Q3_K 1.018.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from tvm.script import tirx as T

from perfx_compiler.formats.bitplanes import PLANES
from perfx_compiler.kernels.gemv_texture import TEXEL, ImageLayout, TextureLimitError, image_layout, pack_image

SB = 256  # weights a superblock
HEAD_BITS = TEXEL * 32
CODE_BITS = {"Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "Q3_K": 3, "Q2_K": 2, "IQ4_XS": 4}  # the types with an image layout


def superblock_type(info: dict[str, Any]) -> str | None:
    """The superblock type of a GPU ``perfx.quant`` info (None: not one with an image layout). Q4_K runs the
    int4 kernels (bits 4, a min); the others the int8 ones, told apart by their codes' bits (4: IQ4_XS's
    table indices)."""
    if int(info.get("sb") or 0) != SB or not info.get("gpu_factors") or info.get("words") or info.get("lut"):
        return None
    if int(info.get("bits", 0)) == 4:
        return "Q4_K" if info.get("offset") else None
    int8_types = {bits: t for t, bits in CODE_BITS.items() if t != "Q4_K"}
    return int8_types.get(int(info.get("code_bits") or 0))


def _widths(bits: int) -> tuple[int, ...]:
    return (8,) if bits == 8 else PLANES[bits]


@dataclass(frozen=True)
class SuperblockImages:
    """The image layout of one K-quant or IQ4_XS weight [n, k] (module docstring)."""

    qtype: str
    n: int
    k: int
    group: int
    offset: bool

    @staticmethod
    def of(info: dict[str, Any]) -> SuperblockImages:
        qtype = superblock_type(info)
        if qtype is None:
            raise TextureLimitError(f"no superblock image layout for {info}")
        return SuperblockImages(qtype, int(info["N"]), int(info["K"]), int(info["group"]), bool(info.get("offset")))

    @property
    def code_bits(self) -> int:
        return CODE_BITS[self.qtype]

    @property
    def code_bias(self) -> int:
        """Stored codes are unsigned; without a min they are the signed codes + this (IQ4_XS: table indices)."""
        return 0 if self.offset else 1 << (self.code_bits - 1)

    @property
    def value_bits(self) -> int:
        from perfx_compiler.formats.gpu_factors import VALUE_BITS

        return VALUE_BITS[self.qtype]

    @property
    def value_bias(self) -> int:
        from perfx_compiler.formats.gpu_factors import SIGNED_VALUES

        return 1 << (self.value_bits - 1) if self.qtype in SIGNED_VALUES else 0

    @property
    def groups(self) -> int:
        return SB // self.group

    @property
    def superblocks(self) -> int:
        return self.k // SB

    @property
    def code_texels(self) -> int:
        return 2 * self.code_bits  # SB * bits / 128

    @property
    def value_bits_total(self) -> int:
        """Bits of a superblock's group values (sc, and m with a min)."""
        return (1 + self.offset) * self.groups * self.value_bits

    @property
    def shared(self) -> int:
        """Superblocks a head texel serves: 2 when values and a float16 d fit in half a texel (IQ4_XS)."""
        return 2 if not self.offset and self.value_bits_total + 16 <= HEAD_BITS // 2 else 1

    @property
    def d_in_head(self) -> bool:
        return self.shared == 2 or self.value_bits_total <= HEAD_BITS - 32

    @property
    def units(self) -> int:
        """Runs of a row: a head texel and the code texels of ``shared`` superblocks (the last may hold fewer)."""
        return -(-self.superblocks // self.shared)

    @property
    def unit_texels(self) -> int:
        return 1 + self.shared * self.code_texels

    def head_bit(self, slot: Any, bit: Any) -> Any:
        """Bit ``bit`` of superblock ``slot``'s head in its run's head texel."""
        return slot * (HEAD_BITS // self.shared) + bit

    @property
    def d_bit(self) -> int:
        """Where the d word (float16 d when shared) starts in a superblock's head."""
        return self.value_bits_total if self.shared == 2 else HEAD_BITS - 32

    def fields(self) -> list[tuple[int, int, int, int]]:
        """(array 0: sc | 1: m, low bit of the value, width, bit of group 0) of the head's fields."""
        out, at = [], 0
        planes = [(a, low, w) for a in range(1 + self.offset)
                  for low, w in zip(np.cumsum((0,) + _widths(self.value_bits)[:-1]), _widths(self.value_bits), strict=True)]
        for a, low, w in sorted(planes, key=lambda p: -p[2]):  # widest first: no field crosses a word
            out.append((a, int(low), w, at))
            at += self.groups * w
        return out

    def layouts(self, limits: dict[str, int]) -> list[ImageLayout]:
        if self.k % SB:
            raise TextureLimitError(f"superblock images need K % {SB} == 0 (K={self.k})")
        out = [image_layout(self.n, self.superblocks * self.code_texels + self.units, "RGBA32UI", limits)]
        if not self.d_in_head:
            out.append(image_layout(self.n, -(-self.superblocks // TEXEL), "RGBA32UI", limits))
        return out

    # -- packing (numpy) ------------------------------------------------------------------------
    def pack(self, arrays: list[np.ndarray], layouts: list[ImageLayout]) -> list[np.ndarray]:
        """The images from the weight's GPU arrays (``formats.superblocks.subscaled_packed(gpu=True)``:
        the code planes, then ``formats/gpu_factors.py``'s arrays)."""
        widths = _widths(self.code_bits)
        planes = [np.asarray(a, np.uint32) for a in arrays[: len(widths)]]
        sc, m, dword = self._factors(arrays[len(planes):])
        n, nsb, ct, per = self.n, self.superblocks, self.code_texels, self.shared
        codes = np.concatenate([p.reshape(n, nsb, 2 * w * TEXEL) for p, w in zip(planes, widths, strict=True)],
                               axis=2).reshape(n, nsb, ct, TEXEL)
        if self.shared == 2:  # the d word is d's float32 bits; the head holds its float16 bits (exact)
            dword = dword.view(np.float32).astype(np.float16).view(np.uint16).astype(np.uint32)
        values = [(v.astype(np.int32) + self.value_bias).astype(np.uint32).reshape(n, nsb, self.groups)
                  for v in (sc, m) if v is not None]
        head = np.zeros((n, self.units, TEXEL), np.uint32)
        row = np.zeros((n, layouts[0].width, TEXEL), np.uint32)
        for slot in range(per):
            kbs = np.arange(slot, nsb, per)
            units = kbs // per
            for a, low, w, at in self.fields():
                field = (values[a][:, kbs] >> np.uint32(low)) & np.uint32((1 << w) - 1)
                for g in range(self.groups):
                    bit = self.head_bit(slot, at + g * w)
                    head[:, units, bit // 32] |= field[:, :, g] << np.uint32(bit % 32)
            if self.d_in_head:
                bit = self.head_bit(slot, self.d_bit)
                head[:, units, bit // 32] |= dword[:, kbs] << np.uint32(bit % 32)
            for t in range(ct):
                row[:, units * self.unit_texels + 1 + slot * ct + t] = codes[:, kbs, t]
        row[:, np.arange(self.units) * self.unit_texels] = head
        out = [pack_image(row.reshape(n, -1), layouts[0])]
        if not self.d_in_head:
            padded = np.zeros((n, layouts[1].width * TEXEL), np.uint32)
            padded[:, :nsb] = dword
            out.append(pack_image(padded, layouts[1]))
        return out

    def _factors(self, arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """(sc, m or None, the d words) from gpu_factors' arrays: group values without their bias."""
        from perfx_compiler.formats.bitplanes import unpack_word_planes
        from perfx_compiler.formats.gpu_factors import GpuFactors

        f = GpuFactors.of(self.qtype, self.n, self.k, self.group, SB, self.offset)
        nv, ng = len(_widths(self.value_bits)), self.k // self.group

        def values(planes: list[np.ndarray]) -> np.ndarray:
            if self.value_bits == 8:
                v = np.ascontiguousarray(planes[0]).view(np.uint8)[:, :ng]
            else:
                v = unpack_word_planes(planes, planes[0].shape[1] * 32 // _widths(self.value_bits)[0], self.value_bits)[:, :ng]
            return v.astype(np.int32) - (self.value_bias if f.signed else 0)

        sc = values(arrays[:nv])
        m = values(arrays[nv: 2 * nv]) if self.offset else None
        return sc, m, np.ascontiguousarray(arrays[-1], np.uint32)

    # -- decoding (TIR, indices fixed at compile time once the loops are unrolled) ---------------------
    def code(self, cw: Any, col: Any) -> Any:
        """float32 code (less its bias; IQ4_XS: its table value) of column ``col`` of the superblock whose
        code words are ``cw``."""
        out, base, low = None, 0, 0
        for w in _widths(self.code_bits):
            bit = col * w
            f = (cw[base + bit // 32] >> T.Cast("uint32", bit % 32)) & T.uint32((1 << w) - 1)
            f = f << T.uint32(low) if low else f
            out = f if out is None else out | f
            base, low = base + 8 * w, low + w
        if self.qtype == "IQ4_XS":
            from perfx_compiler.formats.vnni import table_value

            return T.Cast("float32", table_value(T.Cast("int32", out), "iq4nl", "int32"))
        v = T.Cast("float32", T.Cast("int32", out))
        return v - T.float32(self.code_bias) if self.code_bias else v

    def value(self, hv: Any, a: int, g: Any, slot: Any) -> Any:
        """float32 group value (sc: ``a`` 0, m: 1) of group ``g`` of superblock ``slot`` of the head texel ``hv``."""
        out = None
        for arr, low, w, at in self.fields():
            if arr != a:
                continue
            bit = self.head_bit(slot, at + g * w)
            f = (hv[bit // 32] >> T.Cast("uint32", bit % 32)) & T.uint32((1 << w) - 1)
            f = f << T.uint32(low) if low else f
            out = f if out is None else out | f
        v = T.Cast("float32", T.Cast("int32", out))
        return v - T.float32(self.value_bias) if self.value_bias else v

    def d(self, hv: Any, dv: Any, kb: Any, slot: Any) -> tuple[Any, Any]:
        """(d, dmin or None) of superblock ``kb`` (``slot`` of its run) as float32."""
        from perfx_compiler.kernels.half_bits import te_half

        if self.shared == 2:
            bit = self.head_bit(slot, self.d_bit)
            return te_half((hv[bit // 32] >> T.Cast("uint32", bit % 32)) & T.uint32(0xFFFF)), None
        word = hv[TEXEL - 1] if self.d_in_head else dv[kb % TEXEL]
        if not self.offset:
            return T.reinterpret("float32", word), None
        return te_half(word & T.uint32(0xFFFF)), te_half(word >> T.uint32(16))

    def factors(self, hv: Any, dv: Any, kb: Any, slot: Any, g: Any) -> tuple[Any, Any]:
        """(sc d, m dmin or None) of group ``g`` of superblock ``kb`` (``slot`` of its run), float32."""
        d, dmin = self.d(hv, dv, kb, slot)
        return self.value(hv, 0, g, slot) * d, (self.value(hv, 1, g, slot) * dmin if self.offset else None)

    def weight(self, cw: Any, hv: Any, dv: Any, kb: Any, slot: Any, g: Any, j: Any) -> Any:
        """float32 weight of column ``j`` of group ``g`` of superblock ``kb``: code * (sc d) [- m dmin]."""
        scale, mn = self.factors(hv, dv, kb, slot, g)
        w = self.code(cw, g * self.group + j) * scale
        return w - mn if self.offset else w
