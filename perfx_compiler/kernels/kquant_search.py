"""llama.cpp's make_qkx2_quants (the Q4_K scale / min search) and make_qx_quants (Q6_K's scale search) as
compiled CPU kernels.

``formats/ggml/q4_k.make_qkx2_quants`` is the numpy reference: vectorized over groups, it still makes ~20
full passes over the weights per trial scale, 21 trials, so quantizing a 1.1B float model to Q4_K took
minutes. This kernel runs the same search for LANES groups side by side,
one per vector lane, each group's sums accumulated left to right in float32 as the reference (and llama.cpp's
C) does, in registers, the blocks of groups split over the CPU's threads.
``tests/formats/test_ggml_quantize.py`` holds it to the reference bit for bit.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

GROUP = 32  # Q4_K's sub-block
QX_GROUP = 16  # Q6_K's
LANES = 16  # groups searched side by side, one per vector lane


@functools.cache
def _search(nmax: int, rmin: float, rdelta: float, nstep: int) -> Any:
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

    return _build(qkx2)


def _build(func: Any) -> Any:
    import tvm

    from perfx_compiler.targets import load_target

    # this machine's vector ISA for the lanes, less FMA: each product is rounded before its sum, as in the
    # reference (TVM lets LLVM fuse a multiply and an add wherever the target has the instruction)
    target = {**load_target("host").tvm_target}
    target["mattr"] = [*target.get("mattr", []), "-fma"]
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    return tvm.compile(mod, tvm.target.Target(target))["main"]


@functools.cache
def _qx_search(nmax: int) -> Any:
    from tvm.script import tirx as T

    import perfx_compiler.tvm_compiler  # noqa: F401  (TVM with its compiler library)

    f32 = T.float32
    NMAX, N, G = f32(nmax), LANES, QX_GROUP

    @T.prim_func
    def qx(x_h: T.handle, s_h: T.handle, l_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        B = T.int64()
        X = T.match_buffer(x_h, (B, G, N), "float32")
        S = T.match_buffer(s_h, (B, N), "float32")
        L = T.match_buffer(l_h, (B, G, N), "uint8")
        for b in T.parallel(B):
            # per lane: amax top | iscale slx sl2 | scale best | better
            v = T.decl_buffer((8, N), "float32", scope="local")
            q = T.decl_buffer((G, N), "float32", scope="local")
            bq = T.decl_buffer((G, N), "float32", scope="local")
            for n in T.vectorized(N):
                v[0, n] = f32(-1)
                v[1, n] = f32(0)
            for i in T.serial(G):
                for n in T.vectorized(N):  # the first largest |x|, as C's strict '>'
                    v[1, n] = T.Select(T.fabs(X[b, i, n]) > v[0, n], X[b, i, n], v[1, n])
                    v[0, n] = T.max(v[0, n], T.fabs(X[b, i, n]))
            for n in T.vectorized(N):
                v[1, n] = T.Select(T.fabs(v[1, n]) < f32(1e-15), f32(1), v[1, n])
                v[2, n] = NMAX * f32(-1) / v[1, n]
                v[3, n] = f32(0)
                v[4, n] = f32(0)
            for i in T.serial(G):
                for n in T.vectorized(N):
                    bq[i, n] = T.max(T.min(T.nearbyint(v[2, n] * X[b, i, n]), NMAX - f32(1)), NMAX * f32(-1))
                    v[3, n] = v[3, n] + X[b, i, n] * X[b, i, n] * X[b, i, n] * bq[i, n]
                    v[4, n] = v[4, n] + X[b, i, n] * X[b, i, n] * bq[i, n] * bq[i, n]
            for n in T.vectorized(N):
                v[5, n] = T.Select(v[4, n] != f32(0), v[3, n] / v[4, n], f32(0))
                v[6, n] = v[5, n] * v[3, n]
            for t in T.serial(18):  # steps -9 .. -1, 1 .. 9
                for n in T.vectorized(N):
                    v[2, n] = (NMAX + f32(0.1) * T.Cast("float32", t - 9 + t // 9)) * f32(-1) / v[1, n]
                    v[3, n] = f32(0)
                    v[4, n] = f32(0)
                for i in T.serial(G):
                    for n in T.vectorized(N):
                        q[i, n] = T.max(T.min(T.nearbyint(v[2, n] * X[b, i, n]), NMAX - f32(1)), NMAX * f32(-1))
                        v[3, n] = v[3, n] + X[b, i, n] * X[b, i, n] * X[b, i, n] * q[i, n]
                        v[4, n] = v[4, n] + X[b, i, n] * X[b, i, n] * q[i, n] * q[i, n]
                for n in T.vectorized(N):
                    v[7, n] = T.Select((v[4, n] > f32(0)) & (v[3, n] * v[3, n] > v[6, n] * v[4, n]), f32(1), f32(0))
                    v[5, n] = T.Select(v[7, n] > f32(0), v[3, n] / v[4, n], v[5, n])
                    v[6, n] = T.Select(v[7, n] > f32(0), v[5, n] * v[3, n], v[6, n])
                for i in T.serial(G):
                    for n in T.vectorized(N):
                        bq[i, n] = T.Select(v[7, n] > f32(0), q[i, n], bq[i, n])
            for n in T.vectorized(N):  # an all-zero group: scale 0, codes 0
                S[b, n] = T.Select(v[0, n] < f32(1e-15), f32(0), v[5, n])
            for i in T.serial(G):
                for n in T.vectorized(N):
                    L[b, i, n] = T.Select(v[0, n] < f32(1e-15), T.uint8(0), T.Cast("uint8", bq[i, n] + NMAX))

    return _build(qx)


@functools.cache
def compiled() -> bool:
    """Whether this machine runs the kernels: an x86 host, where the FMA instructions can be left out (elsewhere
    LLVM's fusing would move the results off the references', so the quantizers run the numpy references)."""
    from perfx_compiler.targets import load_target

    try:
        return load_target("host").name.startswith("x86")
    except Exception:  # noqa: BLE001  (an unknown host: the reference)
        return False


def make_qkx2_quants(x: np.ndarray, weights: np.ndarray, nmax: int, rmin: float, rdelta: float,
                     nstep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``formats.ggml.q4_k.make_qkx2_quants`` (groups x [..., 32] float32), compiled: (scale [...], min [...],
    codes [..., 32] uint8)."""
    lead, (scale, mn, codes) = x.shape[:-1], _run(_search(int(nmax), float(rmin), float(rdelta), int(nstep)),
                                                   [x, weights], 2)
    return scale.reshape(lead), mn.reshape(lead), codes.reshape(x.shape)


