"""Residual add + RMSNorm on CPU, written already scheduled (explicit vector loops,
``tirx.is_scheduled``): a memory-bound row operation over a few hundred floats, where a fixed loop nest is
as good as any template, and writing it directly keeps the schedule phase from splitting the fused kernel.
``norm_rows_func`` is the signature the GPU variant (``rms_norm_gpu.py``) shares."""

from __future__ import annotations

from typing import Any

from tvm.script import tirx as T

from perfx_compiler.kernels.memo import memoized_kernel


def vector_width(n: int, lanes: int = 16) -> int:
    """Widest of lanes, 8, 4, 2, 1 that divides ``n``."""
    for w in (lanes, 8, 4, 2, 1):
        if w <= lanes and n % w == 0:
            return w
    return 1


def norm_rows_func(hidden: int, residual: bool, body: Any) -> Any:
    """The PrimFunc of an RMSNorm over [batch, n, hidden] whose loop nest is the TVMScript macro
    ``body(A, B, S, W, Out, bsz, n)``: one signature for the CPU and GPU norm kernels. Arguments are
    ``(a, [b,] w, [s,] out)``: with ``residual`` the sum ``a + b`` is written to ``s``; without it
    ``body`` gets ``A`` for ``B`` and ``S`` (it must not read them then)."""
    H = hidden
    if residual:

        @T.prim_func(private=True)
        def add_rms_norm(a_h: T.handle, b_h: T.handle, w_h: T.handle, s_h: T.handle, o_h: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            bsz = T.int64()
            n = T.int64()
            A = T.match_buffer(a_h, (bsz, n, T.int64(H)), "float32")
            B = T.match_buffer(b_h, (bsz, n, T.int64(H)), "float32")
            W = T.match_buffer(w_h, (T.int64(H),), "float32")
            S = T.match_buffer(s_h, (bsz, n, T.int64(H)), "float32")
            Out = T.match_buffer(o_h, (bsz, n, T.int64(H)), "float32")
            body(A, B, S, W, Out, bsz, n)

        return add_rms_norm

    @T.prim_func(private=True)
    def rms_norm(a_h: T.handle, w_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        bsz = T.int64()
        n = T.int64()
        A = T.match_buffer(a_h, (bsz, n, T.int64(H)), "float32")
        W = T.match_buffer(w_h, (T.int64(H),), "float32")
        Out = T.match_buffer(o_h, (bsz, n, T.int64(H)), "float32")
        body(A, A, A, W, Out, bsz, n)

    return rms_norm


@memoized_kernel
def rms_norm_kernel(hidden: int, eps: float, residual: bool, lanes: int = 16) -> Any:
    """``(a [+ b]) / sqrt(mean(x^2) + eps) * w`` over rows of [batch, n, hidden].

    With ``residual`` the kernel takes (a, b, w) and returns (a + b, normalized): the residual
    stream is written once and reused for the sum of squares while still in cache.
    """
    H = hidden
    L = vector_width(H, lanes)
    C = H // L
    inv_h = 1.0 / H

    @T.macro
    def rows(A, B, S, W, Out, bsz, n):  # noqa: ANN001, ARG001 - TVMScript macro; S is the row (A without residual)
        for b in T.serial(bsz):
            for r in T.serial(n):
                acc = T.decl_buffer((L,), "float32", scope="local")
                tot = T.decl_buffer((1,), "float32", scope="local")
                for lane in T.vectorized(L):
                    acc[lane] = T.float32(0)
                for c in T.serial(C):
                    if residual:
                        for lane in T.vectorized(L):
                            S[b, r, c * L + lane] = A[b, r, c * L + lane] + B[b, r, c * L + lane]
                    for lane in T.vectorized(L):
                        acc[lane] = acc[lane] + S[b, r, c * L + lane] * S[b, r, c * L + lane]
                tot[0] = T.float32(0)
                for lane in T.serial(L):
                    tot[0] = tot[0] + acc[lane]
                tot[0] = T.sqrt(tot[0] * T.float32(inv_h) + T.float32(eps))
                for c in T.serial(C):
                    for lane in T.vectorized(L):
                        Out[b, r, c * L + lane] = S[b, r, c * L + lane] / tot[0] * W[c * L + lane]

    return norm_rows_func(H, residual, rows)
