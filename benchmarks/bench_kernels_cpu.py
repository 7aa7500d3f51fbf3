"""Kernel benchmark on SmolLM2-135M shapes (CPU): our templates vs TVM dlight vs numpy/OpenBLAS.

Default mode (``--prefill``, issue #3's target): the prefill GEMMs of the default model as the
compiler builds them (weights pre-packed into [N / nb, K, nb] panels by the weight_layout pass,
symbolic M), at M = 16, 64, 128, 512 rows, for qkv (576 -> 960), o_proj (576 -> 576), gate_up
(576 -> 3072), down_proj (1536 -> 576) and the full-sequence lm_head (576 -> 49152):
  ours_tuned    PerfX gemm_cpu, best of a small search per case (records in
                tuning_logs/<target>/kernels_cpu.jsonl; a rerun reuses them)
  ours_default  gemm_cpu's default configuration
  numpy         x @ W.T, OpenBLAS with 2 threads (OPENBLAS_NUM_THREADS / TVM_NUM_THREADS = 2;
                OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE are dropped for this process so that
                OpenBLAS picks its kernel for this CPU: the strongest baseline; the CSV names it),
                and pinned to 1 thread; ratios use the faster of the two (on a shared host
                OpenBLAS's 2 threads can stall on preemption)
  dlight        TVM dlight's CPU rules on the unpacked NT matmul, as ``--schedule dlight`` builds
                it (no CPU GEMM rule exists: "unscheduled"; cases above 2 GFLOP are not timed)
Every variant is timed in alternated rounds (one burst of each per round, the burst's median),
and the reported time is the median over rounds. Writes benchmarks/results/kernels_cpu_prefill.csv
and .png. ``--decode``: the older per-kernel table (decode GEMVs, norms) -> kernels_cpu.csv.

For each linear layer (M = 1 decode, static; M = 128 / 512 prefill, symbolic ``seq``) and for
RMSNorm / SiLU*mul, time:
  ours_default  the template's default configuration
  ours_tuned    best of a small search (records in tuning_logs/<target>/kernels_cpu.jsonl)
  dlight        dl.ApplyDefaultSchedule(dl.cpu.GEMV(), dl.cpu.Reduction()); unscheduled where
                neither rule applies (marked "unscheduled")
  numpy         x @ w.T (OpenBLAS) / the numpy expression, with OpenBLAS threads and with one
                thread (threadpoolctl); speedups are against the faster of the two
Variants are timed in interleaved rounds and the minimum kept (the machine is shared); every
variant, TVM or numpy, is timed by its fastest single call (min over up to 200 calls / 0.2 s).
Writes benchmarks/results/kernels_cpu.csv and kernels_cpu.png.

    python benchmarks/bench_kernels_cpu.py [--trials 8] [--rounds 5] [--ms 16,64,128,512]
    python benchmarks/bench_kernels_cpu.py --decode [--trials 16] [--layout nt|nn] [--quick]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

# Before numpy loads OpenBLAS: 2 threads on both sides, and OpenBLAS's own kernel choice.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "2")
os.environ.setdefault("TVM_NUM_THREADS", "2")
if "--keep-openblas-env" not in sys.argv:
    os.environ.pop("OPENBLAS_CORETYPE", None)
    os.environ.pop("OPENBLAS_L2_SIZE", None)

import numpy as np  # noqa: E402
from _common import RESULTS, figure, write_csv  # noqa: E402

from perfx_compiler.schedule_template import find_template  # noqa: E402
from perfx_compiler.targets import load_target  # noqa: E402
from perfx_compiler.tune.measure import build_func, time_module  # noqa: E402
from perfx_compiler.tune.workloads import (  # noqa: E402
    SMOLLM2_LINEARS,
    TuningTask,
    elementwise_module,
    linear_module,
    matmul_func,
    rmsnorm_module,
    single_func,
)

SLOW_FLOP_LIMIT = 4e9  # unscheduled kernels above this many flops are timed once


def dlight_schedule(func: Any, target: Any) -> tuple[Any, str]:
    import tvm
    from tvm.s_tir import dlight as dl

    mod = tvm.IRModule({"main": func})
    with target.tvm():
        out = dl.ApplyDefaultSchedule(dl.cpu.GEMV(), dl.cpu.Reduction())(mod)
    new = out["main"]
    scheduled = new.attrs is not None and "tirx.is_scheduled" in new.attrs
    return new, "dlight" if scheduled else "unscheduled"


def time_numpy(fn: Any, min_s: float = 0.2) -> float:
    fn()
    best = math.inf
    deadline = time.perf_counter() + min_s
    runs = 0
    while runs < 5 or (time.perf_counter() < deadline and runs < 200):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        runs += 1
    return best


def tvm_timer(func: Any, target: Any, m: int, flops: float) -> Any:
    """A callable returning the fastest single call (seconds) of ``func`` at M = m: the same
    statistic as ``time_numpy`` (min over up to 200 calls / 0.2 s), so that on a shared machine
    neither side is compared by a mean that includes preemptions against the other's best call."""
    import tvm

    from perfx_compiler.tune.measure import _to_arg, random_inputs

    rt = build_func(func, target)
    if flops > SLOW_FLOP_LIMIT:
        return lambda: time_module(rt, func, m, repeat=1, min_ms=0)[0]
    dev = tvm.cpu()
    args = [_to_arg(a, dev) for a in random_inputs(func, m, seed=1)]
    one = min(rt.time_evaluator("main", dev, number=1, repeat=3)(*args).results)
    repeat = int(min(200, max(5, 0.2 / max(one, 1e-7))))
    return lambda: float(min(rt.time_evaluator("main", dev, number=1, repeat=repeat)(*args).results))


