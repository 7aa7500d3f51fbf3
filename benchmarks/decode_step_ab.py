"""Whole decode steps of several artifacts of one model, replayed in tight alternation in one process.

An A/B of a kernel change (a template default, a schedule) whose gain is a percent or two: fresh
processes per arm (``thread_pool_ab.py``) take seconds per sample, and this machine's two vCPUs
change placement (one core's two threads / two cores, ceilings 50 vs 85 GB/s) every few seconds, so
few pairs land in one placement. Here each artifact's decode step is traced once
(``decode_overhead.Subject``: the kernel calls in order, on the engine's own buffers, at
``--position``); then per round, in an order reversed every round, each artifact's step is replayed
``--passes`` times back to back from C++ (no VM, no Python: what the engine's decode replay runs) and
the median pass kept. The vCPU placement is measured before and after every round; a round whose
placement changed is ``mixed`` and left out. Per placement, every artifact's median step time and its
speedup over the first artifact (per round, paired, then the median and the quartiles) are reported,
with the weight bytes a step reads over the step time as GB/s.

Each artifact has its own thread team: the idle one spins ``PERFX_SPIN_US`` before it sleeps (set to
100 here, unless given), so it does not hold a vCPU through the other's turn.

    python benchmarks/decode_step_ab.py ART_A ART_B [ART_C ...] --labels a,b,c --name tinyllama-q4_0_x
        [--rounds 200] [--passes 15] [--position 96] [--threads 2]

Writes benchmarks/results/decode_step_ab_<name>.csv (every round, then per placement and artifact)
and a PNG of the per-round speedups.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
from _common import RESULTS, alternated, figure, write_csv


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="+")
    ap.add_argument("--labels", default="")
    ap.add_argument("--name", required=True)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--passes", type=int, default=15)
    ap.add_argument("--position", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if len(args.artifacts) < 2:
        ap.error("give at least two artifacts (the first is the baseline)")
    labels = args.labels.split(",") if args.labels else [Path(a).name for a in args.artifacts]
    if len(labels) != len(args.artifacts) or len(set(labels)) != len(labels):
        ap.error("--labels: one distinct label per artifact")
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("PERFX_SPIN_US", "100")
    from tvm.script import tirx  # noqa: F401 - imported before the engine's modules (import order)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from decode_overhead import Subject, build_replay_module

    from perfx_compiler.bench import machine
    from perfx_compiler.bench.engines import perfx_weight_bytes

    replay = build_replay_module()
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(100, 30000, args.position + 8)]
    subjects = [Subject(label, art, prompt, args.position) for label, art in zip(labels, args.artifacts, strict=True)]
    wbytes = perfx_weight_bytes(subjects[0].engine.manifest, args.artifacts[0])
    for s in subjects:
        print(f"{s.label}: {s.art}, {len(s.calls)} kernel calls", flush=True)
    rows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        ns0 = machine.pingpong_ns(rounds=2000, repeats=1)
        ms = {s.label: statistics.median(list(replay.replay(s.calls, args.passes, False))) * 1e3
              for s in alternated(subjects, r)}
        ns1 = machine.pingpong_ns(rounds=2000, repeats=1)
        place = machine.placement(ns0)
        if machine.placement(ns1) != place:
            place = "mixed"
        rows.append({"round": r, "placement": place, "pingpong_ns": round(ns0, 1), "pingpong_after_ns": round(ns1, 1),
                     **{f"{k}_ms": round(v, 4) for k, v in ms.items()}, "load_avg_1m": round(os.getloadavg()[0], 2)})
        if r % 20 == 0:
            print(rows[-1], flush=True)
    base = labels[0]
    summary = []
    for place in ("split", "shared"):
        mine = [x for x in rows if x["placement"] == place]
        if len(mine) < 4:
            continue
        for label in labels:
            step = statistics.median(x[f"{label}_ms"] for x in mine)
            ratios = [x[f"{base}_ms"] / x[f"{label}_ms"] for x in mine]
            q1, _, q3 = statistics.quantiles(ratios, n=4)
            summary.append({"round": "median", "placement": place, "label": label, "step_ms": round(step, 4),
                            "weight_gbs": round(wbytes / step / 1e6, 2), "speedup": round(statistics.median(ratios), 4),
                            "speedup_q1": round(q1, 4), "speedup_q3": round(q3, 4), "rounds": len(mine)})
            print(summary[-1], flush=True)
    columns = ["round", "placement", "label", "pingpong_ns", "pingpong_after_ns", *[f"{k}_ms" for k in labels],
               "step_ms", "weight_gbs", "speedup", "speedup_q1", "speedup_q3", "load_avg_1m", "rounds"]
    out = write_csv(RESULTS / f"decode_step_ab_{args.name}.csv", rows + summary, columns)
    with figure(RESULTS / f"decode_step_ab_{args.name}.png", 1, 2, figsize=(11, 4)) as (_, axes):
        for ax, place in zip(axes, ("split", "shared"), strict=True):
            mine = [x for x in rows if x["placement"] == place]
            for label in labels[1:]:
                ax.plot([x["round"] for x in mine], [x[f"{base}_ms"] / x[f"{label}_ms"] for x in mine], ".",
                        label=label, alpha=0.6)
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set(title=f"{args.name}, {place}: step speedup over {base}", xlabel="round", ylabel="speedup")
            ax.legend(fontsize=7)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
