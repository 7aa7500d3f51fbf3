"""Horizontal reductions of a TIR vector expression, in registers.

A reduction over the lanes of a vector (a dot product's partial sums, a tile's max) written as a
loop over a buffer makes LLVM either move the lanes one by one through integer registers (a serial
loop of scalar adds) or reload half-vectors of a full-width store (a halving tree through memory:
a store-forwarding stall per step). Built as one expression of shuffles instead, it stays in
vector registers: log2(width) shuffle + op pairs.
"""

from __future__ import annotations

from typing import Any


def fold_lanes(vec: Any, width: int, op: Any) -> Any:
    """op over the lanes of a ``width``-lane vector expression (width a power of two): the upper
    half folded onto the lower until one lane (a scalar expression) is left."""
    from tvm import tirx

    if width & (width - 1):
        raise ValueError(f"fold_lanes: width {width} is not a power of two")
    while width > 1:
        half = width // 2
        vec = op(tirx.Shuffle([vec], list(range(half))), tirx.Shuffle([vec], list(range(half, width))))
        width = half
    return vec


def add(a: Any, b: Any) -> Any:
    return a + b


def vector_type(dtype: str, lanes: int) -> str:
    """TVM's name of a ``lanes``-wide vector of ``dtype`` (the scalar type for one lane)."""
    return f"{dtype}x{lanes}" if lanes > 1 else dtype


def lanes_sum(buf: Any, base: Any, lanes: int, dtype: str = "float32") -> Any:
    """sum of buf[base : base + lanes] (a vector accumulator at the end of a row) as one expression."""
    return fold_lanes(buf.vload([base], vector_type(dtype, lanes)), lanes, add)
