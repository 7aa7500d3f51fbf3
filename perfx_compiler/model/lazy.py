"""GGUF matrices kept as their quantized blocks (memory-mapped), float32 only on demand.

``load_gguf(..., lazy=True)`` puts a :class:`QuantizedWeight` in ``ModelDescription.weights`` for
every matrix of a block type (Q4_0 / Q4_1 / Q5_0 / Q8_0, the K-quants, IQ4, Q5_1) instead of its float32 copy: a 7B model's fp32 weights (27 GB)
would not fit in memory, its blocks (3.6 GB) are read from the mapped file. Float matrices (F16, BF16,
F32) are kept the same way, as their mapped rows: a float file compiled to its own quantization
(``--quantization q4_k``, ``q8``, ``q4_g128``) is then widened to float32 one weight at a time. The object looks
like a float32 array where only the metadata is asked (``shape``, ``ndim``, ``dtype``, ``size``);
``np.asarray`` dequantizes it (the float64 reference, the float / own-quantization compile
paths). The GGUF passthrough reads ``blocks()`` and never builds the float matrix; merged
projections stay lazy too (``concat``: a list of row blocks, joined one weight at a time).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def _row_bytes(qtype: str, k: int) -> int | None:
    """Bytes of one row of ``k`` weights of ggml type ``qtype`` (None: not a block type)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    qt = getattr(GGMLQuantizationType, qtype, None)
    if qt is None or qt not in GGML_QUANT_SIZES:
        return None
    weights, nbytes = GGML_QUANT_SIZES[qt]
    return k // weights * nbytes


FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2}  # "blocks" of one element (the rows' raw bytes) -> its bytes
FLOAT_TYPES = tuple(FLOAT_BYTES)


class QuantizedWeight:
    """A float32 [N, K] matrix described by its GGUF blocks (rows in Hugging Face order)."""

    dtype = np.dtype(np.float32)
    ndim = 2

    def __init__(
        self,
        qtype: str,
        parts: Sequence[np.ndarray],
        shape: tuple[int, int],
        rows: Sequence[np.ndarray | None] | None = None,
        releases: Sequence[Callable[[], None] | None] | None = None,
    ) -> None:
        row_bytes = _row_bytes(qtype, int(shape[1]))
        if row_bytes is None:
            raise ValueError(f"lazy weights are GGUF blocks, not {qtype}")
        self.qtype = qtype
        self.parts = list(parts)  # raw uint8 [rows_i, K / 32 * block bytes], concatenated by rows
        # Per part: the row order to read it in (llama.cpp's Q/K interleave undone without a copy)
        self.rows = list(rows) if rows is not None else [None] * len(self.parts)
        # Per part: drops its mapped pages once it has been read (the file stays the source)
        self.releases = list(releases) if releases is not None else [None] * len(self.parts)
        self.shape = (int(shape[0]), int(shape[1]))
        rows = sum(int(p.shape[0]) for p in self.parts)
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

    def _part(self, i: int) -> np.ndarray:
        p, order = self.parts[i], self.rows[i]
        return p if order is None else p[order]

    def blocks(self) -> np.ndarray:
        """The raw blocks [N, row bytes] in row order (one unpermuted part: the mapped view)."""
        if len(self.parts) == 1:
            return self._part(0)
        return np.concatenate([self._part(i) for i in range(len(self.parts))], axis=0)

    def release(self) -> None:
        """Let the OS drop the mapped pages read so far (they are re-read from the file if needed)."""
        for rel in self.releases:
            if rel is not None:
                rel()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        qt = GGMLQuantizationType[self.qtype]
        rows = [np.asarray(dequantize(np.asarray(self._part(i)), qt), dtype=np.float32) for i in range(len(self.parts))]
        out = (rows[0] if len(rows) == 1 else np.concatenate(rows, axis=0)).reshape(self.shape)
        if not out.flags.writeable:  # F32 rows come back as a view of the read-only mapping
            out = out.copy()
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
        shape = (sum(w.shape[0] for w in weights), weights[0].shape[1])
        return cls(weights[0].qtype, [p for w in weights for p in w.parts], shape,
                   [r for w in weights for r in w.rows], [r for w in weights for r in w.releases])


def is_lazy(w: Any) -> bool:
    return isinstance(w, QuantizedWeight)


def read_once(w: Any) -> np.ndarray:
    """``w`` as float32; a lazy weight's mapped pages are then dropped (a pass that quantizes weight by weight
    reads each once: the file's pages need not stay resident, in the process's RSS, until the compile ends)."""
    out = np.asarray(w, dtype=np.float32)
    if is_lazy(w):
        w.release()
    return out
