"""Read a GGUF file's header (key/value metadata, tensor infos) in one pass over the mapped file.

Why not ``gguf.GGUFReader``: it builds every metadata value from numpy memmap slices, one small
array per string, so a 262k-token vocabulary takes ~26 s; this walk reads lengths with ``struct``
and numeric arrays with one ``np.frombuffer`` each (well under a second). It also checks each count
and length against the bytes left in the file, so a flipped byte or a cut file is a one-line
ModelFormatError naming the entry that is wrong and where, never a numpy error. Tensor data stays
in the file: ``GGUFTensor.data`` is a read-only view of the mapping, as ``ReaderTensor.data`` was.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from perfx_compiler.errors import ModelFormatError

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

HEADER_BYTES = 24  # magic, version (u32), tensor count (u64), key/value count (u64)
VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT
# Fixed-size value types (GGUFValueType) as numpy dtypes: 8 is a string, 9 an array.
_FIXED = {0: np.dtype("<u1"), 1: np.dtype("<i1"), 2: np.dtype("<u2"), 3: np.dtype("<i2"), 4: np.dtype("<u4"),
          5: np.dtype("<i4"), 6: np.dtype("<f4"), 7: np.dtype(np.bool_), 10: np.dtype("<u8"), 11: np.dtype("<i8"),
          12: np.dtype("<f8")}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_U64 = struct.Struct("<Q")
# ggml types whose data gguf's reader (and so the dequantizer) sees as elements, not bytes
_ELEMENT_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                   "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor info; ``shape`` in GGML order (innermost first), ``data_offset`` from the file start."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_bytes: int
    data_offset: int
    buf: mmap.mmap = field(repr=False, compare=False)

    @property
    def data(self) -> np.ndarray:
        """The raw data as a read-only view of the mapping, shaped as ``ReaderTensor.data``: element
        arrays for float/int types, [..., row bytes] uint8 blocks for quantized ones."""
        from gguf.quants import quant_shape_to_byte_shape

        np_shape = tuple(reversed(self.shape))
        dtype = _ELEMENT_DTYPES.get(self.tensor_type.name)
        if dtype is None:
            dtype, np_shape = np.uint8, quant_shape_to_byte_shape(np_shape, self.tensor_type)
        count = self.n_bytes // np.dtype(dtype).itemsize
        return np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.data_offset).reshape(np_shape)


@dataclass
class GGUFFile:
    """A GGUF's metadata (key -> str, int, float, bool or list) and tensor infos over its mapping."""

    path: Path
    fields: dict[str, Any]
    tensors: list[GGUFTensor]
    alignment: int
    data_offset: int  # where the tensor data starts
    mmap: mmap.mmap


class _Walk:
    def __init__(self, buf: mmap.mmap | bytes, path: Path) -> None:
        self.buf, self.size, self.path, self.pos = buf, len(buf), path, HEADER_BYTES

    def fail(self, what: str) -> ModelFormatError:
        return ModelFormatError(f"{self.path}: {what}; the file is corrupt or truncated, re-download or re-convert the model")

    def take(self, n: int, what: str) -> int:
        """Advance over ``n`` bytes of ``what``; refuse when they run past the end of the file."""
        if n > self.size - self.pos:
            raise self.fail(f"{what} ({n} bytes at byte {self.pos}) runs past the end of the file ({self.size} bytes)")
        start = self.pos
        self.pos += n
        return start

    def uint(self, fmt: str, what: str) -> int:
        return int(struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0])

    def text(self, start: int, n: int, what: str) -> str:
        try:
            return str(self.buf[start : start + n], "utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not UTF-8 text ({e.reason} at byte {start + e.start})") from None

    def string(self, what: str) -> str:
        n = self.uint("<Q", f"the length of {what}")
        return self.text(self.take(n, what), n, what)

    def value(self, vtype: int, what: str) -> Any:
        if vtype in _FIXED:
            dt = _FIXED[vtype]
            return np.frombuffer(self.buf, dt, 1, self.take(dt.itemsize, what)).tolist()[0]
        if vtype == _STRING:
            return self.string(what)
        if vtype != _ARRAY:
            raise self.fail(f"{what} has unknown value type {vtype}")
        itype = self.uint("<I", f"the item type of {what}")
        count = self.uint("<Q", f"the length of {what}")
        if itype in _FIXED:
            dt = _FIXED[itype]
            if count > (self.size - self.pos) // dt.itemsize:
                raise self.fail(f"{what} ({count} items at byte {self.pos}) runs past the end of the file ({self.size} bytes)")
            return np.frombuffer(self.buf, dt, count, self.take(count * dt.itemsize, what)).tolist()
        if itype != _STRING:
            raise self.fail(f"{what} is an array of unknown type {itype}")
        if count * 8 > self.size - self.pos:  # each string takes at least its length field
            raise self.fail(f"{what} declares {count} strings, more than the rest of the file can hold")
        return self.strings(count, what)

    def strings(self, count: int, what: str) -> list[str]:
        """``count`` strings in a tight loop (the vocabulary: ~10^5 of them); bounds checked per item."""
        buf, size, pos, unpack = self.buf, self.size, self.pos, _U64.unpack_from
        spans = []
        for i in range(count):
            if size - pos < 8:
                self.pos = pos
                self.take(8, f"the length of item {i} of {what}")
            n = unpack(buf, pos)[0]
            pos += 8
            if n > size - pos:
                self.pos = pos
                self.take(n, f"item {i} of {what}")
            spans.append((pos, n))
            pos += n
        self.pos = pos
        try:  # one bytes copy of the whole array, then a decode per item
            start = spans[0][0] if spans else pos
            raw = bytes(buf[start:pos])
            return [str(raw[s - start : s - start + n], "utf-8") for s, n in spans]
        except UnicodeDecodeError:
            for i, (s, n) in enumerate(spans):  # name the bad item
                self.text(s, n, f"item {i} of {what}")
            raise


