"""Decode speed with the kernels' parallel loops on PerfX's thread team vs on TVM's thread pool.

The same artifact, in fresh processes alternated A B B A ...: ``PERFX_THREAD_POOL=tvm`` keeps TVM's
pool, the default routes every fork/join through the spinning team linked into model.so
(perfx_compiler/runtime/thread_team.py). Each process is a perfx-bench worker
(perfx_compiler/bench/worker.py): it loads the engine, warms up, and times ``--tokens`` greedy decode
steps after a ``--prompt``-token prompt ``--runs`` times (median); the last greedy token of both pools
must agree. One process per arm, because an idle pool's spinning workers would slow the other arm in the same process.
Next to each process the parent measures the vCPU placement (ping-pong, before and after: a process
during which it changed is "mixed" and left out of the pairs) and the read bandwidth before it (the
ceiling); rows carry achieved GB/s = weight bytes per token x tok/s and its fraction of the probe.

    python benchmarks/thread_pool_ab.py ART [ART ...] [--labels a,b] [--rounds 8] [--out-stem thread_pool_ab]

Writes benchmarks/results/<stem>.csv (every process, then medians per label, pool and placement over
the rounds where both arms ran in that placement, and the paired ratio team / tvm) and <stem>.png.

``--switch replay`` runs the same A/B for the decode step replayed without the VM
(perfx_compiler/runtime/decode_replay.py): ``PERFX_DECODE_REPLAY=0`` (arm ``vm``) against the default
(arm ``replay``), both on the thread team; the CSV's ``pool`` column then holds the arm, the ratio is
replay / vm (default stem ``decode_replay_ab``). ``--switch loop``: the worker decodes its tokens with one
``decode`` call per token from Python (``PERFX_BENCH_DECODE_LOOP=python``, arm ``python``) against one
``Engine.decode_greedy`` call (arm ``engine``: the C++ greedy loop; stem ``decode_loop_ab``).

``--pair A B --labels a,b --model NAME --out-stem STEM``: the two arms are two artifacts of model NAME (a
compile-time change, e.g. a template default), each on its default runtime path; the ratio is b / a. Their last
greedy tokens may differ (a kernel that rounds differently can flip a later argmax of a random-weight
model); whether they agree is recorded (``same_last_token``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from _common import RESULTS, alternated, figure, medians, write_csv  # noqa: E402

# switch -> (environment variable, {arm: its value}, engine info key, {arm: what that key must start with});
# the first arm is the baseline, the ratio is second / first
SWITCHES = {
    "pool": ("PERFX_THREAD_POOL", {"tvm": "tvm", "team": ""}, "thread_pool", {"tvm": "tvm", "team": "perfx-team"}),
    "replay": ("PERFX_DECODE_REPLAY", {"vm": "0", "replay": "1"}, "decode_path", {"vm": "vm", "replay": "replay"}),
    "loop": ("PERFX_BENCH_DECODE_LOOP", {"python": "python", "engine": "engine"}, "decode_loop",
             {"python": "python", "engine": "engine"}),
}


def measure_arm(art: str, arm: str, args: argparse.Namespace, log: Path) -> dict[str, Any]:
    """Decode tok/s of ``art`` in ``arm`` of ``args.switch``, in a fresh perfx-bench worker process
    (bench/worker.py)."""
    import numpy as np

    from perfx_compiler.cli.bench import Worker

    var, values, key, _ = SWITCHES[args.switch]
    if args.pair:  # the arm is the artifact, on its default path: nothing to switch
        worker = Worker("perfx", Path(art), args.threads, log)
        key = "decode_path"
    else:
        saved = os.environ.get(var)
        os.environ[var] = values[arm]  # read by the worker's Engine at load
        try:
            worker = Worker("perfx", Path(art), args.threads, log)
        finally:
            if saved is None:
                os.environ.pop(var)
            else:
                os.environ[var] = saved
    try:
        prompt = [int(t) for t in np.random.default_rng(0).integers(100, 1000, args.prompt)]
        worker.ask("decode", prompt=prompt, n=8)  # warm-up
        runs = [worker.ask("decode", prompt=prompt, n=args.tokens) for _ in range(args.runs)]
        info = worker.ask("info")  # after decoding: decode_path is decided at the first decode step
    finally:
        worker.close()
    return {"pool": info["info"][key], "weight_bytes": int(info["weight_bytes"]),
            "tok_s": statistics.median(args.tokens / r["decode_s"] for r in runs), "last_token": runs[-1]["token"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="*")
    ap.add_argument("--labels", default="")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--switch", choices=sorted(SWITCHES), default="pool")
    ap.add_argument("--out-stem", default=None)
    ap.add_argument("--pair", action="store_true", help="the two artifacts are the two arms (see the module doc)")
    ap.add_argument("--model", default="", help="--pair: the model's name (the rows' label)")
    args = ap.parse_args(argv)
    if args.pair and (len(args.artifacts) != 2 or len(args.labels.split(",")) != 2 or not args.out_stem
                      or not args.model):
        ap.error("--pair takes two artifacts, --labels a,b, --model and --out-stem")
    args.out_stem = args.out_stem or {"pool": "thread_pool_ab", "replay": "decode_replay_ab",
                                      "loop": "decode_loop_ab"}[args.switch]
    arms = tuple(SWITCHES[args.switch][1])
    expect = SWITCHES[args.switch][3]
    if not args.artifacts:
        ap.error("give at least one artifact directory")
    if args.pair:
        arms = tuple(args.labels.split(","))
        expect = {arm: "" for arm in arms}

    import tempfile

    from perfx_compiler.bench import machine

    labels = args.labels.split(",") if args.labels else [Path(a).name for a in args.artifacts]
    art_of = {}  # --pair: each arm's artifact (one label, the model); else both arms run on each artifact
    if args.pair:
        art_of, labels, args.artifacts = dict(zip(arms, args.artifacts, strict=True)), [args.model], [args.artifacts[0]]
    logs = Path(tempfile.mkdtemp(prefix="perfx-thread-pool-ab-"))
    probe = machine.BandwidthProbe(args.threads)
    rows: list[dict[str, Any]] = []
    last_tokens: dict[str, int] = {}
    for r in range(args.rounds):
        for art, label in zip(args.artifacts, labels, strict=True):
            for pool in alternated(arms, r):
                # the placement can change at any time: measured next to each arm, before and after
                ns_before, gbs = machine.pingpong_ns(), probe.measure()
                res = measure_arm(art_of.get(pool, art), pool, args, logs / f"{label}-{pool}.log")
                ns_after = machine.pingpong_ns()
                if not res["pool"].startswith(expect[pool]):
                    sys.exit(f"{label}: asked for {pool}, the engine reported {res['pool']!r}")
                same = last_tokens.setdefault(label, res["last_token"]) == res["last_token"]
                # both arms of a switch run the same kernels on the same split of work: greedy decoding must agree
                if not same and not args.pair:
                    sys.exit(f"{label}: arm {pool} decoded a different last token")
                place = machine.placement(ns_before)
                if machine.placement(ns_after) != place:
                    place = "mixed"
                achieved = res["weight_bytes"] * res["tok_s"] / 1e9
                rows.append({"round": r, "label": label, "pool": pool, "placement": place,
                             "pingpong_ns": round(ns_before, 1), "pingpong_after_ns": round(ns_after, 1),
                             "probe_gbs": round(gbs, 2), "decode_tok_s": round(res["tok_s"], 2),
                             "achieved_gbs": round(achieved, 2), "bw_fraction": round(achieved / gbs, 4),
                             "same_last_token": same, "load_avg_1m": round(os.getloadavg()[0], 2)})
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
            for pool in arms:
                sub = [v[pool] for v in pairs]
                summary.append({"round": "median", "label": label, "pool": pool, "placement": place,
                                **medians(sub, pingpong_ns=1, probe_gbs=2, decode_tok_s=2, achieved_gbs=2,
                                          bw_fraction=4, load_avg_1m=2), "rounds": len(sub)})
            ratio = statistics.median(v[arms[1]]["decode_tok_s"] / v[arms[0]]["decode_tok_s"] for v in pairs)
            summary.append({"round": "paired_ratio", "label": label, "pool": f"{arms[1]}/{arms[0]}", "placement": place,
                            "decode_tok_s": round(ratio, 4), "rounds": len(pairs)})
            print(summary[-3], summary[-2], summary[-1], sep="\n")
    columns = ["round", "label", "pool", "placement", "pingpong_ns", "pingpong_after_ns", "probe_gbs", "decode_tok_s", "achieved_gbs",
               "bw_fraction", "same_last_token", "load_avg_1m", "rounds"]
    out = write_csv(RESULTS / f"{args.out_stem}.csv", rows + summary, columns)
    with figure(RESULTS / f"{args.out_stem}.png", 1, len(labels), figsize=(5.5 * len(labels), 4),
                squeeze=False) as (_, axes):
        for ax, label in zip(axes[0], labels, strict=True):
            for pool, marker in zip(arms, ("o", "s"), strict=True):
                for place, color in (("split", "tab:blue"), ("shared", "tab:orange")):
                    pts = [x for x in rows if x["label"] == label and x["pool"] == pool and x["placement"] == place]
                    ax.scatter([x["round"] for x in pts], [x["bw_fraction"] * 100 for x in pts], marker=marker,
                               color=color, facecolors="none" if pool == arms[0] else color,
                               label=f"{pool}, {place}")
            ax.axhline(90, color="gray", lw=0.8, ls="--")
            ax.set(title=f"{label}: decode, % of measured read bandwidth", xlabel="round", ylabel="% of probe")
            ax.legend(fontsize=7)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
