"""Kernel sweeps for notebooks and benchmarks: PerfX templates vs numpy across a shape family.

The original design was measured on GEMM with M = 12288 output features, K = 4096 and N tokens
from 1 to 4096; ``scale`` divides M and K (and caps N) so the same shape family fits a laptop
or a 2-core CI machine.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from perfx_compiler.targets import TargetDescription, load_target


def _time_numpy(fn: Any, min_s: float = 0.05) -> float:
    fn()
    best, spent = float("inf"), 0.0
    while spent < min_s:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
    return best


def gemm_sweep(
    out_features: int = 12288,
    in_features: int = 4096,
    tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
    scale: int = 1,
    target: str | TargetDescription = "host",
    check: bool = True,
) -> Any:
    """Time y[T, M] = x[T, K] @ W[M, K]^T for each token count T with the default template config.

    Returns a pandas DataFrame: tokens, template, config, seconds, GFLOP/s, GB/s, numpy seconds, ratio.
    Each kernel is checked against numpy (float64) before it is timed.
    """
    import pandas as pd
    import tvm

    from perfx_compiler.schedule import schedule_func
    from perfx_compiler.tune.measure import configure_threads, time_module
    from perfx_compiler.tune.workloads import linear_module, matmul_func

    tdesc = load_target(target) if isinstance(target, str) else target
    configure_threads(tdesc.cores or 1)
    M, K = out_features // scale, in_features // scale
    rows = []
    rng = np.random.default_rng()
    for T in sorted({max(1, t // scale) if t > 1 else 1 for t in tokens}):
        func = matmul_func(linear_module(T, K, M, weights_nk_fused=True))
        scheduled, template, config = schedule_func(func, tdesc)
        rt = tvm.compile(tvm.IRModule({"main": scheduled.with_attr("global_symbol", "main")}), tdesc.tvm()).jit()
        x = rng.standard_normal((1, T, K)).astype(np.float32)
        w = rng.standard_normal((M, K)).astype(np.float32)
        if check:
            out = tvm.runtime.tensor(np.zeros((1, T, M), np.float32))
            rt["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w), out)
            want = x[0].astype(np.float64) @ w.T.astype(np.float64)
            err = float(np.abs(out.numpy()[0] - want).max() / np.abs(want).max())
            if err > 1e-4:
                raise AssertionError(f"{template} {config} wrong at T={T}: relative error {err:.2e}")
        seconds, _ = time_module(rt, scheduled, T, repeat=3, min_ms=10)
        x2, wt = x[0], np.ascontiguousarray(w.T)
        np_seconds = _time_numpy(lambda x2=x2, wt=wt: x2 @ wt)
        flops = 2.0 * T * M * K
        nbytes = 4.0 * (M * K + T * K + T * M)
        rows.append({
            "tokens": T, "M": M, "K": K, "template": template, "config": str(config),
            "seconds": seconds, "gflops": flops / seconds / 1e9, "gbs": nbytes / seconds / 1e9,
            "numpy_seconds": np_seconds, "numpy_gflops": flops / np_seconds / 1e9,
            "speedup_vs_numpy": np_seconds / seconds,
        })
    return pd.DataFrame(rows)


def read_bandwidth_gbs(mib: int = 256, repeats: int = 5) -> float:
    """A quick single-process read-bandwidth estimate (numpy sum over a large array)."""
    a = np.ones(mib * (1 << 20) // 8, dtype=np.float64)
    best = _time_numpy(lambda: a.sum(), min_s=0.2 * repeats / 5)
    return a.nbytes / best / 1e9
