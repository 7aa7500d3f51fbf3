"""perfx_compiler/kernels/memo.py: a kernel builder parses once per distinct argument set, and a different
argument (a dict's item, a PrimFunc's body) always builds again."""

from __future__ import annotations

import numpy as np
import pytest

from perfx_compiler.kernels import memo


def _counting_builder():
    calls: list[tuple] = []

    @memo.memoized_kernel
    def build(n: int, config: dict | None = None, func=None):
        calls.append((n, config))
        if n < 0:
            raise ValueError("bad n")
        return object()

    return build, calls


def test_same_arguments_build_once_and_others_build_again() -> None:
    build, calls = _counting_builder()
    a = build(4, config={"x": 1, "y": [2, 3]})
    assert build(4, config={"y": [2, 3], "x": 1}) is a  # a dict keyed by its items, in any order
    assert build(4, config={"x": 1, "y": [2, 4]}) is not a
    assert build(5, config={"x": 1, "y": [2, 3]}) is not a
    assert build(4) is not a and build(4) is build(4)
    assert len(calls) == 4
    with pytest.raises(ValueError):
        build(-1)
    with pytest.raises(ValueError):  # a builder that raised is not remembered: it runs (and raises) again
        build(-1)
    memo.clear()
    assert build(4, config={"x": 1, "y": [2, 3]}) is not a


def test_unkeyable_arguments_go_through_uncached() -> None:
    build, calls = _counting_builder()
    thing = np.zeros(3)
    assert build(1, func=thing) is not build(1, func=thing)
    assert len(calls) == 2


def test_tvm_arguments_are_keyed_by_structure() -> None:
    """Two PrimFuncs parsed apart but structurally equal share a build; a different body does not."""
    import tvm_ffi
    from tvm.script import tirx as T

    def scaled(factor: float):
        @T.prim_func
        def f(A: T.Buffer((8,), "float32"), B: T.Buffer((8,), "float32")):
            for i in range(8):
                B[i] = A[i] * T.float32(factor)

        return f

    build, calls = _counting_builder()
    one, again, other = scaled(2.0), scaled(2.0), scaled(3.0)
    assert one is not again and tvm_ffi.structural_equal(one, again)
    assert build(1, func=one) is build(1, func=again)
    assert build(1, func=other) is not build(1, func=one)
    assert len(calls) == 2


def test_a_real_kernel_is_parsed_once_and_shared() -> None:
    import tvm_ffi

    from perfx_compiler.kernels.rms_norm import rms_norm_kernel

    memo.clear()
    first = rms_norm_kernel(64, 1e-6, False, 8)
    assert rms_norm_kernel(64, 1e-6, False, 8) is first
    assert rms_norm_kernel(64, 1e-5, False, 8) is not first  # eps is baked into the kernel
    memo.clear()
    rebuilt = rms_norm_kernel(64, 1e-6, False, 8)
    assert rebuilt is not first and tvm_ffi.structural_equal(rebuilt, first)
