"""Multi-row int4 GEMV with f32 activations (schedules/gemv_int4_cpu.py): each weight unpacked once
for all M rows (``unpack_once=1``) vs once per row (``unpack_once=0``, the kernel before it).

Shapes N x K of SmolLM2-135M (576x576, 1536x576, 576x1536) and TinyLlama-1.1B (2048x2048,
5632x2048), GGUF Q4_1 codes, M = 1, 2, 4, 8 rows in two regimes:

  static  x [1, M, K], M known at compile time (decode of M rows)
  batch   x [B, 1, K], B symbolic (paged_decode, BatchEngine.decode), called with B = M

Every call reads the next of several weight copies (at least 2x the L3 size in all), so weights
come from DRAM as in a decode step over a whole model. Variants alternate within each round (order
reversed on odd rounds), the read-bandwidth probe runs once per round, and every row records the
1-minute load average (the machine is shared). Per (shape, M, regime, variant): the median over
rounds of each round's median call time; GB/s = packed weight bytes (codes + scales + mins) / time.
Every kernel is checked against numpy float64 once before timing.

Writes benchmarks/results/gemv_int4_batch.csv and .png.

    python benchmarks/bench_gemv_int4_batch.py [--rounds 5] [--shapes 576x576,5632x2048] [--ms 1 2 4 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import numpy as np
from _common import RESULTS, alternated, figure, write_csv

from perfx_compiler.bench.machine import read_bandwidth
from perfx_compiler.passes._gguf_blocks import Q4_1
from perfx_compiler.passes._quant import int4_packed
from perfx_compiler.targets import load_target
from perfx_compiler.tune.measure import build_func, configure_threads
from schedules.gemv_int4_cpu import TEMPLATE

SHAPES = [(576, 576), (1536, 576), (576, 1536), (2048, 2048), (5632, 2048)]
L3_BYTES = 32 << 20


def _weights(n: int, k: int, rng: np.random.Generator) -> tuple[Any, np.ndarray]:
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    d = (rng.random((n, k // 32)) * 0.01 + 1e-3).astype(np.float16)
    mn = (-rng.random((n, k // 32)) * 0.08).astype(np.float16)
    idx = np.arange(k) // 32
    return int4_packed(codes, d, mn, Q4_1), codes * d.astype(np.float64)[:, idx] + mn.astype(np.float64)[:, idx]


def _kernel(pk: Any, rows: tuple[int | None, int], once: int | None, target: Any) -> tuple[Any, str]:
    func = pk.compute("matmul", rows)
    wl = TEMPLATE.match(func, target)
    config = TEMPLATE.builtin_default(wl, target)
    if once is not None:
        config["unpack_once"] = once
    return build_func(TEMPLATE.apply(func, wl, config, target), target), str(config)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--shapes", default=None, help="comma-separated NxK (default: SmolLM2 + TinyLlama)")
    ap.add_argument("--budget", type=float, default=0.06, help="seconds of calls per variant per round")
    ap.add_argument("--out", default=str(RESULTS / "gemv_int4_batch"))
    args = ap.parse_args(argv)
    import tvm

    target = load_target("host")
    threads = configure_threads(target.cores or os.cpu_count() or 1)
    dev = tvm.cpu()
    rng = np.random.default_rng(0)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    cases: list[dict[str, Any]] = []
    for n, k in shapes:
        pk, wd = _weights(n, k, rng)
        ncopies = max(1, -(-2 * L3_BYTES // pk.nbytes))
        copies = [[tvm.runtime.tensor(a.copy(), dev) for _, a in pk.arrays] for _ in range(ncopies)]
        for m in args.ms:
            for regime in ("static", "batch"):
                rows = (1, m) if regime == "static" else (None, 1)
                shape = (1, m, k) if regime == "static" else (m, 1, k)
                x = rng.standard_normal(shape).astype(np.float32)
                xt = tvm.runtime.tensor(x, dev)
                want = x.astype(np.float64) @ wd.T
                for once in ((None,) if regime == "static" and m == 1 else (0, 1)):
                    rt, label = _kernel(pk, rows, once, target)
                    yt = tvm.runtime.tensor(np.zeros(shape[:2] + (n,), np.float32), dev)
                    rt["main"](xt, *copies[0], yt)
                    err = np.abs(yt.numpy() - want).max() / np.abs(want).max()
                    assert err < 1e-5, (n, k, m, regime, once, err)
                    variant = "per_row" if not once else "once"
                    cases.append({"N": n, "K": k, "M": m, "regime": regime, "variant": variant, "config": label,
                                  "fn": rt["main"], "x": xt, "y": yt, "copies": copies, "bytes": pk.nbytes,
                                  "times": [], "pos": 0})
        print(f"built {n}x{k} ({ncopies} weight copies)", flush=True)

    probes, loads = [], []
    for r in range(args.rounds):
        probes.append(read_bandwidth(threads, 256 << 20, reps=3))
        loads.append(os.getloadavg()[0])
        for case in alternated(cases, r):
            fn, x, y, copies = case["fn"], case["x"], case["y"], case["copies"]
            time.sleep(0.005)  # the previous case's pool threads stop spinning
            calls, t_end = [], time.perf_counter() + args.budget
            while time.perf_counter() < t_end or len(calls) < 5:
                case["pos"] = (case["pos"] + 1) % len(copies)
                t = time.perf_counter()
                fn(x, *copies[case["pos"]], y)
                calls.append(time.perf_counter() - t)
            case["times"].append(statistics.median(calls))
        print(f"round {r + 1}/{args.rounds}: probe {probes[-1]:.1f} GB/s, load {loads[-1]:.2f}", flush=True)

    probe = statistics.median(probes)
    out = []
    for c in cases:
        sec = statistics.median(c["times"])
        out.append({"N": c["N"], "K": c["K"], "M": c["M"], "regime": c["regime"], "variant": c["variant"],
                    "us_per_call": sec * 1e6, "weight_GBps": c["bytes"] / sec / 1e9,
                    "pct_of_probe": 100 * c["bytes"] / sec / 1e9 / probe, "probe_GBps": probe,
                    "load_avg": f"{min(loads):.2f}-{max(loads):.2f}", "rounds": args.rounds,
                    "threads": threads, "config": c["config"]})
    write_csv(args.out + ".csv", out, floats=".2f")
    for row in out:
        print(f"{row['N']}x{row['K']} M={row['M']} {row['regime']:6s} {row['variant']:7s} "
              f"{row['us_per_call']:9.1f} us {row['weight_GBps']:6.2f} GB/s ({row['pct_of_probe']:.0f}% of probe)")

    keys = sorted({(c["N"], c["K"]) for c in out})
    with figure(args.out + ".png", 1, 2, figsize=(13, 4.5)) as (_, axes):
        for ax, regime in zip(axes, ("static", "batch"), strict=True):
            width, xs = 0.8 / (2 * len(args.ms)), np.arange(len(keys))
            j = 0
            for m in args.ms:
                for variant in ("per_row", "once"):
                    vals = [next((r["us_per_call"] for r in out if (r["N"], r["K"]) == key and r["M"] == m
                                  and r["regime"] == regime and r["variant"] == variant), np.nan) for key in keys]
                    ax.bar(xs + j * width, vals, width, label=f"M={m} {variant}",
                           hatch="" if variant == "once" else "//", alpha=0.9)
                    j += 1
            ax.set_xticks(xs + 0.4 - width / 2, [f"{n}x{k}" for n, k in keys])
            ax.set_yscale("log")
            ax.set_ylabel("us per call (median)")
            ax.set_title(f"int4 Q4_1 GEMV, f32 x, {regime} rows (load {min(loads):.1f}-{max(loads):.1f})")
            ax.legend(fontsize=6, ncol=2)
    print(f"wrote {args.out}.csv/.png (probe {probe:.1f} GB/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