def numpy_timers(fn: Any) -> dict[str, Any]:
    """numpy with OpenBLAS's own threading, and pinned to one thread: on a loaded 2-core machine
    OpenBLAS's spinning threads can lose to one thread, so the baseline is the better of the two."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return {"numpy_us": lambda: time_numpy(fn)}

    def one_thread() -> float:
        with threadpool_limits(limits=1, user_api="blas"):
            return time_numpy(fn)

    return {"numpy_us": lambda: time_numpy(fn), "numpy_1t_us": one_thread}


def tuned_config(func: Any, target: Any, m: int, trials: int, db: Any, measurer: Any) -> dict | None:
    """Best recorded config for this kernel at M = m, searching first until ``trials`` candidates
    are on record (a rerun reuses the log instead of measuring again)."""
    from perfx_compiler.tune.cost_model import CostModel
    from perfx_compiler.tune.search import tune_task

    template, wl = find_template(func, target)
    task = TuningTask("bench", func, template, wl, m)
    have = len(db.for_workload(wl.key, wl.target_key, task.bucket))
    if trials > have and measurer is not None:
        model = CostModel()
        model.add_records(db.records(), {wl.key: wl})
        model.fit()
        tune_task(task, target, db, measurer, model, trials=trials - have, batch=8)
    best = db.best(wl.key, wl.target_key, bucket=task.bucket)
    return None if best is None else best.config


def cases(layout: str, quick: bool) -> list[dict[str, Any]]:
    out = []
    ms = [1, 128] if quick else [1, 128, 512]
    names = ["q_proj", "gate_up", "down_proj", "lm_head"] if quick else list(SMOLLM2_LINEARS)
    for name in names:
        if name == "o_proj":
            continue  # same shape as q_proj
        K, N = SMOLLM2_LINEARS[name]
        for m in ms:
            if quick and name == "lm_head" and m > 1:
                continue  # --quick: lm_head only as the decode GEMV (its prefill GEMM is minutes untuned)
            out.append({"kernel": name, "K": K, "N": N, "M": m, "kind": "linear", "layout": layout})
    for m in ms:
        out.append({"kernel": "rmsnorm", "K": 576, "N": 576, "M": m, "kind": "rmsnorm", "layout": "-"})
        out.append({"kernel": "silu_mul", "K": 0, "N": 1536, "M": m, "kind": "silu_mul", "layout": "-"})
    return out


def make_case(case: dict[str, Any]) -> tuple[Any, Any, float]:
    """(PrimFunc, numpy callable, flops) for one case; M = 1 is static, prefill symbolic."""
    m, K, N = case["M"], case["K"], case["N"]
    sym = None if m > 1 else 1
    rng = np.random.default_rng(0)
    if case["kind"] == "linear":
        func = matmul_func(linear_module(sym, K, N, None, case["layout"] == "nt"))
        x = rng.standard_normal((m, K)).astype("float32")
        w = rng.standard_normal((N, K)).astype("float32")
        return func, (lambda: x @ w.T), 2.0 * m * N * K
    if case["kind"] == "rmsnorm":
        func = single_func(rmsnorm_module(sym, K))
        x = rng.standard_normal((m, K)).astype("float32")
        g = rng.standard_normal(K).astype("float32")

        def norm() -> np.ndarray:
            return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g

        return func, norm, 4.0 * m * K
    func = single_func(elementwise_module(sym, N, "silu_mul"))
    a = rng.standard_normal((m, N)).astype("float32")
    b = rng.standard_normal((m, N)).astype("float32")
    return func, (lambda: a / (1 + np.exp(-a)) * b), 5.0 * m * N


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="host")
    parser.add_argument("--decode", action="store_true", help="the older per-kernel table (decode GEMVs, norms)")
    parser.add_argument("--trials", type=int, default=None, help="search trials per kernel (0: no tuning; default 8, 16 with --decode)")
    parser.add_argument("--layout", choices=["nn", "nt"], default="nt",
                        help="--decode: nt: weights [N, K] (FuseTransposeMatmul); nn: w^T [K, N]")
    parser.add_argument("--quick", action="store_true",
                        help="fewer shapes: q_proj, gate_up, down_proj at M 1/128, lm_head at M 1, norms")
    parser.add_argument("--rounds", type=int, default=None, help="alternated timing rounds (default 5; 3 with --decode)")
    parser.add_argument("--ms", default="16,64,128,512", help="prefill rows (M) to time")
    parser.add_argument("--kernels", default=None, help="prefill: comma-separated subset of qkv,o_proj,gate_up,down_proj,lm_head")
    parser.add_argument("--keep-openblas-env", action="store_true", help="keep OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not args.decode:
        from bench_kernels_prefill import run_prefill

        args.trials = 8 if args.trials is None else args.trials
        args.rounds = args.rounds or 5
        run_prefill(args)
        return
    args.trials = 16 if args.trials is None else args.trials
    args.rounds = args.rounds or 3
    args.out = args.out or str(RESULTS / "kernels_cpu.csv")

    from perfx_compiler.tune.measure import LocalMeasurer
    from perfx_compiler.tune.records import TuningDatabase

    target = load_target(args.target)
    from perfx_compiler.tune.measure import configure_threads

    # Same core count as OpenBLAS gets; TVM's default here would be one thread (see the function).
    print(f"TVM threads: {configure_threads(target.cores)}")
    db = TuningDatabase.for_target(target.name, name="kernels_cpu")
    measurer = LocalMeasurer(target, repeat=3, min_repeat_ms=10) if args.trials else None
    rows = []
    for case in cases(args.layout, args.quick):
        func, np_fn, flops = make_case(case)
        m = case["M"]
        template, wl = find_template(func, target)
        timers: dict[str, Any] = {}
        default = template.default_config(wl, target)
        timers["ours_default_us"] = tvm_timer(template.apply(func, wl, default, target), target, m, 0)
        cfg = None
        if args.trials and template.space(wl, target):
            cfg = tuned_config(func, target, m, args.trials, db, measurer)
        if cfg is not None:
            timers["ours_tuned_us"] = tvm_timer(template.apply(func, wl, cfg, target), target, m, 0)
        dl_func, dl_kind = dlight_schedule(func, target)
        slow = dl_kind == "unscheduled" and flops > SLOW_FLOP_LIMIT
        timers["dlight_us"] = tvm_timer(dl_func, target, m, flops if dl_kind == "unscheduled" else 0)
        timers.update(numpy_timers(np_fn))
        # Interleaved rounds, min per variant: other tenants of the machine come and go, and a
        # variant timed during a busy spell should not lose to one timed in a quiet one.
        times = {k: math.inf for k in timers}
        for r in range(args.rounds):
            for key, timer in timers.items():
                if key == "dlight_us" and slow and r > 0:
                    continue  # minutes per call unscheduled: once is enough
                times[key] = min(times[key], timer())
        t_np = min(v for k, v in times.items() if k.startswith("numpy"))
        ours = min(times["ours_default_us"], times.get("ours_tuned_us", math.inf))
        row = {
            **case,
            "template": template.name,
            "ours_default_us": times["ours_default_us"] * 1e6,
            "ours_tuned_us": times.get("ours_tuned_us", math.nan) * 1e6,
            "dlight_us": times["dlight_us"] * 1e6,
            "dlight_kind": dl_kind,
            "numpy_us": times["numpy_us"] * 1e6,
            "numpy_1t_us": times.get("numpy_1t_us", math.nan) * 1e6,
            "ours_gflops": flops / ours / 1e9,
            "vs_numpy": t_np / ours,
            "vs_dlight": times["dlight_us"] / ours,
            "tuned_config": cfg or {},
            "load_avg_1m": os.getloadavg()[0],  # the machine is shared: read timings with this
        }
        rows.append(row)
        print(
            f"{case['kernel']:>9} M={m:<4} {template.name:<16} default {row['ours_default_us']:9.1f} us"
            f"  tuned {row['ours_tuned_us']:9.1f} us  {dl_kind} {row['dlight_us']:11.1f} us"
            f"  numpy {row['numpy_us']:9.1f} / 1 thread {row['numpy_1t_us']:9.1f} us"
            f"  -> {row['vs_numpy']:.2f}x numpy, {row['vs_dlight']:.1f}x dlight  (load {row['load_avg_1m']:.1f})",
            flush=True,
        )
    if measurer is not None:
        measurer.close()
    out = write_csv(args.out, rows, floats=".2f")
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    labels = [f"{r['kernel']}\nM={r['M']}" for r in rows]
    series = [
        ("ours_default_us", "ours (default)"),
        ("ours_tuned_us", "ours (tuned)"),
        ("dlight_us", "TVM dlight / unscheduled"),
        ("numpy_best_us", "numpy (OpenBLAS, best of 1 / 2 threads)"),
    ]
    for r in rows:
        r["numpy_best_us"] = min(r["numpy_us"], r["numpy_1t_us"]) if not math.isnan(r["numpy_1t_us"]) else r["numpy_us"]
    x = np.arange(len(rows))
    width = 0.2
    with figure(path, figsize=(max(10, len(rows) * 0.9), 5), dpi=120) as (_fig, ax):
        for i, (key, name) in enumerate(series):
            vals = [r[key] if not math.isnan(r[key]) else 0 for r in rows]
            ax.bar(x + (i - 1.5) * width, vals, width, label=name)
        ax.set_yscale("log")
        ax.set_ylabel("time per call (us, log)")
        ax.set_xticks(x)
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_title("SmolLM2-135M kernels on CPU (lower is better)")
        ax.legend(fontsize=8)


if __name__ == "__main__":
    main()
