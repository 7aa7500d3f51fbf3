"""Decode speed with the kernels' parallel loops on PerfX's thread team vs on TVM's thread pool.

The same artifact, in fresh processes alternated A B B A ...: ``PERFX_THREAD_POOL=tvm`` keeps TVM's
pool, the default routes every fork/join through the spinning team linked into model.so
(perfx_compiler/runtime/thread_team.py). Each process loads the engine, warms up, and times
``--tokens`` greedy decode steps after a ``--prompt``-token prompt ``--runs`` times (median). One
process per arm, because an idle pool's spinning workers would slow the other arm in the same process.
Next to each process the parent measures the vCPU placement (ping-pong, before and after: a process
during which it changed is "mixed" and left out of the pairs) and the read bandwidth before it (the
ceiling); rows carry achieved GB/s = weight bytes per token x tok/s and its fraction of the probe.

    python benchmarks/thread_pool_ab.py ART [ART ...] [--labels a,b] [--rounds 8] [--out-stem thread_pool_ab]

Writes benchmarks/results/<stem>.csv (every process, then medians per label, pool and placement over
the rounds where both arms ran in that placement, and the paired ratio team / tvm) and <stem>.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import RESULTS, alternated, figure, medians, write_csv  # noqa: E402

POOLS = ("tvm", "team")


def worker(art: str, tokens: int, prompt: int, runs: int) -> dict[str, Any]:
    import numpy as np

    from perfx_compiler.runtime import thread_team
    from perfx_compiler.runtime.engine import Engine

    engine = Engine(art, verify=False)
    ids = [int(t) for t in np.random.default_rng(0).integers(100, 1000, prompt)]

    def run(n: int) -> tuple[float, list[int]]:
        engine.reset()
        tok = int(np.argmax(engine.prefill(ids)))
        out, t0 = [], time.perf_counter()
        for _ in range(n):
            tok = int(np.argmax(engine.decode(tok)))
            out.append(tok)
        return n / (time.perf_counter() - t0), out

    run(8)
    before = thread_team.launches(Path(art) / "model.so")
    rates, tokens_out = [], []
    for _ in range(runs):
        rate, tokens_out = run(tokens)
        rates.append(rate)
    after = thread_team.launches(Path(art) / "model.so")
    return {"pool": engine.thread_pool, "tok_s": statistics.median(rates),
            "team_launches_per_step": round((after - before) / (runs * (tokens + 1)), 1) if before >= 0 else -1,
            "tokens": tokens_out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="*")
    ap.add_argument("--labels", default="")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out-stem", default="thread_pool_ab")
    ap.add_argument("--worker", nargs=2, metavar=("ART", "POOL"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.tokens, args.prompt, args.runs)))
        return 0
    if not args.artifacts:
        ap.error("give at least one artifact directory")

    from perfx_compiler.bench import machine
    from perfx_compiler.bench.engines import perfx_weight_bytes

    labels = args.labels.split(",") if args.labels else [Path(a).name for a in args.artifacts]
    weight_bytes = {a: perfx_weight_bytes(json.loads((Path(a) / "perfx-config.json").read_text()), a)
                    for a in args.artifacts}
    probe = machine.BandwidthProbe(args.threads)
    rows: list[dict[str, Any]] = []
    first_tokens: dict[str, list[int]] = {}
    for r in range(args.rounds):
        for art, label in zip(args.artifacts, labels, strict=True):
            for pool in alternated(POOLS, r):
                # the placement can change at any time: measured next to each arm, before and after
                ns_before, gbs = machine.pingpong_ns(), probe.measure()
                env = dict(os.environ, TVM_NUM_THREADS=str(args.threads))
                env["PERFX_THREAD_POOL"] = "tvm" if pool == "tvm" else ""
                cmd = [sys.executable, __file__, "--worker", art, pool, "--tokens", str(args.tokens),
                       "--prompt", str(args.prompt), "--runs", str(args.runs)]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                ns_after = machine.pingpong_ns()
                if proc.returncode != 0:
                    sys.exit(f"worker failed ({pool}, {art}): {proc.stderr.strip()[-2000:]}")
                res = json.loads(proc.stdout.strip().splitlines()[-1])
                want = "perfx-team" if pool == "team" else "tvm"
                if not res["pool"].startswith(want):
                    sys.exit(f"{label}: asked for the {pool} pool, the engine used {res['pool']!r}")
                # both pools run the same kernels on the same split of work: the tokens must agree
                if first_tokens.setdefault(label, res["tokens"]) != res["tokens"]:
                    sys.exit(f"{label}: the {pool} pool decoded different tokens")
                place = machine.placement(ns_before)
                if machine.placement(ns_after) != place:
                    place = "mixed"
                achieved = weight_bytes[art] * res["tok_s"] / 1e9
                rows.append({"round": r, "label": label, "pool": pool, "placement": place,
                             "pingpong_ns": round(ns_before, 1), "pingpong_after_ns": round(ns_after, 1),
                             "probe_gbs": round(gbs, 2), "decode_tok_s": round(res["tok_s"], 2),
                             "achieved_gbs": round(achieved, 2), "bw_fraction": round(achieved / gbs, 4),
                             "team_launches_per_step": res["team_launches_per_step"],
                             "load_avg_1m": round(os.getloadavg()[0], 2)})
                print(rows[-1], flush=True)
    probe.close()
    summary = []
    for label in labels:
        for place in sorted({x["placement"] for x in rows} - {"mixed"}):
            per_round: dict[int, dict[str, Any]] = {}
            for x in rows:  # a pair: both arms of one round in this placement, before and after each
                if x["label"] == label and x["placement"] == place:
                    per_round.setdefault(x["round"], {})[x["pool"]] = x
            pairs = [v for v in per_round.values() if len(v) == 2]
            if not pairs:
                continue
            for pool in POOLS:
                sub = [v[pool] for v in pairs]
                summary.append({"round": "median", "label": label, "pool": pool, "placement": place,
                                **medians(sub, pingpong_ns=1, probe_gbs=2, decode_tok_s=2, achieved_gbs=2,
                                          bw_fraction=4, load_avg_1m=2), "rounds": len(sub)})
            ratio = statistics.median(v["team"]["decode_tok_s"] / v["tvm"]["decode_tok_s"] for v in pairs)
            summary.append({"round": "paired_ratio", "label": label, "pool": "team/tvm", "placement": place,
                            "decode_tok_s": round(ratio, 4), "rounds": len(pairs)})
            print(summary[-3], summary[-2], summary[-1], sep="\n")
    columns = ["round", "label", "pool", "placement", "pingpong_ns", "pingpong_after_ns", "probe_gbs", "decode_tok_s", "achieved_gbs",
               "bw_fraction", "team_launches_per_step", "load_avg_1m", "rounds"]
    out = write_csv(RESULTS / f"{args.out_stem}.csv", rows + summary, columns)
    with figure(RESULTS / f"{args.out_stem}.png", 1, len(labels), figsize=(5.5 * len(labels), 4),
                squeeze=False) as (_, axes):
        for ax, label in zip(axes[0], labels, strict=True):
            for pool, marker in zip(POOLS, ("o", "s"), strict=True):
                for place, color in (("split", "tab:blue"), ("shared", "tab:orange")):
                    pts = [x for x in rows if x["label"] == label and x["pool"] == pool and x["placement"] == place]
                    ax.scatter([x["round"] for x in pts], [x["bw_fraction"] * 100 for x in pts], marker=marker,
                               color=color, facecolors="none" if pool == "tvm" else color,
                               label=f"{pool} pool, {place}")
            ax.axhline(90, color="gray", lw=0.8, ls="--")
            ax.set(title=f"{label}: decode, % of measured read bandwidth", xlabel="round", ylabel="% of probe")
            ax.legend(fontsize=7)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
