"""Do transparent huge pages speed up the VNNI decode GEMV's weight stream? A/B of the same kernel
(template default) over rotating DRAM-cold weight copies held in ordinary 4 KiB pages (TVM's
allocator, as the runtime Engine holds weights) or in a 2 MiB-aligned anonymous mapping advised
``MADV_HUGEPAGE`` before the first touch (wrapped zero-copy through DLPack).

Why: the tuner's clflush timing (one copy, TLB warm) read every split/hinib config alike while
rotating copies (TLB cold, as in a decode step over hundreds of MB) separated them
(gemv_qvnni_long_rows_clflush.csv vs gemv_qvnni_long_rows.csv); the bandwidth probe advises huge
pages for its own buffer.

    python benchmarks/gemv_hugepage_ab.py [--rounds 10] [--shapes 2048x5632,11264x2048,4096x11008]

Writes benchmarks/results/gemv_hugepage_ab.csv.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import RESULTS, write_csv  # noqa: E402  (puts the repo root on sys.path)
from bench_gemv_int4 import L3_BYTES, _kernel, _weights  # noqa: E402

from perfx_compiler.runtime.engine import HugePageArena  # noqa: E402
from perfx_compiler.targets import load_target  # noqa: E402

HUGE = HugePageArena.HUGE


def _anon_huge_pages_kb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return -1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--shapes", default="2048x5632,11264x2048,4096x11008")
    ap.add_argument("--format", default="Q4_0", choices=["Q4_0", "Q4_1"])
    ap.add_argument("--out", default=str(RESULTS / "gemv_hugepage_ab.csv"))
    args = ap.parse_args(argv)
    import tvm

    from perfx_compiler.tune.measure import configure_threads

    target = load_target("host")
    threads = configure_threads(target.cores or os.cpu_count() or 1)
    dev = tvm.cpu()
    rng = np.random.default_rng(0)
    cases: list[dict[str, Any]] = []
    arenas = []  # keep the mappings alive
    huge_kb_before = _anon_huge_pages_kb()
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        packed, _ = _weights(args.format, n, k, rng)
        vp = packed.vnni()
        rt, label = _kernel(vp, target)
        ncopy = max(3, -(-4 * L3_BYTES // vp.nbytes))
        x = tvm.runtime.tensor(rng.standard_normal((1, 1, k)).astype(np.float32), dev)
        y = tvm.runtime.tensor(np.zeros((1, 1, n), np.float32), dev)
        small = [[tvm.runtime.tensor(a.copy(), dev) for _, a in vp.arrays] for _ in range(ncopy)]
        # the runtime's weight arena, each array on its own 2 MiB boundary
        arena = HugePageArena(ncopy * sum(HugePageArena.span(a.nbytes, HUGE) for _, a in vp.arrays), align=HUGE)
        arenas.append(arena)
        huge = [[tvm.runtime.from_dlpack(arena.take(a)) for _, a in vp.arrays] for _ in range(ncopy)]
        rt["main"](x, *small[0], y)
        want = y.numpy().copy()
        rt["main"](x, *huge[0], y)
        assert np.array_equal(y.numpy(), want), shape  # the same weights, the same kernel: bit-equal
        for pages, copies in (("4k", small), ("thp", huge)):
            cases.append({"shape": shape, "pages": pages, "fn": rt["main"], "copies": copies, "x": x, "y": y,
                          "bytes": vp.nbytes, "calls": [], "rounds": [], "config": label})
    huge_kb = _anon_huge_pages_kb() - huge_kb_before
    print(f"AnonHugePages grew by {huge_kb / 1024:.0f} MiB", flush=True)
    for r in range(args.rounds):
        for c in (cases if r % 2 == 0 else cases[::-1]):
            fn, x, y, clock = c["fn"], c["x"], c["y"], time.perf_counter
            t0 = clock()
            for _ in range(3):
                for cp in c["copies"]:
                    t = clock()
                    fn(x, *cp, y)
                    c["calls"].append(clock() - t)
            c["rounds"].append((clock() - t0) / (3 * len(c["copies"])))
        print(f"round {r + 1}/{args.rounds}, load {os.getloadavg()[0]:.1f}", flush=True)
    load = os.getloadavg()[0]
    rows = []
    for c in cases:
        base = next(b for b in cases if b["shape"] == c["shape"] and b["pages"] == "4k")
        p10 = float(np.percentile(c["calls"], 10))
        rows.append({"shape": c["shape"], "format": args.format, "pages": c["pages"],
                     "call_p10_gbs": round(c["bytes"] / p10 / 1e9, 2),
                     "call_median_gbs": round(c["bytes"] / float(np.median(c["calls"])) / 1e9, 2),
                     "p10_vs_4k": round(float(np.percentile(base["calls"], 10)) / p10, 4),
                     "paired_vs_4k": round(statistics.median(a / b for a, b in zip(base["rounds"], c["rounds"],
                                                                                    strict=True)), 4),
                     "anon_huge_mib": round(huge_kb / 1024), "rounds": args.rounds, "config": c["config"],
                     "load_avg_1m": round(load, 2), "threads": threads})
        print(rows[-1])
    out = write_csv(args.out, rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
