"""RMSNorm (optionally fused with the residual add) for GPUs: one block per row, a shared-memory tree
reduction of the sum of squares.

Same contract as ``kernels/rms_norm.rms_norm_kernel`` (the CPU kernel, which ``gpu_adapt`` replaces by
this one on GPU targets): rows of [bsz, n, H]; ``out = x / sqrt(mean(x^2) + eps) * w`` with
``x = a + b`` written to ``s`` when ``residual``. The grid is (row, batch) in blockIdx.x/y (no division
by a symbolic extent); ``threads`` threads stride over the row's H columns (coalesced), each keeps
its partial sum in a register, and a tree over a ``threads``-float shared array sums them (power of
two, so it runs wherever a barrier does: CUDA, ROCm, OpenCL, WebGPU without subgroups). The residual
sum is written and re-read by the same thread (no barrier needed).
"""

from __future__ import annotations

from typing import Any

from tvm.script import tirx as T

from perfx_compiler.kernels.rms_norm import norm_rows_func


def rms_norm_threads(hidden: int, max_threads: int = 256) -> int:
    """Power-of-two block size: enough threads for about 4 columns each, at most ``max_threads``."""
    t = 32
    while t * 4 < hidden and t * 2 <= min(max_threads, 256):
        t *= 2
    return min(t, max_threads)


def rms_norm_kernel_gpu(hidden: int, eps: float, residual: bool, threads: int = 128) -> Any:
    """The GPU PrimFunc (``tirx.is_scheduled``) for rows of ``hidden`` floats."""
    H, TX = hidden, threads
    if TX & (TX - 1) or TX < 1:
        raise ValueError(f"threads must be a power of two, got {TX}")
    STEPS = max(TX.bit_length() - 1, 0)  # log2(TX) tree levels
    PER = -(-H // TX)  # columns per thread (the last pass is guarded)
    inv_h = 1.0 / H

    @T.macro
    def rows(A, B, S, W, Out, bsz, n):  # noqa: ANN001, ARG001 - TVMScript macro; S is the row (A without residual)
        for r in T.thread_binding(n, thread="blockIdx.x"):
            for b in T.thread_binding(bsz, thread="blockIdx.y"):
                for tx in T.thread_binding(T.int64(TX), thread="threadIdx.x"):
                    red = T.decl_buffer((TX,), "float32", scope="shared")
                    acc = T.decl_buffer((1,), "float32", scope="local")
                    acc[0] = T.float32(0)
                    for i in T.serial(PER):
                        c: T.let[T.int64] = T.int64(i * TX) + tx
                        if c < T.int64(H):
                            if residual:
                                S[b, r, c] = A[b, r, c] + B[b, r, c]
                            acc[0] = acc[0] + S[b, r, c] * S[b, r, c]
                    red[tx] = acc[0]
                    T.tvm_storage_sync("shared")
                    for k in T.serial(STEPS):
                        stride: T.let[T.int64] = T.shift_right(T.int64(TX // 2), T.Cast("int64", k))
                        if tx < stride:
                            red[tx] = red[tx] + red[tx + stride]
                        T.tvm_storage_sync("shared")
                    rs: T.let[T.float32] = T.sqrt(red[0] * T.float32(inv_h) + T.float32(eps))
                    for i in T.serial(PER):
                        c: T.let[T.int64] = T.int64(i * TX) + tx
                        if c < T.int64(H):
                            Out[b, r, c] = S[b, r, c] / rs * W[c]

    return norm_rows_func(H, residual, rows)
