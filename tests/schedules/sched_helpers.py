"""Numerical checks shared by the schedule tests: numpy references for the model's functions."""

from __future__ import annotations

import itertools
import random
from typing import Any

import numpy as np

from perfx_compiler.tune.measure import build_func, random_inputs, run_func
from tests._cpu import has_vnni, needs_vnni  # noqa: F401  (re-exported for the schedule tests)


def int8_rounding_slack(x: np.ndarray, w: np.ndarray, group: int, margin: float = 1e-3) -> np.ndarray:
    """Per output of ``quantize_activations(x) @ w.T``: how far it may move when a fused prologue's x
    (float32, summed in another order than the float64 reference) lands on the other side of an int8
    rounding step. For each x whose x * 127 / amax is within ``margin`` of a half-integer, one code
    step times its weight column; at most k / 64 such x, or the check would say little."""
    x = np.asarray(x, np.float64).reshape(-1)
    k = x.size
    g = np.zeros(-(-k // group) * group)
    g[:k] = x
    g = g.reshape(-1, group)
    amax = np.abs(g).max(axis=1, keepdims=True)
    t = np.divide(g * 127.0, amax, out=np.zeros_like(g), where=amax > 0)
    near = (np.abs(np.abs(t - np.trunc(t)) - 0.5) < margin).reshape(-1)[:k]
    assert near.sum() <= max(2, k // 64), f"{near.sum()} of {k} activations sit on an int8 rounding step"
    step = np.broadcast_to(amax / 127.0, g.shape).reshape(-1)[:k]
    return np.abs(np.asarray(w, np.float64)[:, near]) @ step[near]


def vnni_weights(fmt: str, n: int, k: int, rng: np.random.Generator) -> tuple[Any, np.ndarray]:
    """(Random [N, K] weights packed in the VNNI layout, the float64 dequantized W) for a format name:
    ``q8``/``Q8_0`` (the same blocks: int8 codes, one f16 scale per 32), ``Q4_1`` (random codes, scales
    and mins), ``Q4_0`` or the PerfX int4 groups ``g128``, ``g64s`` (symmetric), ``g32``."""
    from perfx_compiler.formats.gguf_blocks import Q4_0, Q4_1
    from perfx_compiler.formats.int4 import Int4Format, dequantize_int4, quantize_int4
    from perfx_compiler.formats.int8 import dequantize_int8, quantize_int8
    from perfx_compiler.formats.vnni import q4_vnni_packed, q8_vnni_packed

    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    if fmt in ("q8", "Q8_0"):
        codes, scale = quantize_int8(w, 32)
        return q8_vnni_packed(codes, scale, 32), dequantize_int8(codes, scale, 32).astype(np.float64)
    if fmt == "Q4_1":  # GGUF offset format: w = q * d + m, random mins
        codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
        d = (rng.random((n, k // 32)) * 0.01).astype(np.float16)
        m = (-rng.random((n, k // 32)) * 0.08).astype(np.float16)
        idx = np.arange(k) // 32
        wd = codes * d.astype(np.float64)[:, idx] + m.astype(np.float64)[:, idx]
        return q4_vnni_packed(codes, d, m, Q4_1), wd
    f = {"Q4_0": Q4_0, "g128": Int4Format(128, False), "g64s": Int4Format(64, True),
         "g32": Int4Format(32, False)}[fmt]
    codes, scale, zero = quantize_int4(w, f)
    return q4_vnni_packed(codes, scale, zero, f), dequantize_int4(codes, scale, zero, f.group).astype(np.float64)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def linear_reference(func: Any, arrays: list[np.ndarray], epilogue: str | None) -> np.ndarray:
    """numpy result of a linear_module function: x [1, M, K], weights [N, K] (NT) or [K, N] (NN)."""
    x, w = arrays[0].astype(np.float64), arrays[1].astype(np.float64)
    K = x.shape[-1]
    nt = "NT_matmul" in func.script()
    y = x @ (w.T if nt else w)
    assert y.shape[-1] == (w.shape[0] if nt else w.shape[1]) and w.shape[1 if nt else 0] == K
    if epilogue in ("add", "bias"):
        y = y + arrays[2]
    elif epilogue == "silu_mul":
        y = _silu(y) * arrays[2]
    elif epilogue == "silu":
        y = _silu(y)
    return y


def rmsnorm_reference(arrays: list[np.ndarray], eps: float = 1e-5) -> np.ndarray:
    x, g = arrays[0].astype(np.float64), arrays[1].astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g


def elementwise_reference(op: str, arrays: list[np.ndarray]) -> np.ndarray:
    if op == "take":
        return arrays[0][arrays[1].astype(np.int64)]
    if op == "add":
        return arrays[0] + arrays[1]
    return _silu(arrays[0].astype(np.float64)) * arrays[1]


def check_func(
    scheduled: Any,
    func: Any,
    target: Any,
    ms: list[int],
    reference: Any,
    seed: int = 0,
    rtol: float = 2e-5,
) -> None:
    """Run ``scheduled`` on fresh random inputs for each M and compare with ``reference(arrays)``."""
    rt = build_func(scheduled, target)
    for i, m in enumerate(ms):
        arrays = random_inputs(func, m, seed=seed + 101 * i)
        got = run_func(rt, func, [a.copy() for a in arrays])[0]
        want = reference(arrays)
        assert got.shape == want.shape, (m, got.shape, want.shape)
        scale = max(1.0, float(np.abs(want).max()))
        err = float(np.abs(got - want).max()) / scale
        assert err <= rtol, f"M={m}: max relative error {err:.2e} > {rtol:.0e}"


def sample_configs(template: Any, workload: Any, target: Any, n: int, seed: int = 0) -> list[dict]:
    """The default plus ``n`` distinct valid configurations drawn from the template's space."""
    space = template.space(workload, target)
    default = template.default_config(workload, target)
    combos = [dict(zip(space, vals, strict=True)) for vals in itertools.product(*space.values())]
    valid = [c for c in combos if c != default and template.is_valid(workload, c, target)]
    rng = random.Random(seed)
    return [default, *rng.sample(valid, min(n, len(valid)))]


def prologue_x(prologue: str, inputs: list[np.ndarray], k: int) -> np.ndarray:
    """x the fused GEMV multiplies with, in float64 then rounded to float32 (as the separate kernel stores it)."""
    if prologue == "swiglu":
        g, u = inputs[0][..., :k].astype(np.float64), inputs[0][..., k:].astype(np.float64)
        return (g / (1 + np.exp(-g)) * u).astype(np.float32)
    a, b, w = (v.astype(np.float64) for v in inputs)
    s = a + b
    return (s / np.sqrt((s * s).mean(-1, keepdims=True) + 1e-5) * w).astype(np.float32)
