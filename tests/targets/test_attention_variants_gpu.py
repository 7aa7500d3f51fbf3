"""Sliding-window and soft-capped attention (Gemma 2/3, Mistral) in the GPU attention kernels
(``kernels/attention_gpu.py``, ``kernels/paged_attention_gpu.py``): each kernel built for window in
{0, 5, 19} (5: inside one key tile of 16; 19: across tiles) and softcap in {0, 30}, run on PoCL (mali
OpenCL, int64 indices) and lavapipe (vulkan WGSL, int32 indices) on fresh random inputs, with past
lengths that make the window matter; output and written caches vs a float64 numpy reference
(rotate-half RoPE, GQA, masked when ``p - j >= window``, ``C * tanh(s / C)`` before the mask). A kernel
that ignores the window or the cap fails: its output is compared with the plain reference too."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from targets_common import gpu_launcher

pytestmark = pytest.mark.targets

H, KVH, D, MAXC, PS = 4, 2, 16, 64, 8  # GQA 2:1; one key tile is D = 16 keys; 8-token pages
TOL = 1e-4  # relative to the largest |value|
CASES = ((0, 12), (20, 1), (20, 7))  # (past, seq): a prefill, a decode step, a chunk mid-sequence
PAGED_CASES = (*CASES, (13, 17))  # paged: also query tiles 8 + 8 + 1 (the 1-query kernel inside a prefill)
VARIANTS = [(0, 0.0), (5, 0.0), (0, 30.0), (5, 30.0), (19, 0.0), (19, 30.0)]  # (window, softcap)
Q_SCALE = 6.0  # scores of std ~6: a cap of 30 changes them visibly


def attend(q, k, v, kc, vc, past: int, cos, sin, window: int, softcap: float):
    """float64 reference for one sequence: q [S, H*D], k and v [S, KVH*D], caches [KVH, MAXC, D]
    -> (out [S, H*D], k cache, v cache) after appending the rotated k and v at past .. past + S - 1."""
    half, g = D // 2, H // KVH
    kc, vc = kc.astype(np.float64), vc.astype(np.float64)
    out = np.zeros(q.shape)

    def rot(x: np.ndarray, p: int) -> np.ndarray:
        c, s = cos[p].astype(np.float64), sin[p].astype(np.float64)
        return np.concatenate([x[:half] * c - x[half:] * s, x[half:] * c + x[:half] * s])

    for s in range(q.shape[0]):
        p = past + s
        for kh in range(KVH):
            kc[kh, p] = rot(k[s, kh * D : (kh + 1) * D].astype(np.float64), p)
            vc[kh, p] = v[s, kh * D : (kh + 1) * D]
    for s in range(q.shape[0]):
        p = past + s
        j = np.arange(p + 1)
        if window:
            j = j[p - j < window]  # HF / llama.cpp: masked when p - j >= window
        for h in range(H):
            sc = kc[h // g, j] @ (rot(q[s, h * D : (h + 1) * D].astype(np.float64), p) / np.sqrt(D))
            if softcap:
                sc = softcap * np.tanh(sc / softcap)
            w = np.exp(sc - sc.max())
            out[s, h * D : (h + 1) * D] = (w / w.sum()) @ vc[h // g, j]
    return out, kc, vc


def _compile(func: Any, target: str, name: str) -> Any:
    """The kernel as the pipeline builds it for ``target``: vulkan narrows every index to int32."""
    import tvm

    from perfx_compiler.narrow_index import narrow_to_int32
    from perfx_compiler.targets import load_target
    from perfx_compiler.targets_exec.kernels import compile_primfunc

    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    if target == "vulkan":
        mod = narrow_to_int32(mod)
    cf = compile_primfunc(name, mod["main"], load_target(target).tvm())
    if target == "vulkan":
        assert "i64" not in cf.source
    return cf


def _tables() -> tuple[np.ndarray, np.ndarray]:
    ang = np.arange(MAXC)[:, None] / 10000.0 ** (np.arange(0, D, 2) / D)[None]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def _check(what: str, got: tuple, want: tuple, others: dict[str, np.ndarray]) -> dict[str, float]:
    """got (out, k cache, v cache) = want within TOL. Returns how far (relative) got's out is from each
    of ``others``: the outputs this kernel must not compute (without its window, without its cap)."""
    for part, g, w in zip(("out", "k cache", "v cache"), got, want, strict=True):
        err = np.abs(g.astype(np.float64) - w).max() / max(1.0, float(np.abs(w).max()))
        assert err < TOL, f"{what} {part}: error {err:.2e}"
    scale = max(1.0, float(np.abs(want[0]).max()))
    return {other: float(np.abs(got[0].astype(np.float64) - ref).max()) / scale for other, ref in others.items()}


def _assert_variant_matters(what: str, window: int, gaps: list[dict[str, float]]) -> None:
    """The inputs tell the variant from the plain kernel: a kernel ignoring the window or the cap would
    be 10 x TOL or more off. Per case for window 5 (it hides most keys of every case); window 19 hides
    only keys 0-1 from the decode step at 20, whose weight can be negligible, and the cap barely moves a
    case whose one key dominates with or without it (seen: 2.4e-4 over window 5's keys): some case."""
    for other in sorted({o for g in gaps for o in g}):
        per_case = [g[other] for g in gaps if other in g]
        need = per_case if other == "unwindowed" and window <= 5 else [max(per_case)]
        assert min(need) > 10 * TOL, f"{what}: out within {min(need):.1e} of the {other} output"


@pytest.mark.parametrize("target", ["mali", "vulkan"])
@pytest.mark.parametrize("window,softcap", VARIANTS)
def test_cached_attention_gpu_variants(target: str, window: int, softcap: float) -> None:
    from perfx_compiler.kernels.attention_gpu import cached_attention_kernel_gpu

    launcher = gpu_launcher(target)
    index = "int32" if target == "vulkan" else "int64"
    func = cached_attention_kernel_gpu(H, KVH, D, MAXC, "float32", index, window=window, softcap=softcap)
    cf = _compile(func, target, "cached_attention_gpu")
    names = [n for n, _, _ in cf.param_info()]
    rng = np.random.default_rng()
    cos, sin = _tables()
    gaps: list[dict[str, float]] = []
    for past, seq in CASES:
        q = (rng.standard_normal((1, seq, H * D)) * Q_SCALE).astype(np.float32)
        k = rng.standard_normal((1, seq, KVH * D)).astype(np.float32)
        v = rng.standard_normal((1, seq, KVH * D)).astype(np.float32)
        kc = rng.standard_normal((1, KVH, MAXC, D)).astype(np.float32)  # positions < past: earlier tokens
        vc = rng.standard_normal((1, KVH, MAXC, D)).astype(np.float32)
        args = [q, k, v, kc, vc, np.array([past], index), cos, sin, np.zeros_like(q)]
        got = dict(zip(names, launcher.run_numpy(cf, [a.copy() for a in args]), strict=True))
        ref = attend(q[0], k[0], v[0], kc[0], vc[0], past, cos, sin, window, softcap)
        others = {}
        if window and past + seq - 1 >= window:  # the window hides keys once a query is that far from key 0
            others["unwindowed"] = attend(q[0], k[0], v[0], kc[0], vc[0], past, cos, sin, 0, softcap)[0]
        if softcap:
            others["uncapped"] = attend(q[0], k[0], v[0], kc[0], vc[0], past, cos, sin, window, 0.0)[0]
        what = f"cached {target} window={window} softcap={softcap}"
        gaps.append(_check(f"{what} past={past} seq={seq}", (got["OUT"][0], got["KC"][0], got["VC"][0]), ref, others))
    _assert_variant_matters(what, window, gaps)


@pytest.mark.parametrize("target", ["mali", "vulkan"])
@pytest.mark.parametrize("window,softcap", VARIANTS)
def test_paged_attention_gpu_variants(target: str, window: int, softcap: float) -> None:
    """Two sequences on shuffled pages (sequence 1 nine tokens further on), each case's chunk appended
    to both: the pools are gathered into per-sequence caches for the reference and scattered back."""
    from perfx_compiler.kernels.paged_attention_gpu import paged_attention_kernel_gpu

    launcher = gpu_launcher(target)
    index = "int32" if target == "vulkan" else "int64"
    func = paged_attention_kernel_gpu(H, KVH, D, MAXC, PS, "float32", index, window=window, softcap=softcap)
    cf = _compile(func, target, "paged_attention_gpu")
    names = [n for n, _, _ in cf.param_info()]
    rng = np.random.default_rng()
    cos, sin = _tables()
    npp, batch = MAXC // PS, 2
    gaps: list[dict[str, float]] = []
    for past, seq in PAGED_CASES:
        pages = batch * npp + 3
        table = rng.permutation(pages)[: batch * npp].reshape(batch, npp)
        pos = np.array([past, min(past + 9, MAXC - seq)])
        q = (rng.standard_normal((batch, seq, H * D)) * Q_SCALE).astype(np.float32)
        k = rng.standard_normal((batch, seq, KVH * D)).astype(np.float32)
        v = rng.standard_normal((batch, seq, KVH * D)).astype(np.float32)
        kp = rng.standard_normal((pages, PS, KVH, D)).astype(np.float32)
        vp = rng.standard_normal((pages, PS, KVH, D)).astype(np.float32)
        args = [q, k, v, kp, vp, pos.astype(index), table.astype(index), cos, sin, np.zeros_like(q)]
        got = dict(zip(names, launcher.run_numpy(cf, [a.copy() for a in args]), strict=True))
        out, unwindowed, uncapped = np.zeros(q.shape), np.zeros(q.shape), np.zeros(q.shape)
        kp2, vp2 = kp.astype(np.float64), vp.astype(np.float64)
        slots = np.arange(MAXC)
        for b in range(batch):
            page, slot = table[b, slots // PS], slots % PS
            kc, vc = kp[page, slot].transpose(1, 0, 2), vp[page, slot].transpose(1, 0, 2)  # [KVH, MAXC, D]
            p = int(pos[b])
            out[b], kc2, vc2 = attend(q[b], k[b], v[b], kc, vc, p, cos, sin, window, softcap)
            unwindowed[b] = attend(q[b], k[b], v[b], kc, vc, p, cos, sin, 0, softcap)[0]
            uncapped[b] = attend(q[b], k[b], v[b], kc, vc, p, cos, sin, window, 0.0)[0]
            new = slots[p : p + seq]
            kp2[table[b, new // PS], new % PS] = kc2[:, new].transpose(1, 0, 2)
            vp2[table[b, new // PS], new % PS] = vc2[:, new].transpose(1, 0, 2)
        others = {"unwindowed": unwindowed} if window else {}
        if softcap:
            others["uncapped"] = uncapped
        what = f"paged {target} window={window} softcap={softcap}"
        gaps.append(_check(f"{what} positions={pos.tolist()} seq={seq}", (got["OUT"], got["KP"], got["VP"]),
                           (out, kp2, vp2), others))
    _assert_variant_matters(what, window, gaps)


def test_plain_kernels_unchanged_by_the_variant_arguments() -> None:
    """window=0 / softcap=0 build the plain kernels (same TVMScript: models keep their kernels, tuning
    records and digests); a variant shows in the kernel; negative values are refused."""
    from perfx_compiler.errors import UnsupportedModelError
    from perfx_compiler.kernels.attention_gpu import cached_attention_kernel_gpu
    from perfx_compiler.kernels.paged_attention_gpu import paged_attention_kernel_gpu

    cached = cached_attention_kernel_gpu(H, KVH, D, MAXC).script()
    paged = paged_attention_kernel_gpu(H, KVH, D, MAXC, PS).script()
    assert cached_attention_kernel_gpu(H, KVH, D, MAXC, window=0, softcap=0.0).script() == cached
    assert paged_attention_kernel_gpu(H, KVH, D, MAXC, PS, window=0, softcap=0.0).script() == paged
    assert "tanh" not in cached and "tanh" not in paged
    assert "T.tanh" in cached_attention_kernel_gpu(H, KVH, D, MAXC, softcap=50.0).script()
    assert "T.tanh" in paged_attention_kernel_gpu(H, KVH, D, MAXC, PS, softcap=50.0).script()
    assert "T.int64(5)" in cached_attention_kernel_gpu(H, KVH, D, MAXC, window=5).script()
    with pytest.raises(ValueError, match="window"):
        cached_attention_kernel_gpu(H, KVH, D, MAXC, window=-1)
    with pytest.raises(UnsupportedModelError, match="softcap"):
        paged_attention_kernel_gpu(H, KVH, D, MAXC, PS, softcap=-1.0)
