"""Prefill GEMM benchmark of ``bench_kernels_cpu.py`` (its default mode; see that file's doc).

Each case is one linear layer of SmolLM2-135M at M prefill rows, in the form the compile pipeline
gives it on this CPU: weights packed at compile time into [N / nb, K, nb] panels, M symbolic.
"""

from __future__ import annotations

import math
import os
import statistics
from pathlib import Path
from typing import Any

import numpy as np
from _common import RESULTS, figure, write_csv

from perfx_compiler.schedule_template import find_template
from perfx_compiler.targets import load_target
from perfx_compiler.tune.measure import _to_arg, build_func, configure_threads, random_inputs
from perfx_compiler.tune.workloads import linear_module, matmul_func, packed_linear_func

PREFILL_LINEARS = {  # name -> (K, N) after merge_projections (q|k|v and gate|up merged)
    "qkv": (576, 960),
    "o_proj": (576, 576),
    "gate_up": (576, 3072),
    "down_proj": (1536, 576),
    "lm_head": (576, 49152),  # prefill_all: logits for every position
}
DLIGHT_FLOP_LIMIT = 2e9  # unscheduled (dlight has no CPU GEMM rule): larger cases take minutes
BURST_S = 0.15  # one variant's burst per round: calls until this long (3..50 calls)


def _tvm_burst(rt: Any, func: Any, m: int, max_calls: int = 50) -> Any:
    import tvm

    dev = tvm.cpu()
    args = [_to_arg(a, dev) for a in random_inputs(func, m, seed=1)]
    one = min(rt.time_evaluator("main", dev, number=1, repeat=2)(*args).results)
    calls = int(min(max_calls, max(3, BURST_S / max(one, 1e-7))))
    if one > 1.0:
        calls = 1
    return lambda: statistics.median(rt.time_evaluator("main", dev, number=1, repeat=calls)(*args).results)


def _numpy_burst(fn: Any) -> Any:
    import time

    fn()

    def burst() -> float:
        times: list[float] = []
        deadline = time.perf_counter() + BURST_S
        while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 50):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return burst


