"""GGUF matrices kept as their quantized blocks (memory-mapped), float32 only on demand.

``load_gguf(..., lazy=True)`` puts a :class:`QuantizedWeight` in ``ModelDescription.weights`` for
every Q4_0 / Q4_1 / Q8_0 matrix instead of its float32 copy: a 7B model's fp32 weights (27 GB)
would not fit in memory, its blocks (3.6 GB) are read from the mapped file. The object looks
like a float32 array where only the metadata is asked (``shape``, ``ndim``, ``dtype``, ``size``);
``np.asarray`` dequantizes it (the float64 reference, the float / own-quantization compile
paths). The GGUF passthrough reads ``blocks()`` and never builds the float matrix; merged
projections stay lazy too (``concat``: a list of row blocks, joined one weight at a time).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

# Bytes per 32-weight block of the types kept lazy.
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


class QuantizedWeight:
    """A float32 [N, K] matrix described by its GGUF blocks (rows in Hugging Face order)."""

    dtype = np.dtype(np.float32)
    ndim = 2

    def __init__(self, qtype: str, parts: Sequence[np.ndarray], shape: tuple[int, int]) -> None:
        if qtype not in BLOCK_BYTES:
            raise ValueError(f"lazy weights are Q4_0, Q4_1 or Q8_0 blocks, not {qtype}")
        self.qtype = qtype
        self.parts = list(parts)  # raw uint8 [rows_i, K / 32 * block bytes], concatenated by rows
        self.shape = (int(shape[0]), int(shape[1]))
        rows = sum(int(p.shape[0]) for p in self.parts)
        row_bytes = self.shape[1] // 32 * BLOCK_BYTES[qtype]
        if rows != self.shape[0] or any(int(p.shape[1]) != row_bytes for p in self.parts):
            raise ValueError(f"{qtype} blocks of {rows} rows do not describe a {self.shape} matrix")

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the float32 matrix it stands for (what a dense copy would take)."""
        return 4 * self.size

    @property
    def block_nbytes(self) -> int:
        return int(sum(p.nbytes for p in self.parts))

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"QuantizedWeight({self.qtype}, shape={self.shape})"

    def blocks(self) -> np.ndarray:
        """The raw blocks [N, K / 32 * block bytes] (one part: the mapped view itself, no copy)."""
        if len(self.parts) == 1:
            return self.parts[0]
        return np.concatenate(self.parts, axis=0)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        rows = [np.asarray(dequantize(np.asarray(p), GGMLQuantizationType[self.qtype]), dtype=np.float32)
                for p in self.parts]
        out = (rows[0] if len(rows) == 1 else np.concatenate(rows, axis=0)).reshape(self.shape)
        return out if dtype is None else out.astype(dtype, copy=False)

    def astype(self, dtype: Any, copy: bool = True) -> np.ndarray:
        return np.asarray(self, dtype=dtype)

    @classmethod
    def concat(cls, weights: Sequence[Any]) -> QuantizedWeight | None:
        """Row concatenation of lazy weights of one type and width (None when that is not the case)."""
        if not weights or not all(isinstance(w, cls) for w in weights):
            return None
        if len({w.qtype for w in weights}) != 1 or len({w.shape[1] for w in weights}) != 1:
            return None
        parts = [p for w in weights for p in w.parts]
        return cls(weights[0].qtype, parts, (sum(w.shape[0] for w in weights), weights[0].shape[1]))


def is_lazy(w: Any) -> bool:
    return isinstance(w, QuantizedWeight)
