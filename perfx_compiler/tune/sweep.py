"""Kernel sweeps for notebooks and benchmarks: PerfX templates vs numpy across a shape family.

The original design was measured on GEMM with M = 12288 output features, K = 4096 and N tokens
from 1 to 4096; ``scale`` divides M and K (and the token counts) so the same shape family fits a
laptop or a 2-core CI machine. ``int4_gemv_sweep`` does the same for the decode-time int4 group-
quantized GEMV (the kernels ``quantization=q4_g128`` compiles to). Every kernel is checked against
numpy in float64 before it is timed; the ``max_rel_err`` column says by how much it matched.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from perfx_compiler.targets import TargetDescription, load_target

DESIGN_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
GEMV_MAX_T = 8  # token counts up to this compile to static-M GEMV kernels (the decode path)
CHECK_TOL = 1e-4


def _time_numpy(fn: Any, min_s: float = 0.05) -> float:
    fn()
    best, spent = float("inf"), 0.0
    while spent < min_s:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
    return best


def _time_numpy_best(fn: Any) -> float:
    """numpy's best: with OpenBLAS's threads and pinned to one thread (threadpoolctl), after a
    pause that lets TVM's spinning pool threads go idle; on a loaded 2-core machine OpenBLAS's
    threads otherwise fight TVM's for the cores and the baseline looks 100x slower than it is."""
    time.sleep(0.05)
    best = _time_numpy(fn)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return best
    with threadpool_limits(limits=1, user_api="blas"):
        return min(best, _time_numpy(fn))


def _time_tvm(rt: Any, args: list[Any], min_s: float = 0.15) -> float:
    """Fastest single call (seconds), the statistic ``_time_numpy`` uses: on a shared machine a
    mean over calls would include preemptions the numpy side does not pay."""
    import tvm

    dev = tvm.cpu()
    one = min(rt.time_evaluator("main", dev, number=1, repeat=3)(*args).results)
    repeat = int(min(200, max(5, min_s / max(one, 1e-7))))
    return float(min(rt.time_evaluator("main", dev, number=1, repeat=repeat)(*args).results))


def _target(target: str | TargetDescription) -> TargetDescription:
    from perfx_compiler.tune.measure import configure_threads

    tdesc = load_target(target) if isinstance(target, str) else target
    configure_threads(tdesc.cores or 1)
    return tdesc


def _compile(scheduled: Any, tdesc: TargetDescription) -> Any:
    from perfx_compiler.stack_alloca import compile_kernel

    return compile_kernel(scheduled, tdesc).jit()


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got.astype(np.float64) - want).max() / max(1e-30, float(np.abs(want).max())))