def read_gguf_header(path: str | Path) -> GGUFFile:
    """Metadata and tensor infos of the GGUF at ``path``; a ModelFormatError names the first entry
    that does not fit the file (the mapping stays open for the tensors' data)."""
    p = Path(path)
    with open(p, "rb") as f:
        if p.stat().st_size < HEADER_BYTES:
            raise ModelFormatError(f"{p}: {p.stat().st_size} bytes, shorter than the {HEADER_BYTES}-byte GGUF header "
                                   "(truncated); re-download the model")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return _read(_Walk(buf, p), buf)


def _read(w: _Walk, buf: mmap.mmap) -> GGUFFile:
    import gguf

    version, n_tensors, n_kv = struct.unpack_from("<IQQ", w.buf, 4)
    if version not in VERSIONS:
        raise w.fail(f"GGUF version {version} (PerfX reads versions {', '.join(map(str, VERSIONS))})")
    # every entry takes at least a length field and a type: counts beyond that are a corrupt header
    if n_kv * 12 > w.size or n_tensors * 24 > w.size:
        raise w.fail(f"the header declares {n_tensors} tensors and {n_kv} metadata entries, more than a "
                     f"{w.size}-byte file can hold")
    fields: dict[str, Any] = {}
    align = DEFAULT_ALIGNMENT
    for i in range(n_kv):
        key = w.string(f"the key of metadata entry {i}")
        name = f"metadata '{key}'"
        if key in fields:
            raise w.fail(f"{name} appears twice")
        vtype = w.uint("<I", f"the type of {name}")
        fields[key] = w.value(vtype, name)
        if key == "general.alignment":
            align = fields[key]
            if vtype != _UINT32 or align == 0 or align & (align - 1):
                raise w.fail(f"{name} is {align!r}, not a power of two (uint32)")
    qtypes = {int(t): t for t in gguf.GGMLQuantizationType if t in gguf.GGML_QUANT_SIZES}
    infos: list[tuple[str, GGMLQuantizationType, tuple[int, ...], int, int]] = []
    seen: set[str] = set()
    for i in range(n_tensors):
        tname = w.string(f"the name of tensor {i}")
        name = f"tensor '{tname}'"
        if tname in seen:
            raise w.fail(f"{name} appears twice")
        seen.add(tname)
        n_dims = w.uint("<I", f"the dimension count of {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise w.fail(f"{name} has {n_dims} dimensions (1..{MAX_DIMS} are possible)")
        dims = tuple(w.uint("<Q", f"a dimension of {name}") for _ in range(n_dims))
        elements = 1
        for d in dims:
            elements *= d
        if elements >= 1 << 63:
            raise w.fail(f"{name} has dimensions {list(dims)}, more elements than a file can hold")
        qtype = w.uint("<I", f"the type of {name}")
        if qtype not in qtypes:
            raise w.fail(f"{name} has unknown ggml type {qtype}")
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtypes[qtype]]
        if dims[0] % block:
            raise w.fail(f"{name} has rows of {dims[0]} values, not a multiple of its type's {block}-value blocks")
        offset = w.uint("<Q", f"the data offset of {name}")
        infos.append((tname, qtypes[qtype], dims, elements // block * block_bytes, offset))
    data = w.pos + (-w.pos) % align
    tensors = []
    for tname, qtype, dims, nbytes, offset in infos:
        if data + offset + nbytes > w.size:
            raise w.fail(f"tensor '{tname}' ({nbytes} bytes at byte {data + offset}) runs past the end of the file ({w.size} bytes)")
        tensors.append(GGUFTensor(tname, qtype, dims, nbytes, data + offset, buf))
    return GGUFFile(w.path, fields, tensors, align, data, buf)
