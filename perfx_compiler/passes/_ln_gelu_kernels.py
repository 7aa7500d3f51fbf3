"""Kernels of ``fuse_layernorm_gelu``: residual add + LayerNorm (weight and bias) in one pass over
the row, and GeLU (erf or tanh form) with the linear's bias add folded in.

The LayerNorm kernels are written already scheduled, like ``rms_norm_kernel`` in ``_kernels.py``:
a row of a few hundred floats stays in cache for the three sweeps (sum, centred sum of squares,
normalize). The GeLU kernel is a plain elementwise compute over the call site's shape, so
FuseOps can still fold it into the matmul before it as an epilogue.
"""

from __future__ import annotations

import math
from typing import Any

from tvm import te, tirx
from tvm.script import tirx as T

from perfx_compiler.passes._kernels import norm_rows_func, vector_width

SQRT1_2 = 1.0 / math.sqrt(2.0)
SQRT2_PI = math.sqrt(2.0 / math.pi)


def layer_norm_kernel(hidden: int, eps: float, residual: bool, lanes: int = 16) -> Any:
    """``y = (x - mean) / sqrt(var + eps) * w + beta`` over rows of [batch, n, hidden], with
    ``x = a + b`` written out as well when ``residual`` (args a, b, w, beta -> (x, y)).

    Variance is centred (a second sweep over the cached row), not E[x^2] - E[x]^2, which loses
    digits when the mean is large against the spread.
    """
    H = hidden
    L = vector_width(H, lanes)
    C = H // L
    inv_h = 1.0 / H

    @T.macro
    def rows(A, B, S, W, G, Out, bsz, n):  # noqa: ANN001 - TVMScript macro; S is the row (A without residual)
        for b in T.serial(bsz):
            for r in T.serial(n):
                acc = T.decl_buffer((L,), "float32", scope="local")
                st = T.decl_buffer((2,), "float32", scope="local")  # mean, 1/std
                for lane in T.vectorized(L):
                    acc[lane] = T.float32(0)
                for c in T.serial(C):
                    if residual:
                        for lane in T.vectorized(L):
                            S[b, r, c * L + lane] = A[b, r, c * L + lane] + B[b, r, c * L + lane]
                    for lane in T.vectorized(L):
                        acc[lane] = acc[lane] + S[b, r, c * L + lane]
                st[0] = T.float32(0)
                for lane in T.serial(L):
                    st[0] = st[0] + acc[lane]
                st[0] = st[0] * T.float32(inv_h)
                for lane in T.vectorized(L):
                    acc[lane] = T.float32(0)
                for c in T.serial(C):
                    for lane in T.vectorized(L):
                        acc[lane] = acc[lane] + (S[b, r, c * L + lane] - st[0]) * (S[b, r, c * L + lane] - st[0])
                st[1] = T.float32(0)
                for lane in T.serial(L):
                    st[1] = st[1] + acc[lane]
                st[1] = T.float32(1) / T.sqrt(st[1] * T.float32(inv_h) + T.float32(eps))
                for c in T.serial(C):
                    for lane in T.vectorized(L):
                        Out[b, r, c * L + lane] = (
                            (S[b, r, c * L + lane] - st[0]) * st[1] * W[c * L + lane] + G[c * L + lane]
                        )

    return norm_rows_func(H, residual, rows, bias=True)


def gelu_value(v: Any, kind: str) -> Any:
    """GeLU of a float32 TIR expression: ``erf`` (exact) or ``tanh`` (GPT-2's approximation)."""
    half, one = tirx.const(0.5, "float32"), tirx.const(1.0, "float32")
    if kind == "erf":
        return half * v * (one + tirx.erf(v * tirx.const(SQRT1_2, "float32")))
    inner = tirx.const(SQRT2_PI, "float32") * (v + tirx.const(0.044715, "float32") * v * v * v)
    return half * v * (one + tirx.tanh(inner))


def gelu_kernel(shape: list[Any], kind: str, bias: bool) -> Any:
    """``gelu(x [+ bias])`` over a float32 tensor of ``shape`` — the call site's own shape
    expressions (symbolic sequence length included), as LegalizeOps builds its kernels: FuseTIR
    only merges the kernel into the matmul that produces x when both buffers have the same shape."""
    x = te.placeholder(shape, "float32", name="X")
    args = [x]
    if bias:
        b = te.placeholder((shape[-1],), "float32", name="Bias")
        args.append(b)

    def body(*i: Any) -> Any:
        return gelu_value(x[i] + b[i[-1]] if bias else x[i], kind)

    y = te.compute(shape, body, name=f"{'bias_' if bias else ''}gelu_{kind}")
    return te.create_prim_func([*args, y]).without_attr("global_symbol").with_attr("tirx.noalias", True)
