"""GGUF superblock weight formats (K-quants, IQ4, Q5_1), one module per ggml type.

Each module in this folder defines ``FORMAT = GGMLFormat(...)``; the registry below finds them with
pkgutil, so adding a type means adding one file. ``unpack`` gives the ``SubScaled`` arrays the
kernels read; ``dequantize`` computes float32 weights from those arrays alone (bit for bit what
ggml computes); ``check_finite`` is the cheap load-time check of a tensor's bytes and f16 scales.
"""

from __future__ import annotations

import importlib
import pkgutil

import numpy as np

from perfx_compiler.errors import ModelFormatError, UnsupportedModelError
from perfx_compiler.formats.ggml._format import GGMLFormat, SubScaled, blocks


def _discover() -> dict[str, GGMLFormat]:
    found: dict[str, GGMLFormat] = {}
    for mod in pkgutil.iter_modules(__path__):
        if mod.name.startswith("_"):
            continue
        fmt = getattr(importlib.import_module(f"{__name__}.{mod.name}"), "FORMAT", None)
        if isinstance(fmt, GGMLFormat):
            found[fmt.name] = fmt
    return found


FORMATS: dict[str, GGMLFormat] = _discover()


def _format(qtype: str) -> GGMLFormat:
    try:
        return FORMATS[qtype]
    except KeyError:
        raise UnsupportedModelError(f"no superblock format for ggml type {qtype}; "
                                    f"known: {', '.join(sorted(FORMATS))}") from None


def unpack(qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> SubScaled:
    """Raw blocks of an [N, K] tensor (numpy order: K is the row length) -> its SubScaled arrays."""
    return _format(qtype).unpack(raw, shape)


def dequantize(qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """float32 [N, K] weights computed from the unpacked arrays as ``(d*sc)*code - (dmin*m)``."""
    return weights(unpack(qtype, raw, shape))


def weights(s: SubScaled) -> np.ndarray:
    """SubScaled -> float32 [N, K], in ggml's order of operations (so bit-identical to ggml)."""
    n, k = s.codes.shape
    nsb, per = k // s.sb, s.sb // s.group
    # broadcast superblock / sub-block factors over [N, superblock, sub-block, weight] instead of repeating them
    ds = s.d.astype(np.float32).reshape(n, nsb, 1, 1) * s.scales.astype(np.float32).reshape(n, nsb, per, 1)
    w = ds * s.codes.astype(np.float32).reshape(n, nsb, per, s.group)
    if s.mins is not None:
        assert s.dmin is not None
        w = w - s.dmin.astype(np.float32).reshape(n, nsb, 1, 1) * s.mins.astype(np.float32).reshape(n, nsb, per, 1)
    return w.reshape(n, k)


def check_finite(qtype: str, raw: np.ndarray, shape: tuple[int, int], name: str) -> None:
    """Raise ModelFormatError (one line) if the tensor's bytes do not fill ``shape`` or any f16
    d/dmin is NaN or infinite. Reads only the scale fields, so it is cheap on any tensor."""
    fmt = _format(qtype)
    try:
        b = blocks(raw, shape, fmt.name, fmt.block_weights, fmt.block_bytes)
    except ModelFormatError as e:
        raise ModelFormatError(f"tensor {name} ({qtype}): {e}") from None
    bad = np.zeros(b.shape[:2], dtype=bool)
    for at in fmt.f16_fields:
        bad |= ~np.isfinite(b[:, :, at : at + 2].copy().view("<f2")[:, :, 0])
    if bad.any():
        raise ModelFormatError(f"tensor {name} ({qtype}): {int(bad.sum())} blocks have a NaN or infinite scale; "
                               "the file is corrupt — re-download or re-quantize it")


__all__ = ["FORMATS", "GGMLFormat", "SubScaled", "check_finite", "dequantize", "unpack", "weights"]
