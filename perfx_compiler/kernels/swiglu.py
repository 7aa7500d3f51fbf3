"""SwiGLU over a merged gate|up tensor, written already scheduled (one vector loop per row)."""

from __future__ import annotations

from typing import Any

from tvm.script import tirx as T

from perfx_compiler.kernels.memo import memoized_kernel


@memoized_kernel
def swiglu_kernel(ffn: int) -> Any:
    """``silu(g) * u`` reading a merged [1, n, 2*ffn] tensor (gate columns first, then up).

    A plain block function (not pre-scheduled): the elementwise template vectorizes it with its
    polynomial sigmoid. A loop-only body would also trip Relax's reshape detection, which
    inspects single-input call_tir callees for a root block.
    """
    F = ffn

    @T.prim_func(private=True, s_tir=True)
    def swiglu(x_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        bsz = T.int64()
        n = T.int64()
        X = T.match_buffer(x_h, (bsz, n, T.int64(2 * F)), "float32")
        Out = T.match_buffer(o_h, (bsz, n, T.int64(F)), "float32")
        for i0, i1, i2 in T.grid(bsz, n, T.int64(F)):
            with T.sblock("swiglu"):
                v0, v1, v2 = T.axis.remap("SSS", [i0, i1, i2])
                T.reads(X[v0, v1, v2], X[v0, v1, v2 + T.int64(F)])
                T.writes(Out[v0, v1, v2])
                Out[v0, v1, v2] = X[v0, v1, v2] * T.sigmoid(X[v0, v1, v2]) * X[v0, v1, v2 + T.int64(F)]

    return swiglu
