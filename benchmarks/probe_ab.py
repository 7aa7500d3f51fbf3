"""Is the read-bandwidth probe a fair ceiling? Its read with software prefetch (what perfx-bench uses)
against the same read with hardware prefetch only, alternated, at the engines' thread count and at 1.

Per round and variant: one 1 GiB pass (best of 3) and ``--windows`` reads of 8 MiB windows walking
through the 1 GiB buffer (cold: 32x the L3). On a busy machine the windows' upper percentiles are
the load-robust figure. Writes benchmarks/results/probe_ab.csv (every round, then the summary) and a PNG.

    python benchmarks/probe_ab.py [--rounds 10] [--windows 60] [--threads 2] [--size-gib 1] [--out CSV]

``--size-gib``: the buffer (1 GiB is 32x a 32 MiB L3; on a machine with a bigger last-level cache a
larger buffer shows whether the 1 GiB pass is still a DRAM read); column ``pass_1gib_gbs`` is then the
pass over that size (``size_gib``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
from _common import RESULTS, alternated, figure, medians, write_csv

from perfx_compiler.bench.machine import BandwidthProbe

VARIANTS = (("prefetch", True), ("hardware_only", False))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--windows", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--size-gib", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "probe_ab.csv"))
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    windows: dict[tuple[str, int], list[float]] = {}
    with BandwidthProbe(args.threads, args.size_gib << 30) as probe:
        for r in range(args.rounds):
            for th in (args.threads, 1) if args.threads != 1 else (1,):
                for name, pf in alternated(VARIANTS, r):
                    full = probe.measure(3, threads=th, prefetch=pf)
                    win = probe.chunk_gbs(8 << 20, args.windows, threads=th, prefetch=pf)
                    windows.setdefault((name, th), []).extend(win)
                    rows.append({"round": r, "variant": name, "threads": th, "size_gib": args.size_gib,
                                 "pass_1gib_gbs": round(full, 2),
                                 "window_p90_gbs": round(float(np.percentile(win, 90)), 2),
                                 "window_median_gbs": round(float(np.median(win)), 2),
                                 "load_avg_1m": round(os.getloadavg()[0], 2)})
            print(" ".join(f"{x['variant']}/{x['threads']}t {x['pass_1gib_gbs']:.1f} {x['window_p90_gbs']:.1f}"
                           for x in rows if x["round"] == r), flush=True)
    summary = []
    for (name, th), win in windows.items():
        mine = [x for x in rows if x["variant"] == name and x["threads"] == th]
        base = [x for x in rows if x["variant"] == "hardware_only" and x["threads"] == th]
        summary.append({"round": "median", "variant": name, "threads": th, "size_gib": args.size_gib,
                        **medians(mine, pass_1gib_gbs=2),
                        "window_p90_gbs": round(float(np.percentile(win, 90)), 2),
                        "window_median_gbs": round(float(np.median(win)), 2),
                        "pass_vs_hardware_only": round(statistics.median(
                            m["pass_1gib_gbs"] / b["pass_1gib_gbs"] for m, b in zip(mine, base, strict=True)), 4),
                        **medians(mine, load_avg_1m=2)})
    out = Path(args.out)
    write_csv(out, rows + summary, columns=list(summary[0]))
    for s in summary:
        print(f"{s['variant']:<14} {s['threads']}t  1 GiB pass {s['pass_1gib_gbs']:6.1f} GB/s (x{s['pass_vs_hardware_only']:.3f} "
              f"paired)  8 MiB windows p90 {s['window_p90_gbs']:6.1f}  median {s['window_median_gbs']:6.1f}  "
              f"load {s['load_avg_1m']}")
    _plot(rows, out.with_suffix(".png"))
    return 0


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    with figure(path, figsize=(8, 4)) as (_fig, ax):
        for (name, _), th in [(v, t) for v in VARIANTS for t in sorted({x["threads"] for x in rows})]:
            mine = [x for x in rows if x["variant"] == name and x["threads"] == th]
            ax.plot([x["round"] for x in mine], [x["window_p90_gbs"] for x in mine], "o-", label=f"{name}, {th} thread(s)")
        ax.set_xlabel("round (variants alternated)")
        ax.set_ylabel("8 MiB windows, 90th percentile GB/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        load = statistics.median(x["load_avg_1m"] for x in rows)
        ax.set_title(f"read-bandwidth probe: software prefetch vs hardware only (load {load:.1f})", fontsize=10)


if __name__ == "__main__":
    sys.exit(main())