def _numpy_one_thread(fn: Any) -> Any:
    """OpenBLAS pinned to one thread: on a shared 2-core host its 2 threads can lose badly to
    preemption (a sleeping worker stalls the whole call), so the baseline is the faster of both."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return _numpy_burst(fn)
    burst = _numpy_burst(fn)

    def one() -> float:
        with threadpool_limits(limits=1, user_api="blas"):
            return burst()

    return one


def _tuned(func: Any, target: Any, m: int, trials: int, db: Any, measurer: Any) -> dict | None:
    from perfx_compiler.tune.cost_model import CostModel
    from perfx_compiler.tune.search import tune_task
    from perfx_compiler.tune.workloads import TuningTask

    template, wl = find_template(func, target)
    task = TuningTask("bench", func, template, wl, m)
    have = len(db.for_workload(wl.key, wl.target_key, task.bucket))
    if trials > have and measurer is not None:
        model = CostModel()
        model.add_records(db.records(), {wl.key: wl})
        model.fit()
        tune_task(task, target, db, measurer, model, trials=trials - have, batch=4)
    best = db.best(wl.key, wl.target_key, bucket=m)
    return None if best is None else best.config


def _dlight(func: Any, target: Any) -> tuple[Any, str]:
    import tvm
    from tvm.s_tir import dlight as dl

    with target.tvm():
        out = dl.ApplyDefaultSchedule(dl.cpu.GEMV(), dl.cpu.Reduction())(tvm.IRModule({"main": func}))["main"]
    return out, ("dlight" if out.attrs is not None and "tirx.is_scheduled" in out.attrs else "unscheduled")


def _blas_kernel() -> str:
    try:
        from threadpoolctl import threadpool_info

        info = [i for i in threadpool_info() if i.get("internal_api") == "openblas"]
        return f"{info[0].get('architecture')}x{info[0].get('num_threads')}" if info else "?"
    except ImportError:
        return "?"


def run_prefill(args: Any) -> None:
    from perfx_compiler.tune.measure import LocalMeasurer
    from perfx_compiler.tune.records import TuningDatabase
    from schedules._matmul import panel_width

    target = load_target(args.target)
    print(f"TVM threads: {configure_threads(target.cores)}, OpenBLAS: {_blas_kernel()}", flush=True)
    nb = panel_width(target)
    ms = [int(v) for v in args.ms.split(",") if v.strip()]
    names = args.kernels.split(",") if args.kernels else list(PREFILL_LINEARS)
    db = TuningDatabase.for_target(target.name, name="kernels_cpu")
    measurer = LocalMeasurer(target, repeat=3, min_repeat_ms=10) if args.trials else None
    rng = np.random.default_rng(0)
    rows = []
    for name in names:
        K, N = PREFILL_LINEARS[name]
        func = packed_linear_func(None, K, N, nb)
        nt_func = matmul_func(linear_module(None, K, N, None, True))
        template, wl = find_template(func, target)
        default = template.default_config(wl, target)
        rt_default = build_func(template.apply(func, wl, default, target), target)
        dl_func, dl_kind = _dlight(nt_func, target)
        rt_dlight = build_func(dl_func, target)
        w = rng.standard_normal((N, K)).astype(np.float32)
        for m in ms:
            flops = 2.0 * m * N * K
            x = rng.standard_normal((m, K)).astype(np.float32)
            cfg = _tuned(func, target, m, args.trials, db, measurer) if args.trials else None
            timers: dict[str, Any] = {"ours_default_us": _tvm_burst(rt_default, func, m)}
            if cfg is not None and cfg != default:
                timers["ours_tuned_us"] = _tvm_burst(build_func(template.apply(func, wl, cfg, target), target), func, m)
            timers["numpy_us"] = _numpy_burst(lambda x=x, w=w: x @ w.T)
            timers["numpy_1t_us"] = _numpy_one_thread(lambda x=x, w=w: x @ w.T)
            if dl_kind == "dlight" or flops <= DLIGHT_FLOP_LIMIT:
                timers["dlight_us"] = _tvm_burst(rt_dlight, nt_func, m, max_calls=5)
            samples: dict[str, list[float]] = {k: [] for k in timers}
            for r in range(args.rounds):  # alternated: every variant once per round
                for key, timer in timers.items():
                    if key == "dlight_us" and dl_kind == "unscheduled" and r >= 2:
                        continue  # seconds per call: two rounds are enough
                    samples[key].append(timer())
            med = {k: statistics.median(v) for k, v in samples.items()}
            tuned = med.get("ours_tuned_us", med["ours_default_us"])  # the default won the search
            blas = min(med["numpy_us"], med["numpy_1t_us"])
            row = {
                "kernel": name, "K": K, "N": N, "M": m, "nb": nb,
                "ours_tuned_us": tuned * 1e6,
                "ours_default_us": med["ours_default_us"] * 1e6,
                "numpy_us": med["numpy_us"] * 1e6,
                "numpy_1t_us": med["numpy_1t_us"] * 1e6,
                "dlight_us": med.get("dlight_us", math.nan) * 1e6,
                "dlight_kind": dl_kind if "dlight_us" in med else f"{dl_kind} (not timed: > {DLIGHT_FLOP_LIMIT:.0e} flop)",
                "ours_gflops": flops / tuned / 1e9,
                "numpy_gflops": flops / blas / 1e9,
                "tuned_vs_numpy": blas / tuned,
                "tuned_vs_dlight": med.get("dlight_us", math.nan) / tuned,
                "tuned_config": cfg or default,
                "rounds": args.rounds,
                "openblas": _blas_kernel(),
                "load_avg_1m": os.getloadavg()[0],
            }
            rows.append(row)
            print(f"{name:>9} M={m:<4} tuned {row['ours_tuned_us']:9.1f} us ({row['ours_gflops']:5.0f} GF/s)  "
                  f"default {row['ours_default_us']:9.1f}  numpy {row['numpy_us']:9.1f} / 1t {row['numpy_1t_us']:9.1f} "
                  f"({row['numpy_gflops']:5.0f} GF/s)  "
                  f"{dl_kind} {row['dlight_us']:11.1f}  -> {row['tuned_vs_numpy']:.2f}x numpy, "
                  f"{row['tuned_vs_dlight']:.1f}x dlight  (load {row['load_avg_1m']:.1f})", flush=True)
    if measurer is not None:
        measurer.close()
    out = write_csv(args.out or RESULTS / "kernels_cpu_prefill.csv", rows, floats=".2f")
    vs_np = [r["tuned_vs_numpy"] for r in rows]
    vs_dl = [r["tuned_vs_dlight"] for r in rows if not math.isnan(r["tuned_vs_dlight"])]
    print(f"median tuned vs numpy: {statistics.median(vs_np):.2f}x over {len(vs_np)} cases "
          f"(min {min(vs_np):.2f}x); median tuned vs dlight: "
          f"{statistics.median(vs_dl) if vs_dl else math.nan:.1f}x over {len(vs_dl)} timed cases")
    plot_prefill(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot_prefill(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    labels = [f"{r['kernel']}\nM={r['M']}" for r in rows]
    x = np.arange(len(rows))
    with figure(path, 2, 1, figsize=(max(10, len(rows) * 0.6), 8)) as (_fig, (ax1, ax2)):
        ax1.bar(x - 0.2, [r["ours_gflops"] for r in rows], 0.4, label="PerfX gemm_cpu (tuned, packed weights)")
        ax1.bar(x + 0.2, [r["numpy_gflops"] for r in rows], 0.4,
                label=f"numpy / OpenBLAS ({rows[0]['openblas']}; faster of 2 threads and 1)")
        ax1.set_ylabel("GFLOP/s (median of alternated rounds)")
        ax1.set_xticks(x)
        ax1.set_xticklabels(labels, fontsize=7)
        ax1.legend(fontsize=8)
        ax1.set_title("SmolLM2-135M prefill GEMMs on this CPU (2 threads each)")
        ax2.bar(x - 0.2, [r["tuned_vs_numpy"] for r in rows], 0.4, label="tuned / numpy")
        ax2.bar(x + 0.2, [0 if math.isnan(r["tuned_vs_dlight"]) else r["tuned_vs_dlight"] for r in rows], 0.4,
                label="tuned / TVM dlight default (0: not timed)")
        ax2.axhline(1.0, color="k", lw=0.8)
        ax2.set_yscale("log")
        ax2.set_ylabel("speed-up (x)")
        ax2.set_xticks(x)
        ax2.set_xticklabels(labels, fontsize=7)
        ax2.legend(fontsize=8)
