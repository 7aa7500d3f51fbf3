"""Does a TVM GEMV timed right after a numpy (OpenBLAS) matvec run slower than one timed after a pause?

bench_gemv_int4.py timed its variants back to back; in every forward round its first TVM variant
("vnni") followed the previous shape's numpy_f32 case, whose OpenBLAS threads spin on after the call.
This script times the VNNI Q4_1 GEMV (template default) for ``--window`` seconds of calls over rotating
DRAM-cold weight copies, (a) right after ``--blas-calls`` numpy float32 matvecs, (b) after the same
matvecs and a ``--pause`` sleep, alternated for ``--rounds`` rounds.

    python benchmarks/blas_spin_interference.py [--shape 4096x11008] [--rounds 10]

Writes benchmarks/results/blas_spin_interference.csv.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from _common import RESULTS, write_csv  # noqa: E402  (puts the repo root on sys.path)
from bench_gemv_int4 import L3_BYTES, _kernel, _weights  # noqa: E402

from perfx_compiler.targets import load_target  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="4096x11008")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--window", type=float, default=0.25)
    ap.add_argument("--pause", type=float, default=0.25)
    ap.add_argument("--blas-calls", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS / "blas_spin_interference.csv"))
    args = ap.parse_args(argv)
    import tvm

    from perfx_compiler.tune.measure import configure_threads

    target = load_target("host")
    threads = configure_threads(target.cores or os.cpu_count() or 1)
    dev = tvm.cpu()
    rng = np.random.default_rng(0)
    n, k = (int(v) for v in args.shape.split("x"))
    packed, _ = _weights("Q4_1", n, k, rng)
    vp = packed.vnni()
    rt, label = _kernel(vp, target)
    fn = rt["main"]
    copies = [[tvm.runtime.tensor(a.copy(), dev) for _, a in vp.arrays] for _ in range(max(3, -(-4 * L3_BYTES // vp.nbytes)))]
    x = tvm.runtime.tensor(rng.standard_normal((1, 1, k)).astype(np.float32), dev)
    y = tvm.runtime.tensor(np.zeros((1, 1, n), np.float32), dev)
    wf = rng.standard_normal((n, k)).astype(np.float32)  # numpy_f32's operand (4x the packed bytes)
    xf = rng.standard_normal(k).astype(np.float32)
    pos = 0

    def window() -> float:
        nonlocal pos
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < args.window:
            pos = (pos + 1) % len(copies)
            fn(x, *copies[pos], y)
            calls += 1
        return (time.perf_counter() - t0) / calls

    got: dict[str, list[float]] = {"after_blas": [], "after_pause": []}
    for r in range(args.rounds):
        for case in (("after_blas", "after_pause") if r % 2 == 0 else ("after_pause", "after_blas")):
            time.sleep(args.pause)
            for _ in range(args.blas_calls):
                _ = wf @ xf
            if case == "after_pause":
                time.sleep(args.pause)
            got[case].append(window())
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{c} {vp.nbytes / v[-1] / 1e9:.1f} GB/s" for c, v in got.items()),
              flush=True)
    load = os.getloadavg()[0]
    rows = []
    for case, v in got.items():
        sec = statistics.median(v)
        rows.append({"case": case, "N": n, "K": k, "us": round(sec * 1e6, 1), "gbs": round(vp.nbytes / sec / 1e9, 2),
                     "paired_vs_after_pause": round(statistics.median(
                         b / a for a, b in zip(v, got["after_pause"], strict=True)), 4),
                     "rounds": args.rounds, "window_s": args.window, "pause_s": args.pause, "config": label,
                     "load_avg_1m": round(load, 2), "threads": threads})
        print(rows[-1])
    out = write_csv(args.out, rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
