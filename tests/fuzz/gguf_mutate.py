"""Seeded, structure-aware mutations of a GGUF file.

``layout`` walks a valid file once and records where each field lives (header counts, metadata
key/value lengths and types, tensor-info names, dims, types and data offsets); the mutations then
aim at those fields with values that break readers (0, lengths past the end, 2^31, 2^63, ...)
as well as flipping random bytes in each region and cutting the file anywhere.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

# GGUF value types: fixed sizes; 8 = string, 9 = array.
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


@dataclass
class Layout:
    size: int
    meta: tuple[int, int]  # byte range of the key/value section
    tinfo: tuple[int, int]  # byte range of the tensor infos
    data: int  # first byte of tensor data
    fields: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # kind -> [(offset, width)]
    floats: set[tuple[int, int]] = field(default_factory=set)  # the scalars that are float32 / float64

    def add(self, kind: str, off: int, width: int) -> None:
        self.fields.setdefault(kind, []).append((off, width))


def layout(buf: bytes) -> Layout:
    """Where every field of a valid GGUF v3 file is."""
    pos = 24
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    lay = Layout(size=len(buf), meta=(24, 0), tinfo=(0, 0), data=0)
    lay.add("n_tensors", 8, 8)
    lay.add("n_kv", 16, 8)

    def string(kind: str) -> None:
        nonlocal pos
        n = struct.unpack_from("<Q", buf, pos)[0]
        lay.add(kind, pos, 8)
        pos += 8 + n

    for _ in range(n_kv):
        string("key_len")
        vtype = struct.unpack_from("<I", buf, pos)[0]
        lay.add("value_type", pos, 4)
        pos += 4
        if vtype == 8:
            string("str_len")
        elif vtype == 9:
            itype, count = struct.unpack_from("<IQ", buf, pos)
            lay.add("array_type", pos, 4)
            lay.add("array_len", pos + 4, 8)
            pos += 12
            for _ in range(count):
                if itype == 8:
                    string("array_str_len")
                else:
                    pos += _SCALAR[itype]
        else:
            lay.add("scalar", pos, _SCALAR[vtype])
            if vtype in (6, 12):  # float32 / float64
                lay.floats.add((pos, _SCALAR[vtype]))
            pos += _SCALAR[vtype]
    lay.meta = (24, pos)
    for _ in range(n_tensors):
        string("tensor_name_len")
        n_dims = struct.unpack_from("<I", buf, pos)[0]
        lay.add("n_dims", pos, 4)
        pos += 4
        for _ in range(n_dims):
            lay.add("dim", pos, 8)
            pos += 8
        lay.add("ggml_type", pos, 4)
        lay.add("data_offset", pos + 4, 8)
        pos += 12
    lay.tinfo = (lay.meta[1], pos)
    lay.data = pos + (-pos) % 32
    return lay


def _interesting(rng: np.random.Generator, width: int, old: int, size: int) -> int:
    top = (1 << (8 * width)) - 1
    picks = [0, 1, 2, 3, old + 1, old - 1, old * 2, old + 32, size, size - 1, size + 1, size * 4,
             (1 << 15), (1 << 16) - 1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 63) - 1, 1 << 63, top,
             int(rng.integers(0, 1 << 62)) if width == 8 else int(rng.integers(0, 1 << 31))]
    return picks[int(rng.integers(len(picks)))] & top


def _set(buf: bytearray, off: int, width: int, value: int) -> None:
    buf[off : off + width] = int(value).to_bytes(width, "little")


def _flip(buf: bytearray, rng: np.random.Generator, lo: int, hi: int, n: int = 1) -> None:
    for _ in range(n):
        i = int(rng.integers(lo, max(lo + 1, hi)))
        buf[i] ^= int(rng.integers(1, 256))


# kind -> how many cases of it per base file; the mutation of each kind is in ``mutate``.
KINDS = {
    "truncate": 30, "truncate_at_field": 20, "flip_header": 12, "flip_metadata": 35, "flip_tensor_info": 25,
    "data_offset": 20, "dims": 18, "ggml_type": 10, "lengths": 25, "counts": 10, "value_type": 8,
    "flip_data": 8, "scalar_value": 25,
}
# Values a metadata number is set to (as the field's own width): zero, one, negatives, huge, NaN / inf.
_F32 = [0.0, -1.0, 1e-45, 3.4e38, float("nan"), float("inf"), -float("inf")]
_F64 = _F32 + [1e308]


def mutate(data: bytes, lay: Layout, kind: str, seed: int) -> bytes:
    """One mutated copy of ``data`` (its ``layout``), drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    buf = bytearray(data)
    size = len(data)

    def one_of(*kinds: str) -> tuple[int, int]:
        slots = [s for k in kinds for s in lay.fields.get(k, [])]
        return slots[int(rng.integers(len(slots)))]

    def set_field(*kinds: str) -> None:
        off, width = one_of(*kinds)
        old = int.from_bytes(buf[off : off + width], "little")
        _set(buf, off, width, _interesting(rng, width, old, size))

    if kind == "truncate":
        return bytes(buf[: int(rng.integers(0, size))])
    if kind == "truncate_at_field":  # cut just before, inside or after a field: the reader's edge cases
        off, width = one_of(*lay.fields)
        return bytes(buf[: max(0, off + int(rng.integers(-2, width + 3)))])
    if kind == "flip_header":
        _flip(buf, rng, 0, 24, int(rng.integers(1, 3)))
    elif kind == "flip_metadata":
        _flip(buf, rng, *lay.meta, int(rng.integers(1, 4)))
    elif kind == "flip_tensor_info":
        _flip(buf, rng, *lay.tinfo, int(rng.integers(1, 4)))
    elif kind == "data_offset":
        off, width = one_of("data_offset")
        others = [int.from_bytes(buf[o : o + 8], "little") for o, _ in lay.fields["data_offset"]]
        if rng.random() < 0.3:  # alias another tensor's data, or a nearby unaligned offset
            value = others[int(rng.integers(len(others)))] + int(rng.integers(0, 3))
        else:
            value = _interesting(rng, width, int.from_bytes(buf[off : off + 8], "little"), size - lay.data)
        _set(buf, off, width, value)
    elif kind == "dims":
        set_field("dim", "n_dims")
    elif kind == "ggml_type":
        off, width = one_of("ggml_type")
        _set(buf, off, width, int(rng.choice([0, 1, 2, 3, 6, 8, 12, 14, 30, 31, 39, 40, 255, (1 << 32) - 1])))
    elif kind == "lengths":
        set_field("key_len", "str_len", "array_len", "array_str_len", "tensor_name_len")
    elif kind == "counts":
        set_field("n_tensors", "n_kv")
    elif kind == "value_type":
        set_field("value_type", "array_type")
    elif kind == "scalar_value":  # a metadata number (a count, a size, epsilon, theta) set to an extreme
        off, width = one_of("scalar")
        if (off, width) in lay.floats:
            value = _F32[int(rng.integers(len(_F32)))] if width == 4 else _F64[int(rng.integers(len(_F64)))]
            buf[off : off + width] = struct.pack("<f" if width == 4 else "<d", value)
        else:
            _set(buf, off, width, _interesting(rng, width, int.from_bytes(buf[off : off + width], "little"), size))
    elif kind == "flip_data":
        _flip(buf, rng, lay.data, size, int(rng.integers(1, 8)))
    else:
        raise ValueError(kind)
    return bytes(buf)
