"""Hand-scheduled TIR kernels the graph passes call: residual add + RMSNorm, SwiGLU over a merged
gate|up tensor, and the attention kernel re-targeted to read Q/K/V out of one merged tensor.

They are written already scheduled (explicit vector loops, ``tirx.is_scheduled``): each is a
memory-bound row operation over a few hundred floats, where a fixed loop nest is as good as any
template, and writing it directly keeps the schedule phase from splitting the fused kernel again.
"""

from __future__ import annotations

import re
from typing import Any

from tvm.script import tirx as T


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


_PARAM_RE = (
    r'Q: T\.Buffer\(\(T\.int64\(1\), seq, T\.int64\((\d+)\)\), "float32"\), '
    r'K: T\.Buffer\(\(T\.int64\(1\), seq, T\.int64\((\d+)\)\), "float32"\), '
    r'V: T\.Buffer\(\(T\.int64\(1\), seq, T\.int64\((\d+)\)\), "float32"\), '
)


def attention_over_qkv(kernel: Any) -> Any | None:
    """The attention PrimFunc ``kernel(Q, K, V, caches...)`` rewritten to take one [1, seq, q+k+v]
    tensor: Q/K/V become strided views of it, so the merged projection is read in place (no
    split copies). Returns None when the kernel's signature is not the one this rewrite knows
    (the caller then splits with strided_slice instead)."""
    from typing import TypeVar

    import tvm

    src = kernel.script()
    m = re.search(_PARAM_RE, src)
    if m is None or src.count("def ") != 1:
        return None
    q, k, v = (int(g) for g in m.groups())
    width = q + k + v
    src = src.replace(m.group(0), f'QKV: T.Buffer((T.int64(1), seq, T.int64({width})), "float32"), ', 1)
    views = [
        f'    {name} = T.decl_buffer((T.int64(1), seq, T.int64({w})), "float32", data=QKV.data, '
        f"strides=(seq * T.int64({width}), T.int64({width}), T.int64(1)), elem_offset=T.int64({off}))"
        for name, w, off in (("Q", q, 0), ("K", k, q), ("V", v, q + k))
    ]
    lines = [ln for ln in src.split("\n") if not ln.startswith("#")]
    at = next((i for i, ln in enumerate(lines) if "T.func_attr" in ln), None)
    if at is None:
        return None
    lines[at + 1 : at + 1] = views
    try:
        return tvm.script.from_source("\n".join(lines), extra_vars={"T": T, "TypeVar": TypeVar})
    except Exception:  # noqa: BLE001 - an unexpected kernel shape: fall back to slicing
        return None
