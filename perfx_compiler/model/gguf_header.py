"""Bounds checks of a GGUF file's header, before ``gguf.GGUFReader`` reads it.

The reader trusts every count and length it finds: a flipped byte or a cut file surfaces as a
numpy error deep inside it (``index 3720 is out of bounds``, ``cannot reshape``), which
``gguf.open_gguf`` can only wrap as "corrupt". This walk reads the same layout (header, key/value
entries, tensor infos) and checks each count and length against the bytes left in the file, so
the error says which entry is wrong and where. It reads only the header, not the tensor data.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

from perfx_compiler.errors import ModelFormatError

HEADER_BYTES = 24  # magic, version (u32), tensor count (u64), key/value count (u64)
VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
# Fixed-size value types (GGUFValueType): 8 is a string, 9 an array.
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


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

    def string(self, what: str) -> bytes:
        n = self.uint("<Q", f"the length of {what}")
        start = self.take(n, what)
        return bytes(self.buf[start : start + n])

    def value(self, vtype: int, what: str) -> None:
        if vtype in _FIXED:
            self.take(_FIXED[vtype], what)
        elif vtype == _STRING:
            self.string(what)
        elif vtype == _ARRAY:
            itype = self.uint("<I", f"the item type of {what}")
            count = self.uint("<Q", f"the length of {what}")
            if itype in _FIXED:
                self.take(count * _FIXED[itype], f"{what} ({count} items)")
            elif itype == _STRING:
                if count * 8 > self.size - self.pos:  # each string takes at least its length field
                    raise self.fail(f"{what} declares {count} strings, more than the rest of the file can hold")
                for i in range(count):
                    self.string(f"item {i} of {what}")
            else:
                raise self.fail(f"{what} is an array of unknown type {itype}")
        else:
            raise self.fail(f"{what} has unknown value type {vtype}")


def check_gguf_header(path: str | Path) -> None:
    """Raise a ModelFormatError naming the first header field that does not fit the file."""
    import gguf

    p = Path(path)
    with open(p, "rb") as f:
        if p.stat().st_size < HEADER_BYTES:
            raise ModelFormatError(f"{p}: {p.stat().st_size} bytes, shorter than the {HEADER_BYTES}-byte GGUF header "
                                   "(truncated); re-download the model")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            _check(_Walk(buf, p), {int(t): gguf.GGML_QUANT_SIZES[t] for t in gguf.GGMLQuantizationType
                                   if t in gguf.GGML_QUANT_SIZES})


def _check(w: _Walk, qtypes: dict[int, tuple[int, int]]) -> None:
    """``qtypes``: ggml type -> (elements per block, bytes per block)."""
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", w.buf, 4)
    if version not in VERSIONS:
        raise w.fail(f"GGUF version {version} (PerfX reads versions {', '.join(map(str, VERSIONS))})")
    # every entry takes at least a length field and a type: counts beyond that are a corrupt header
    if n_kv * 12 > w.size or n_tensors * 24 > w.size:
        raise w.fail(f"the header declares {n_tensors} tensors and {n_kv} metadata entries, more than a "
                     f"{w.size}-byte file can hold")
    align = 32  # GGUF_DEFAULT_ALIGNMENT
    for i in range(n_kv):
        key = w.string(f"the key of metadata entry {i}")
        name = f"metadata '{key.decode('utf-8', errors='replace')}'"
        vtype = w.uint("<I", f"the type of {name}")
        if key == b"general.alignment" and vtype == 4 and w.size - w.pos >= 4:
            align = struct.unpack_from("<I", w.buf, w.pos)[0]
            if align == 0 or align & (align - 1):
                raise w.fail(f"{name} is {align}, not a power of two")
        w.value(vtype, name)
    tensors: list[tuple[str, int, int]] = []  # name, data offset, bytes
    for i in range(n_tensors):
        name = f"tensor '{w.string(f'the name of tensor {i}').decode('utf-8', errors='replace')}'"
        n_dims = w.uint("<I", f"the dimension count of {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise w.fail(f"{name} has {n_dims} dimensions (1..{MAX_DIMS} are possible)")
        dims = [w.uint("<Q", f"a dimension of {name}") for _ in range(n_dims)]
        elements = 1
        for d in dims:
            elements *= d
        if elements >= 1 << 63:
            raise w.fail(f"{name} has dimensions {dims}, more elements than a file can hold")
        qtype = w.uint("<I", f"the type of {name}")
        if qtype not in qtypes:
            raise w.fail(f"{name} has unknown ggml type {qtype}")
        block, block_bytes = qtypes[qtype]
        if dims[0] % block:
            raise w.fail(f"{name} has rows of {dims[0]} values, not a multiple of its type's {block}-value blocks")
        tensors.append((name, w.uint("<Q", f"the data offset of {name}"), elements // block * block_bytes))
    data = w.pos + (-w.pos) % align
    for name, offset, nbytes in tensors:
        if data + offset + nbytes > w.size:
            raise w.fail(f"{name} ({nbytes} bytes at byte {data + offset}) runs past the end of the file ({w.size} bytes)")


# What numpy/the gguf reader raise on corrupt or truncated bytes (never shown to users as is).
READ_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, OSError, MemoryError, EOFError)


def field_value(field: Any) -> Any:
    """Python value of a GGUF metadata field (ReaderField or an already plain value)."""
    if hasattr(field, "contents") and hasattr(field, "parts"):
        return field.contents()
    return field
