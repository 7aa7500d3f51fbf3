"""Which split / hinib suits the VNNI int4 GEMV's one-unit ("long") rows: the int4 GEMV bench's shapes
and TinyLlama's decode shapes, Q4_0 (sym) and Q4_1 (asym), all DRAM-cold.

Per (format, shape) one set of weight copies (>= 4x the L3 in all; every config of the shape reads
the same copies: separate copies alone moved A/A pairs by 5-8%), and one kernel per config (the
template default plus the ``--configs`` overrides). Per round (order reversed every round), each case
calls its kernel once per copy, each call timed. Reported per case: GB/s of the 10th-percentile call
(on a shared machine the fastest calls are the undisturbed ones), of the median call, and the median
over rounds of the paired per-round ratio default time / this config's time (> 1: faster).

    python benchmarks/gemv_qvnni_long_rows.py [--rounds 10] [--formats Q4_0,Q4_1]
        [--shapes 4096x11008,...] [--configs 'split=1,hinib=0;split=1;hinib=0'] [--clflush]

``--clflush``: each case timed as the tuner times decode GEMVs instead (time_evaluator on one copy,
every argument but x clflushed before each call). Writes benchmarks/results/gemv_qvnni_long_rows.csv
(``_clflush.csv``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from _common import RESULTS, write_csv  # noqa: E402
from bench_gemv_int4 import L3_BYTES, _kernel, _weights  # noqa: E402

from perfx_compiler.targets import load_target  # noqa: E402

SHAPES = "11008x4096,4096x11008,4096x4096,2560x2048,2048x2048,11264x2048,2048x5632,32000x2048"


def _parse(text: str) -> list[dict[str, int]]:
    out: list[dict[str, int]] = [{}]
    for part in filter(None, (p.strip() for p in text.split(";"))):
        out.append({k.strip(): int(v) for k, v in (kv.split("=") for kv in part.split(","))})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--formats", default="Q4_0,Q4_1")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--configs", default="split=1,hinib=0;split=1;hinib=0")
    ap.add_argument("--clflush", action="store_true",
                    help="time as the tuner does (time_evaluator, one copy, every argument but x clflushed "
                         "before each call: tune/measure.py cold=True) instead of rotating copies")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import tvm

    from perfx_compiler.tune.measure import configure_threads

    target = load_target("host")
    threads = configure_threads(target.cores or os.cpu_count() or 1)
    dev = tvm.cpu()
    rng = np.random.default_rng(0)
    cases: list[dict[str, Any]] = []
    for fmt in args.formats.split(","):
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            packed, codes = _weights(fmt, n, k, rng)
            vp = packed.vnni()
            ncopy = max(3, -(-4 * L3_BYTES // vp.nbytes))
            copies = [[tvm.runtime.tensor(a.copy(), dev) for _, a in vp.arrays] for _ in range(ncopy)]
            xn = rng.standard_normal(k).astype(np.float32)
            x = tvm.runtime.tensor(xn.reshape(1, 1, k), dev)
            y = tvm.runtime.tensor(np.zeros((1, 1, n), np.float32), dev)
            # float64 reference of the dequantized weights, to check every config once
            arrays = dict(packed.arrays)
            d, third = arrays["_q4_scale"].astype(np.float64), arrays.get("_q4_min", arrays.get("_q4_zero"))
            idx = np.arange(k) // 32
            w = codes * d[:, idx] + third.astype(np.float64)[:, idx] if fmt == "Q4_1" \
                else (codes - third.astype(np.float64)[:, idx]) * d[:, idx]
            ref = w @ xn.astype(np.float64)
            for over in _parse(args.configs):
                rt, label = _kernel(vp, target, over)
                rt["main"](x, *copies[0], y)
                err = np.abs(y.numpy().ravel() - ref).max() / np.abs(ref).max()
                assert err < 2e-2, (fmt, shape, over, err)  # int8 activations: ~1e-2 relative at most
                cases.append({"format": fmt, "N": n, "K": k, "config": ",".join(f"{a}={b}" for a, b in over.items())
                              or "default", "knobs": label, "fn": rt["main"], "rt": rt, "copies": copies, "x": x, "y": y,
                              "bytes": vp.nbytes, "calls": [], "rounds": []})
            print(f"built {fmt} {shape}", flush=True)
    for c in cases:  # warm-up (page in every copy, start the pool)
        for cp in c["copies"]:
            c["fn"](c["x"], *cp, c["y"])
    from perfx_compiler.tune.measure import time_calls

    for r in range(args.rounds):
        for c in (cases if r % 2 == 0 else cases[::-1]):
            if args.clflush:
                t = list(time_calls(c["rt"], [c["x"], *c["copies"][0], c["y"]], 4 * len(c["copies"]), True))
                c["calls"] += t
                c["rounds"].append(float(np.mean(t)))
                continue
            fn, x, y, clock = c["fn"], c["x"], c["y"], time.perf_counter
            t0 = clock()
            for cp in c["copies"]:
                t = clock()
                fn(x, *cp, y)
                c["calls"].append(clock() - t)
            c["rounds"].append((clock() - t0) / len(c["copies"]))
        print(f"round {r + 1}/{args.rounds}, load {os.getloadavg()[0]:.1f}", flush=True)
    load = os.getloadavg()[0]
    rows = []
    for c in cases:
        base = next(b for b in cases if (b["format"], b["N"], b["K"], b["config"]) == (c["format"], c["N"], c["K"],
                                                                                       "default"))
        p10, med = np.percentile(c["calls"], 10), np.median(c["calls"])
        bp10 = np.percentile(base["calls"], 10)
        rows.append({"format": c["format"], "N": c["N"], "K": c["K"], "config": c["config"],
                     "call_p10_us": round(p10 * 1e6, 1), "call_p10_gbs": round(c["bytes"] / p10 / 1e9, 2),
                     "call_median_gbs": round(c["bytes"] / med / 1e9, 2),
                     "p10_vs_default": round(bp10 / p10, 4),
                     "paired_vs_default": round(statistics.median(
                         a / b for a, b in zip(base["rounds"], c["rounds"], strict=True)), 4),
                     "bytes": c["bytes"], "copies": len(c["copies"]), "rounds": args.rounds, "knobs": c["knobs"],
                     "timing": "clflush" if args.clflush else "rotating copies",
                     "load_avg_1m": round(load, 2), "threads": threads})
        x = rows[-1]
        print(f"{x['format']} {x['N']:>5}x{x['K']:<5} {x['config']:<16} p10 {x['call_p10_gbs']:6.1f} GB/s "
              f"(x{x['p10_vs_default']:.3f}), median {x['call_median_gbs']:6.1f}, paired x{x['paired_vs_default']:.3f}")
    out = Path(args.out or RESULTS / ("gemv_qvnni_long_rows" + ("_clflush" if args.clflush else "") + ".csv"))
    write_csv(out, rows)
    print(f"wrote {out} (load {load:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
