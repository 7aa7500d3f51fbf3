"""GEMV with the weight read through an OpenCL image (Adreno's texture path), and the Adreno TIR pipeline.

Adreno GPUs read weights fastest through the texture units (L1 texture cache, 4-channel texels). The
weight ``W [N, K]`` is laid out as an RGBA float texture ``[N, K/4, 4]`` (texel ``(k4, n)`` holds
``W[n, 4*k4 : 4*k4+4]``), declared in scope ``global.texture``: TVM's ``TextureFlatten`` turns its loads
into ``texture2d_load`` and the OpenCL codegen into ``READ_IMAGEF`` on an ``image2d_array_t``.

:func:`adreno_tir_pipeline` assembles the lowering TVM 0.27 registers for Adreno but cannot be used as
registered (``get_tir_pipeline("adreno")`` returns one Pass where every caller unpacks a
(pipeline, finalize_host, finalize_device) triple): the Adreno pipeline (TextureFlatten first,
InjectTextureAlloc after LowerOpaqueBlock) with the generic s_tir finalize passes.

One thread per output row, ``threads`` rows per block; the K loop reads one texel (4 weights) per step,
two steps unrolled. The unroll is also a workaround: in TVM 0.27 the OpenCL codegen prints a serial loop
whose body starts with a texel read as an empty loop; with the read in an unrolled inner loop it prints
correctly (checked on PoCL against numpy).
"""

from __future__ import annotations

from typing import Any

from tvm.script import tirx as T

TEXEL = 4  # RGBA float channels per texel


def adreno_tir_pipeline() -> tuple[Any, Any, Any]:
    """(pipeline, finalize_host, finalize_device) for ``opencl -device=adreno`` with texture lowering."""
    from tvm.s_tir.backend.adreno.pipeline import default_tir_pipeline
    from tvm.tirx import compilation_pipeline

    _, finalize_host, finalize_device = compilation_pipeline.get_tir_pipeline("s_tir")
    return default_tir_pipeline(), finalize_host, finalize_device


def texture_gemv_kernel(n: int, k: int, threads: int = 64, dtype: str = "float32") -> Any:
    """y[n] = sum_k x[k] * W[n, k] with W as an RGBA texture [n, k/4, 4]; ``k`` a multiple of 8."""
    if k % (2 * TEXEL):
        raise ValueError(f"texture GEMV needs K divisible by {2 * TEXEL}, got {k}")
    N, K, TH = n, k, threads
    BLOCKS = -(-N // TH)

    @T.prim_func(private=True)
    def texture_gemv(x_h: T.handle, w_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        X = T.match_buffer(x_h, (K,), dtype)
        W = T.match_buffer(w_h, (N, K // TEXEL, TEXEL), dtype, scope="global.texture")
        Y = T.match_buffer(y_h, (N,), dtype)
        for bx in T.thread_binding(BLOCKS, thread="blockIdx.x"):
            for tx in T.thread_binding(TH, thread="threadIdx.x"):
                acc = T.decl_buffer((1,), dtype, scope="local")
                texel = T.decl_buffer((TEXEL,), dtype, scope="local")
                if bx * TH + tx < N:
                    acc[0] = T.float32(0)
                    for ko in range(K // (2 * TEXEL)):
                        for ki in T.unroll(2):
                            for c in T.vectorized(TEXEL):
                                texel[c] = W[bx * TH + tx, ko * 2 + ki, c]
                            for c in range(TEXEL):
                                acc[0] = acc[0] + X[(ko * 2 + ki) * TEXEL + c] * texel[c]
                    Y[bx * TH + tx] = acc[0]

    return texture_gemv


def to_texels(weight: Any) -> Any:
    """W [N, K] (numpy) -> the texture layout [N, K/4, 4] (a view when contiguous)."""
    n, k = weight.shape
    return weight.reshape(n, k // TEXEL, TEXEL)
