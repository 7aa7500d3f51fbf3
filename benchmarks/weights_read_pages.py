"""Do the engine's weight pages cap a decode step's bandwidth? The probe's own read loop, the step's
GEMVs and the whole step, on the weights of one artifact loaded twice: in one mapping advised for
transparent huge pages (the runtime's default, ``HugePageArena``) and one allocation per weight
(``PERFX_WEIGHTS_THP=0``, 4 KiB pages).

Per round, for each engine (order alternated): ``read`` = the probe's C read loop (``machine.px_read``)
over every GEMV's code and scale arrays in the step's order; ``gemv`` = the step's GEMVs replayed back
to back; ``step`` = all its kernels replayed (``decode_overhead.Subject``); each as weight GB/s over the
1 GiB probe of the round (which reads one huge-page buffer). Row ``probe_buffer``: the read loop over
pieces of the same sizes laid back to back in the probe's buffer (the ceiling for those pieces).

    python benchmarks/weights_read_pages.py ARTIFACT --name tinyllama-q4_0 [--threads 1] [--rounds 4]

Writes benchmarks/results/weights_read_pages_<name>.csv.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import RESULTS, medians, write_csv


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--name", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--passes", type=int, default=8)
    args = ap.parse_args(argv)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    from tvm.script import tirx  # noqa: F401 - imported before the engine's modules (import order)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from decode_overhead import Subject, build_replay_module
    from decode_step_split import GEMV, gemv_weights

    from perfx_compiler.bench import machine

    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(100, 30000, 40)]
    subjects: dict[str, Any] = {}
    for label, flag in (("thp", "1"), ("4k", "0")):
        os.environ["PERFX_WEIGHTS_THP"] = flag
        subjects[label] = Subject(label, args.artifact, prompt, 32)
    os.environ.pop("PERFX_WEIGHTS_THP")
    lib = machine.load_probe_library()
    sink = ctypes.c_double()
    replay = build_replay_module()
    arrays, gemvs = {}, {}
    for label, s in subjects.items():
        calls = [c for c, n in zip(s.calls, s.names, strict=True) if GEMV.search(n)]
        gemvs[label] = calls
        arrays[label] = [(a.ctypes.data, a.nbytes) for c in calls for a in gemv_weights(c, s.engine.manifest)]
    total = sum(b for _, b in arrays["thp"])
    rows = []
    with machine.BandwidthProbe(args.threads) as probe:
        # the same sizes back to back in the probe's own (huge-page) buffer: the read loop's ceiling
        # for these pieces, restarts included
        starts = np.cumsum([0] + [b for _, b in arrays["thp"]])[:-1]
        arrays["probe_buffer"] = [(probe._ptr + int(o), b) for o, (_, b) in zip(starts, arrays["thp"], strict=True)]
        for r in range(args.rounds):
            order = list(subjects) if r % 2 == 0 else list(subjects)[::-1]
            got = {}
            for label in [*order, "probe_buffer"]:
                ts = []
                for _ in range(args.passes):
                    t0 = time.perf_counter()
                    for p, b in arrays[label]:
                        lib.px_read(p, b // 4 // 128 * 128, args.threads, 1, 1, ctypes.byref(sink))
                    ts.append(time.perf_counter() - t0)
                if label in subjects:
                    g = statistics.median(list(replay.replay(gemvs[label], args.passes, False)))
                    f = statistics.median(list(replay.replay(subjects[label].calls, args.passes, False)))
                else:
                    g = f = float("nan")
                got[label] = (statistics.median(ts), g, f)
            bw = probe.measure()
            ns = machine.pingpong_ns()
            for label, (t, g, f) in got.items():
                rows.append({"round": r, "pages": label, "placement": machine.placement(ns), "probe_gbs": round(bw, 2),
                             "read_frac": round(total / t / 1e9 / bw, 4), "gemv_frac": round(total / g / 1e9 / bw, 4),
                             "step_frac": round(total / f / 1e9 / bw, 4), "threads": args.threads,
                             "load_avg_1m": round(os.getloadavg()[0], 2)})
                print(f"round {r} {label:3s} {rows[-1]['placement']:6s} probe {bw:5.1f} GB/s | read {rows[-1]['read_frac']:.1%}"
                      f" gemv {rows[-1]['gemv_frac']:.1%} step {rows[-1]['step_frac']:.1%}", flush=True)
    for label in [*subjects, "probe_buffer"]:
        mine = [x for x in rows if x["pages"] == label]
        med = medians(mine, probe_gbs=4, read_frac=4, gemv_frac=4, step_frac=4)
        rows.append({"round": "median", "pages": label, "placement": "", **med, "threads": args.threads,
                     "load_avg_1m": round(os.getloadavg()[0], 2)})
        print(f"{label}: read {med['read_frac']:.1%}, GEMVs {med['gemv_frac']:.1%}, step {med['step_frac']:.1%} of the probe")
    out = write_csv(RESULTS / f"weights_read_pages_{args.name}.csv", rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
