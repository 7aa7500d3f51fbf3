"""ONNX attribute readers and onnxruntime-genai's ``MatMulNBits`` tables, read without TVM (the foreign
reader keeps a file's int4 blocks; ``frontend/contrib_ops.py`` converts the operator)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from perfx_compiler.errors import ModelFormatError, UnsupportedModelError


def _attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def int_attr(node: onnx.NodeProto, name: str, default: int | None = None) -> int:
    """An integer attribute a converter must find (absent or not an integer: a corrupt file)."""
    v = _attr(node, name, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ModelFormatError(f"{node.op_type} '{node.name}' has no integer attribute {name} (got {v!r}); "
                               "the file is corrupt, re-export it")
    return v


def float_attr(node: onnx.NodeProto, name: str, default: float) -> float:
    """A number attribute (a string or a list there: a corrupt file)."""
    v = _attr(node, name, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ModelFormatError(f"{node.op_type} '{node.name}' attribute {name} is {v!r}, not a number; "
                               "the file is corrupt, re-export it")
    return float(v)


def _expect_size(node: onnx.NodeProto, what: str, arr: np.ndarray, size: int) -> None:
    if arr.size != size:
        raise ModelFormatError(f"{node.op_type} '{node.name}' {what} has {arr.size} elements, expected {size} for its "
                               "K, N, bits and block_size; the file is corrupt, re-export it")


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint8 bytes -> codes along the last axis, lowest bits first (onnxruntime's order)."""
    per = 8 // bits
    mask = (1 << bits) - 1
    parts = [(packed >> (bits * j)) & mask for j in range(per)]
    return np.stack(parts, axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * per)


@dataclass(frozen=True)
class NBitsTable:
    """A MatMulNBits weight as its file stores it, for a quantized passthrough: ``codes`` uint8
    [N, K] (unpacked, bit for bit), ``scales`` [N, ceil(K/block)] in the file's float type,
    ``zeros`` uint8 [N, ceil(K/block)] or None (the default zero point ``2^(bits-1)``).
    w = (code - zero) * scale."""

    bits: int
    block: int
    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray | None

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1])

    def rows(self, index: Any) -> NBitsTable:
        """The table of some rows (a slice or an index array): QKV splits, Q/K row permutations."""
        z = None if self.zeros is None else np.ascontiguousarray(self.zeros[index])
        return NBitsTable(self.bits, self.block, np.ascontiguousarray(self.codes[index]),
                          np.ascontiguousarray(self.scales[index]), z)

    def zero_points(self) -> np.ndarray:
        """uint8 zero points [N, groups], the default ones filled in."""
        if self.zeros is not None:
            return self.zeros
        return np.full(self.scales.shape, 1 << (self.bits - 1), dtype=np.uint8)

    def dequantize(self) -> np.ndarray:
        """The float32 weight [N, K] onnxruntime multiplies by."""
        idx = np.arange(self.codes.shape[1]) // self.block
        z = self.zero_points().astype(np.float32)[:, idx]
        return ((self.codes.astype(np.float32) - z) * self.scales.astype(np.float32)[:, idx]).astype(np.float32)


def matmulnbits_table(node: onnx.NodeProto, const: Callable[[str], np.ndarray | None]) -> NBitsTable | np.ndarray | None:
    """A com.microsoft MatMulNBits node's weight: an :class:`NBitsTable` when its zero points are
    absent or packed uint8 (the integer form kernels can use), else the float32 weight [N, K]
    (float zero points); None if its inputs are not constant."""
    k, n, bits, block = (int_attr(node, a, d) for a, d in (("K", None), ("N", None), ("bits", 4), ("block_size", None)))
    if bits not in (2, 4, 8):
        raise UnsupportedModelError(f"MatMulNBits '{node.name}' with bits={bits} is not supported (2, 4, 8 are)")
    if k < 1 or n < 1 or block < 16 or block & (block - 1):
        raise ModelFormatError(f"MatMulNBits '{node.name}' has K={k}, N={n}, block_size={block} (want K, N >= 1 and "
                               "a power-of-two block_size >= 16); the file is corrupt, re-export it")
    n_blocks = -(-k // block)
    if len(node.input) > 4 and node.input[4]:
        g_idx = const(node.input[4])
        # g_idx equal to k // block is the plain layout some exporters still write; anything else is act-order.
        if g_idx is None or not np.array_equal(g_idx.reshape(-1), np.arange(k) // block):
            raise UnsupportedModelError(f"MatMulNBits '{node.name}' uses act-order g_idx, which is not supported")
    if len(node.input) < 3:
        raise ModelFormatError(f"MatMulNBits '{node.name}' has {len(node.input)} inputs (A, B, scales at least); "
                               "the file is corrupt, re-export it")
    codes_raw = const(node.input[1])
    scales = const(node.input[2])
    if codes_raw is None or scales is None:
        return None
    # The tables' sizes follow from K, N, bits and block_size; a mismatch is a corrupt file, not a numpy error.
    _expect_size(node, "weight", codes_raw, n * n_blocks * (block * bits // 8))
    _expect_size(node, "scales", scales, n * n_blocks)
    codes = unpack_codes(codes_raw.astype(np.uint8).reshape(n, n_blocks, -1), bits)[:, :, :block]
    codes = np.ascontiguousarray(codes.reshape(n, n_blocks * block)[:, :k], dtype=np.uint8)
    scales = np.ascontiguousarray(scales.reshape(n, n_blocks))
    if len(node.input) > 3 and node.input[3]:
        z = const(node.input[3])
        if z is None:
            return None
        _expect_size(node, "zero points", z, n * n_blocks if z.dtype != np.uint8 else n * (-(-n_blocks * bits // 8)))
        if z.dtype != np.uint8:  # float zero points: no integer form, the float weight only
            zp = z.astype(np.float32).reshape(n, n_blocks)
            idx = np.arange(k) // block
            return ((codes.astype(np.float32) - zp[:, idx]) * scales.astype(np.float32)[:, idx]).astype(np.float32)
        if len(node.input) > 4 and node.input[4]:
            # onnxruntime's CPU kernel ignores packed zero points when g_idx is given (it uses 2^(bits-1)):
            # the file's weights are ambiguous, so say so rather than pick one reading.
            raise UnsupportedModelError(
                f"MatMulNBits '{node.name}' has both g_idx and packed uint8 zero points, which onnxruntime "
                "reads as zero points 2^(bits-1); re-export without g_idx (it is the plain k // block_size)"
            )
        zeros = np.ascontiguousarray(unpack_codes(z.reshape(n, -1), bits)[:, :n_blocks], dtype=np.uint8)
        return NBitsTable(bits, block, codes, scales, zeros)
    return NBitsTable(bits, block, codes, scales, None)


def dequantize_matmulnbits(node: onnx.NodeProto, const: Callable[[str], np.ndarray | None]) -> np.ndarray | None:
    """The float32 weight [N, K] of a com.microsoft MatMulNBits node; None if its inputs are not constant."""
    t = matmulnbits_table(node, const)
    return t.dequantize() if isinstance(t, NBitsTable) else t


# --- Relax converters ----------------------------------------------------------------------------
