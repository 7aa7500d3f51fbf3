"""llama.cpp's make_qkx2_quants (the Q4_K scale / min search) as one compiled CPU kernel.

``formats/ggml/q4_k.make_qkx2_quants`` is the numpy reference: vectorized over groups, it still makes ~20
full passes over the weights per trial scale, 21 trials, so quantizing a 1.1B float model to Q4_K took
minutes (1.3M weights/s on this 2-core EPYC). This kernel runs the same search for LANES groups side by side,
one per vector lane, each group's sums accumulated left to right in float32 as the reference (and llama.cpp's
C) does, in registers, the blocks of groups split over the CPU's threads: ~30x the reference.
``tests/formats/test_ggml_quantize.py`` holds it to the reference bit for bit.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

GROUP = 32
LANES = 16  # groups searched side by side, one per vector lane


@functools.cache
def _search(nmax: int, rmin: float, rdelta: float, nstep: int) -> Any:
    import tvm
    from tvm.script import tirx as T

    import perfx_compiler.tvm_compiler  # noqa: F401  (TVM with its compiler library)

    f32 = T.float32
    NMAX, RMIN, RDELTA, N = f32(nmax), f32(rmin), f32(rdelta), LANES

    @T.prim_func
    def qkx2(x_h: T.handle, w_h: T.handle, s_h: T.handle, m_h: T.handle, l_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        B = T.int64()
        # LANES groups side by side: element i of group b * LANES + l at [b, i, l], so every step is one vector
        X = T.match_buffer(x_h, (B, GROUP, N), "float32")
        W = T.match_buffer(w_h, (B, GROUP, N), "float32")
        S = T.match_buffer(s_h, (B, N), "float32")
        M = T.match_buffer(m_h, (B, N), "float32")
        L = T.match_buffer(l_h, (B, GROUP, N), "uint8")
        for b in T.parallel(B):
            # per lane: lo hi sum_w sum_x | best scale mn | sum_l sum_l2 sum_xl | d iscale det ts tm cur
            v = T.decl_buffer((16, N), "float32", scope="local")
            q = T.decl_buffer((GROUP, N), "float32", scope="local")
            bq = T.decl_buffer((GROUP, N), "float32", scope="local")
            for n in T.vectorized(N):
                v[0, n] = X[b, 0, n]
                v[1, n] = X[b, 0, n]
                v[2, n] = f32(0)
                v[3, n] = f32(0)
            for i in T.serial(GROUP):
                for n in T.vectorized(N):
                    v[0, n] = T.min(v[0, n], X[b, i, n])
                    v[1, n] = T.max(v[1, n], X[b, i, n])
                    v[2, n] = v[2, n] + W[b, i, n]
                    v[3, n] = v[3, n] + W[b, i, n] * X[b, i, n]
            for n in T.vectorized(N):
                v[0, n] = T.min(v[0, n], f32(0))
                v[11, n] = NMAX / (v[1, n] - v[0, n])  # (inf in a flat group: its lanes are replaced at the end)
                v[5, n] = f32(1) / v[11, n]
                v[6, n] = v[0, n]
                v[4, n] = f32(0)
            for i in T.serial(GROUP):
                for n in T.vectorized(N):
                    bq[i, n] = T.max(T.min(T.nearbyint(v[11, n] * (X[b, i, n] - v[6, n])), NMAX), f32(0))
                    v[10, n] = v[5, n] * bq[i, n] + v[6, n] - X[b, i, n]
                    v[4, n] = v[4, n] + W[b, i, n] * (v[10, n] * v[10, n])
            for step in T.serial(nstep + 1):
                for n in T.vectorized(N):
                    # a trial that wins moves min, and so the range the later trials divide (as in C)
                    v[11, n] = (RMIN + RDELTA * T.Cast("float32", step) + NMAX) / (v[1, n] - v[6, n])
                    v[7, n] = f32(0)
                    v[8, n] = f32(0)
                    v[9, n] = f32(0)
                    v[15, n] = f32(0)
                for i in T.serial(GROUP):
                    for n in T.vectorized(N):
                        q[i, n] = T.max(T.min(T.nearbyint(v[11, n] * (X[b, i, n] - v[6, n])), NMAX), f32(0))
                        v[10, n] = W[b, i, n] * q[i, n]
                        v[7, n] = v[7, n] + v[10, n]
                        v[8, n] = v[8, n] + v[10, n] * q[i, n]
                        v[9, n] = v[9, n] + v[10, n] * X[b, i, n]
                for n in T.vectorized(N):
                    v[12, n] = v[2, n] * v[8, n] - v[7, n] * v[7, n]
                    v[13, n] = (v[2, n] * v[9, n] - v[3, n] * v[7, n]) / v[12, n]
                    v[14, n] = (v[8, n] * v[3, n] - v[7, n] * v[9, n]) / v[12, n]
                    v[13, n] = T.Select(v[14, n] > f32(0), v[9, n] / v[8, n], v[13, n])
                    v[14, n] = T.Select(v[14, n] > f32(0), f32(0), v[14, n])
                for i in T.serial(GROUP):
                    for n in T.vectorized(N):
                        v[10, n] = v[13, n] * q[i, n] + v[14, n] - X[b, i, n]
                        v[15, n] = v[15, n] + W[b, i, n] * (v[10, n] * v[10, n])
                for i in T.serial(GROUP):
                    for n in T.vectorized(N):
                        bq[i, n] = T.Select((v[12, n] > f32(0)) & (v[15, n] < v[4, n]), q[i, n], bq[i, n])
                for n in T.vectorized(N):  # (the better mask is the flag v[10]: 1 where this trial wins)
                    v[10, n] = T.Select((v[12, n] > f32(0)) & (v[15, n] < v[4, n]), f32(1), f32(0))
                    v[4, n] = T.Select(v[10, n] > f32(0), v[15, n], v[4, n])
                    v[5, n] = T.Select(v[10, n] > f32(0), v[13, n], v[5, n])
                    v[6, n] = T.Select(v[10, n] > f32(0), v[14, n], v[6, n])
            for n in T.vectorized(N):  # a flat group: codes 0, scale 0, min the group's own
                S[b, n] = T.Select(v[1, n] == v[0, n], f32(0), v[5, n])
                M[b, n] = T.Select(v[1, n] == v[0, n], v[0, n], v[6, n]) * f32(-1)  # (-0.0 for 0, as numpy's negation)
            for i in T.serial(GROUP):
                for n in T.vectorized(N):
                    L[b, i, n] = T.Select(v[1, n] == v[0, n], T.uint8(0), T.Cast("uint8", bq[i, n]))

    mod = tvm.IRModule({"main": qkx2.with_attr("global_symbol", "main")})
    from perfx_compiler.targets import load_target

    # this machine's vector ISA for the lanes, less FMA: each product is rounded before its sum, as in the
    # reference (TVM lets LLVM fuse a multiply and an add wherever the target has the instruction)
    target = {**load_target("host").tvm_target}
    target["mattr"] = [*target.get("mattr", []), "-fma"]
    return tvm.compile(mod, tvm.target.Target(target))["main"]


@functools.cache
def compiled() -> bool:
    """Whether this machine runs the kernel: an x86 host, where the FMA instructions can be left out (elsewhere
    LLVM's fusing would move the results off the reference's, so the reference runs)."""
    from perfx_compiler.targets import load_target

    try:
        return load_target("host").name.startswith("x86")
    except Exception:  # noqa: BLE001  (an unknown host: the reference)
        return False


def make_qkx2_quants(x: np.ndarray, weights: np.ndarray, nmax: int, rmin: float, rdelta: float,
                     nstep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``formats.ggml.q4_k.make_qkx2_quants`` (groups x [..., 32] float32), compiled: (scale [...], min [...],
    codes [..., 32] uint8)."""
    import tvm

    if not compiled():
        from perfx_compiler.formats.ggml.q4_k import make_qkx2_quants as reference

        return reference(x, weights, nmax, rmin, rdelta, nstep)
    lead = x.shape[:-1]
    g = int(np.prod(lead))
    blocks = -(-g // LANES)

    def lanes(a: np.ndarray) -> np.ndarray:  # [g, 32] -> [blocks, 32, LANES] (zero groups pad: flat, dropped)
        out = np.zeros((blocks * LANES, GROUP), np.float32)
        out[:g] = a.reshape(g, GROUP)
        return np.ascontiguousarray(out.reshape(blocks, LANES, GROUP).transpose(0, 2, 1))

    args = [tvm.runtime.tensor(lanes(x)), tvm.runtime.tensor(lanes(weights)),
            tvm.runtime.empty((blocks, LANES), "float32"), tvm.runtime.empty((blocks, LANES), "float32"),
            tvm.runtime.empty((blocks, GROUP, LANES), "uint8")]
    _search(int(nmax), float(rmin), float(rdelta), int(nstep))(*args)
    scale, mn, codes = (a.numpy() for a in args[2:])
    codes = codes.transpose(0, 2, 1).reshape(-1, GROUP)[:g]
    return scale.reshape(-1)[:g].reshape(lead), mn.reshape(-1)[:g].reshape(lead), codes.reshape(*lead, GROUP)