def make_qx_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """``formats.ggml.q6_k.make_qx_quants`` (groups x [..., 16] float32), compiled: (scale [...], codes [..., 16]
    uint8)."""
    scale, codes = _run(_qx_search(int(nmax)), [x], 1)
    return scale.reshape(x.shape[:-1]), codes.reshape(x.shape)


def _run(kernel: Any, inputs: list[np.ndarray], scalars: int) -> list[np.ndarray]:
    """A search kernel over groups ``inputs`` [..., group]: its ``scalars`` per-group outputs [g] and its codes
    [g, group], the groups laid out LANES side by side (padded with zero groups, dropped again)."""
    import tvm

    group = inputs[0].shape[-1]
    g = int(np.prod(inputs[0].shape[:-1]))
    blocks = -(-g // LANES)

    def lanes(a: np.ndarray) -> np.ndarray:  # [g, group] -> [blocks, group, LANES]
        out = np.zeros((blocks * LANES, group), np.float32)
        out[:g] = a.reshape(g, group)
        return np.ascontiguousarray(out.reshape(blocks, LANES, group).transpose(0, 2, 1))

    outs = [tvm.runtime.empty((blocks, LANES), "float32") for _ in range(scalars)]
    outs.append(tvm.runtime.empty((blocks, group, LANES), "uint8"))
    kernel(*[tvm.runtime.tensor(lanes(a)) for a in inputs], *outs)  # (copies: TVM wants 64-byte aligned data)
    res = [o.numpy().reshape(-1)[:g] for o in outs[:-1]]
    return [*res, outs[-1].numpy().transpose(0, 2, 1).reshape(-1, group)[:g]]