def sweep_tokens(scale: int, tokens: tuple[int, ...] = DESIGN_TOKENS) -> list[int]:
    """The design's token counts divided by ``scale`` (1 stays 1; duplicates dropped)."""
    return sorted({max(1, t // scale) if t > 1 else 1 for t in tokens})


def gemm_sweep(
    out_features: int = 12288,
    in_features: int = 4096,
    tokens: tuple[int, ...] = DESIGN_TOKENS,
    scale: int = 1,
    target: str | TargetDescription = "host",
    check: bool = True,
    records: Any = None,
) -> Any:
    """Time y[T, M] = x[T, K] @ W[M, K]^T for each token count T, as the compiled model runs it:
    T <= 8 with a static-T kernel (GEMV template, decode), larger T with ONE symbolic-T kernel
    (GEMM template, prefill) compiled once and timed at every T. ``records``: a TuningDatabase to
    configure the kernels from (template defaults otherwise).

    Returns a pandas DataFrame: tokens, template, config, seconds, GFLOP/s, GB/s, numpy seconds,
    numpy GFLOP/s, speedup vs numpy, max relative error vs float64.
    """
    import pandas as pd
    import tvm

    from perfx_compiler.schedule import apply_schedules
    from perfx_compiler.schedule_template import find_template
    from perfx_compiler.tune.workloads import linear_module, matmul_func

    tdesc = _target(target)
    M, K = out_features // scale, in_features // scale
    rng = np.random.default_rng(0)
    w = rng.standard_normal((M, K)).astype(np.float32)
    wt = np.ascontiguousarray(w.T)
    w_dev = tvm.runtime.tensor(w)
    kernels: dict[Any, tuple[Any, Any, str, str]] = {}
    rows = []
    for T in sweep_tokens(scale, tokens):
        key = T if T <= GEMV_MAX_T else None
        if key not in kernels:
            mod = linear_module(key, K, M, weights_nk_fused=True)
            found = find_template(matmul_func(mod), tdesc)
            func = matmul_func(apply_schedules(mod, tdesc, records))
            name = found[0].name if found else "unscheduled"
            kernels[key] = (_compile(func, tdesc), func, name, "static T" if key else "symbolic T")
        rt, func, template, kind = kernels[key]
        x = rng.standard_normal((1, T, K)).astype(np.float32)
        out = tvm.runtime.tensor(np.zeros((1, T, M), np.float32))
        args = [tvm.runtime.tensor(x), w_dev, out]
        err = float("nan")
        if check:
            rt["main"](*args)
            err = _rel_err(out.numpy()[0], x[0].astype(np.float64) @ w.T.astype(np.float64))
            if err > CHECK_TOL:
                raise AssertionError(f"{template} wrong at T={T}: relative error {err:.2e}")
        seconds = _time_tvm(rt, args)
        x2 = x[0]
        np_seconds = _time_numpy_best(lambda x2=x2: x2 @ wt)
        flops = 2.0 * T * M * K
        nbytes = 4.0 * (M * K + T * K + T * M)
        rows.append({
            "tokens": T, "M": M, "K": K, "template": template, "kernel": kind,
            "seconds": seconds, "gflops": flops / seconds / 1e9, "gbs": nbytes / seconds / 1e9,
            "numpy_seconds": np_seconds, "numpy_gflops": flops / np_seconds / 1e9,
            "numpy_gbs": nbytes / np_seconds / 1e9, "speedup_vs_numpy": np_seconds / seconds,
            "max_rel_err": err,
        })
    return pd.DataFrame(rows)


def int4_gemv_sweep(
    out_features: tuple[int, ...] = (1536, 3072, 6144, 12288),
    in_features: int = 4096,
    scale: int = 1,
    group: int = 128,
    target: str | TargetDescription = "host",
    check: bool = True,
) -> Any:
    """Decode GEMV y[1, N] = x[1, K] @ dequant(Wq)[N, K]^T with int4 weights (``q4_g{group}``,
    the pass's packing) for each N in ``out_features`` / scale, K = in_features / scale; against
    numpy's fp32 GEMV on the dequantized weights (what the int4 kernel saves is bandwidth:
    0.5 + 3/group bytes per weight instead of 4).

    Returns a DataFrame: N, K, template, config, seconds, GB/s (of int4 bytes), effective GFLOP/s,
    numpy seconds / GB/s (of fp32 bytes), speedup vs numpy, max relative error vs float64.
    """
    import pandas as pd
    import tvm

    from perfx_compiler.formats.int4 import Int4Format, dequantize_int4, int4_matmul_compute, pack_int4, quantize_int4
    from perfx_compiler.schedule import schedule_func

    tdesc = _target(target)
    fmt = Int4Format(group=group, symmetric=False)
    K = in_features // scale
    rng = np.random.default_rng(0)
    rows = []
    for n_full in out_features:
        N = max(16, n_full // scale)
        lanes = fmt.lanes(K)
        w = rng.standard_normal((N, K)).astype(np.float32)
        codes, s, z = quantize_int4(w, fmt)
        wq = dequantize_int4(codes, s, z, group)
        func = int4_matmul_compute(N, K, group, lanes, False, kind="matmul", rows=(1, 1))
        scheduled, template, config = schedule_func(func, tdesc)
        rt = _compile(scheduled, tdesc)
        x = rng.standard_normal((1, 1, K)).astype(np.float32)
        args = [x, pack_int4(codes, lanes), np.ascontiguousarray(s), np.ascontiguousarray(z)]
        err = float("nan")
        if check:
            out = tvm.runtime.tensor(np.zeros((1, 1, N), np.float32))
            rt["main"](*(tvm.runtime.tensor(a) for a in args), out)
            err = _rel_err(out.numpy()[0], x[0].astype(np.float64) @ wq.T.astype(np.float64))
            if err > CHECK_TOL:
                raise AssertionError(f"{template} int4 GEMV wrong at N={N}, K={K}: relative error {err:.2e}")
        dev_args = [tvm.runtime.tensor(a) for a in args] + [tvm.runtime.tensor(np.zeros((1, 1, N), np.float32))]
        seconds = _time_tvm(rt, dev_args)
        x2, wqt = x[0], np.ascontiguousarray(wq.T)
        np_seconds = _time_numpy_best(lambda x2=x2, wqt=wqt: x2 @ wqt)
        q_bytes = N * K / 2 + 3.0 * N * -(-K // group) + 4.0 * (K + N)
        rows.append({
            "N": N, "K": K, "group": group, "template": template, "config": str(config),
            "seconds": seconds, "gbs": q_bytes / seconds / 1e9, "gflops": 2.0 * N * K / seconds / 1e9,
            "numpy_seconds": np_seconds, "numpy_gbs": 4.0 * (N * K + K + N) / np_seconds / 1e9,
            "speedup_vs_numpy": np_seconds / seconds, "max_rel_err": err,
        })
    return pd.DataFrame(rows)


def read_bandwidth_gbs(mib: int = 256, repeats: int = 5) -> float:
    """A quick single-process read-bandwidth estimate (numpy sum over a large array)."""
    a = np.ones(mib * (1 << 20) // 8, dtype=np.float64)
    best = _time_numpy(lambda: a.sum(), min_s=0.2 * repeats / 5)
    return a.nbytes / best / 1e9


def machine_summary(target: str | TargetDescription = "host", mib: int = 256) -> dict[str, Any]:
    """What the sweeps are judged against: measured read bandwidth, the target file's nominal
    bandwidth / peak, core count and the load average while measuring (the machine may be shared)."""
    import os

    tdesc = load_target(target) if isinstance(target, str) else target
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "target": tdesc.name, "cores": tdesc.cores, "read_gbs_measured": read_bandwidth_gbs(mib),
        "bandwidth_gbs_nominal": tdesc.memory_bandwidth_gbs, "peak_gflops_nominal": tdesc.peak_gflops_fp32,
        "loadavg_1m": load[0],
    }


def plot_sweeps(gemm: Any, int4: Any | None = None, read_gbs: float | None = None) -> Any:
    """GFLOP/s and GB/s of the GEMM sweep against tokens (PerfX vs numpy, log x), and GB/s of the
    int4 GEMV sweep against N, with the measured read bandwidth as a line. Returns the figure."""
    import matplotlib.pyplot as plt

    ncols = 3 if int4 is not None and len(int4) else 2
    fig, axes = plt.subplots(1, ncols, figsize=(5.2 * ncols, 4.0))
    ax = axes[0]
    ax.plot(gemm["tokens"], gemm["gflops"], "o-", label="PerfX")
    ax.plot(gemm["tokens"], gemm["numpy_gflops"], "s--", label="numpy / OpenBLAS")
    ax.set(xscale="log", xlabel="tokens (N)", ylabel="GFLOP/s", title=f"GEMM {gemm['M'].iloc[0]}x{gemm['K'].iloc[0]}")
    ax.legend()
    ax = axes[1]
    ax.plot(gemm["tokens"], gemm["gbs"], "o-", label="PerfX")
    ax.plot(gemm["tokens"], gemm["numpy_gbs"], "s--", label="numpy / OpenBLAS")
    if read_gbs:
        ax.axhline(read_gbs, color="gray", ls=":", label=f"read bandwidth {read_gbs:.0f} GB/s")
    ax.set(xscale="log", yscale="log", xlabel="tokens (N)", ylabel="GB/s (weights + activations)", title="GEMM bytes")
    ax.legend()
    if ncols == 3:
        ax = axes[2]
        ax.plot(int4["N"], int4["gbs"], "o-", label="PerfX int4 (bytes read)")
        ax.plot(int4["N"], int4["numpy_gbs"], "s--", label="numpy fp32 GEMV")
        if read_gbs:
            ax.axhline(read_gbs, color="gray", ls=":", label="read bandwidth")
        ax.set(xscale="log", xlabel="output features N", ylabel="GB/s", title=f"int4 g{int4['group'].iloc[0]} GEMV, K={int4['K'].iloc[0]}")
        ax.legend()
    fig.tight_layout()
    return fig
