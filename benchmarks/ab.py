"""A/B of two (or more) PerfX builds or runtime settings of one model, alternated round by round.

An arm is an artifact directory, optionally with environment variables set while it loads and runs
(``--env``, one per arm: a runtime switch on one artifact); with ``--compile MODEL`` the arms are
instead extra ``perfx-compile`` arguments (e.g. ``"--knob split=1"``, ``"--tuning-log DIR"``, ``""``)
and each arm is compiled first. The first arm is the baseline: ratios are other / first, per round
(paired), then the median. Arm order is reversed every round. Three levels, one per question:

``--level process`` (whole model, fresh processes): each arm in its own perfx-bench worker process
    (``bench/worker.py``; needed for anything read at load or process-wide: a thread pool, an
    environment switch), decode tok/s of ``--tokens`` greedy steps after a ``--prompt``-token prompt
    and prefill tok/s at ``--prefill`` lengths. Next to each process: the vCPU placement (ping-pong
    before and after; a process during which it changed is ``mixed`` and left out of the pairs) and
    the read-bandwidth probe (decode GB/s over it). The last greedy token of every arm is compared.
``--level step`` (decode step, one process): each arm's decode step at ``--position`` is traced once
    (``bench/replay.py``), then per round every arm's step is replayed ``--passes`` times back to back
    from C++ (no VM, no Python); for a kernel change worth a percent or two, where fresh processes are
    too slow to land enough pairs in one placement. ``--engine-steps N`` also times N
    ``Engine.decode`` + argmax per round: ``overhead_frac`` = 1 - replayed kernels / engine step, the
    runtime's own share of a step (VM, Python).
``--level compile`` (compile time; needs ``--compile``): per round each arm's ``perfx-compile`` in a fresh
    process under its ``--env``, wall seconds and the manifest's per-phase seconds. In an ``--env`` value
    ``{empty}`` becomes a new empty folder for each compile (e.g. a cache that starts cold); ``--warmup``
    runs every arm once untimed first (e.g. fills a cache folder the arm then reads).
``--level kernel`` (every kernel, in the step's sequence): the traced steps replayed with each call
    timed on its own; per kernel symbol the summed time per step, its 10th-percentile calls, weight
    GB/s and the ratio to the first arm. ``--shared-args`` runs every arm's kernels on the first arm's
    tensors (the kernel code alone; two artifacts' weight copies sit at other addresses).

    python benchmarks/ab.py --level process ART_A ART_B --labels a,b --name NAME [--rounds 8]
    python benchmarks/ab.py --level process ART ART --labels tvm,team --env PERFX_THREAD_POOL=tvm --env "" --name pool
    python benchmarks/ab.py --level step ART_A ART_B --labels a,b --name NAME [--rounds 200] [--passes 15]
    python benchmarks/ab.py --level kernel ART_A ART_B --labels a,b --name NAME [--rounds 8] [--steps 30]
    python benchmarks/ab.py --level process --compile smollm2-135m "" "--tuning-log /tmp/tlog" --labels defaults,records
    python benchmarks/ab.py --level compile --compile GGUF "" "" "" --labels off,cold,warm --warmup --rounds 3 \
        --env PERFX_KERNEL_CACHE=none --env "PERFX_KERNEL_CACHE={empty}" --env PERFX_KERNEL_CACHE=/tmp/kc-warm \
        --name kernel_cache

Writes benchmarks/results/ab_<level>_<name>.csv (every round, then the summary rows) and, for the
process and step levels, a PNG of the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from _common import REPO, RESULTS, alternated, figure, write_csv


@contextmanager
def arm_env(spec: str) -> Iterator[None]:
    """``VAR=VAL[,VAR=VAL]`` set in os.environ inside the block, restored after (``""``: nothing)."""
    pairs = [kv.split("=", 1) for kv in spec.split(",") if kv.strip()]
    saved = {k: os.environ.get(k) for k, _ in pairs}
    os.environ.update({k: v for k, v in pairs})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def compile_arms(model: str, target: str, arm_args: list[str], work: Path) -> list[str]:
    """Each arm's artifact: ``perfx-compile MODEL --target TARGET ARGS -o work/armN``."""
    arts = []
    for i, extra in enumerate(arm_args):
        out = work / f"arm{i}"
        cmd = [sys.executable, "-m", "perfx_compiler.cli.compile", model, "--target", target, "-o", str(out),
               "--quiet", *shlex.split(extra)]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=REPO)
        arts.append(str(out))
    return arts


def placement_around(fn: Any) -> tuple[Any, str, float]:
    """``fn()``'s result, the vCPU placement (``mixed`` if it changed during ``fn``) and the ping-pong ns before."""
    from perfx_compiler.bench import machine

    ns0 = machine.pingpong_ns(rounds=2000, repeats=1)
    res = fn()
    ns1 = machine.pingpong_ns(rounds=2000, repeats=1)
    place = machine.placement(ns0)
    return res, (place if machine.placement(ns1) == place else "mixed"), ns0


def paired(rows: list[dict[str, Any]], labels: list[str], key: str, higher_is_better: bool) -> list[dict[str, Any]]:
    """Per placement with >= 1 complete round: every arm's median ``key`` and its speedup over the first arm,
    paired per round (median and quartiles)."""
    out = []
    for place in sorted({r["placement"] for r in rows} - {"mixed"}):
        by_round: dict[Any, dict[str, float]] = {}
        for r in rows:
            if r["placement"] == place and r.get(key) not in (None, ""):
                by_round.setdefault(r["round"], {})[r["arm"]] = float(r[key])
        pairs = [v for v in by_round.values() if len(v) == len(labels)]
        if not pairs:
            continue
        for label in labels:
            ratios = [(v[label] / v[labels[0]]) if higher_is_better else (v[labels[0]] / v[label]) for v in pairs]
            q1, _, q3 = statistics.quantiles(ratios * (2 if len(ratios) == 1 else 1), n=4, method="inclusive")
            out.append({"round": "median", "placement": place, "arm": label,
                        key: round(statistics.median(v[label] for v in pairs), 4),
                        "speedup": round(statistics.median(ratios), 4), "speedup_q1": round(q1, 4),
                        "speedup_q3": round(q3, 4), "rounds": len(pairs)})
            print(out[-1], flush=True)
    return out


def plot_ratios(path: Path, rows: list[dict[str, Any]], labels: list[str], key: str, title: str) -> None:
    with figure(path, 1, 1, figsize=(7, 4)) as (_, ax):
        base = {r["round"]: r[key] for r in rows if r["arm"] == labels[0]}
        for label in labels[1:]:
            pts = [(r["round"], base[r["round"]] / r[key] if key.endswith(("_ms", "_s")) else r[key] / base[r["round"]])
                   for r in rows if r["arm"] == label and r["round"] in base and r[key]]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ".", label=label, alpha=0.7)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set(title=title, xlabel="round", ylabel=f"speedup over {labels[0]}")
        ax.legend(fontsize=7)


# -- process level ---------------------------------------------------------------------------------

def run_process_arm(art: str, env: str, args: argparse.Namespace, log: Path) -> dict[str, Any]:
    """Decode and prefill speed of ``art`` in a fresh perfx-bench worker process started under ``env``."""
    from perfx_compiler.cli.bench import Worker

    with arm_env(env):  # read by the worker's Engine at load
        worker = Worker("perfx", Path(art), args.threads, log)
    try:
        rng = np.random.default_rng(0)
        vocab = int(json.loads((Path(art) / "perfx-config.json").read_text())["model"]["vocab_size"])
        hi = min(1000, vocab)
        prompt = [int(t) for t in rng.integers(1, hi, args.prompt)]
        worker.ask("decode", prompt=prompt, n=4)  # warm-up
        runs = [worker.ask("decode", prompt=prompt, n=args.tokens) for _ in range(args.runs)]
        res: dict[str, Any] = {"decode_tok_s": statistics.median(args.tokens / r["decode_s"] for r in runs),
                               "last_token": runs[-1]["token"]}
        for n in args.prefill:
            ids = [int(t) for t in rng.integers(1, hi, n)]
            worker.ask("prefill", ids=ids)  # warm-up (first-call allocation at this length)
            res[f"prefill{n}_tok_s"] = statistics.median(n / worker.ask("prefill", ids=ids)["prefill_s"]
                                                        for _ in range(args.runs))
        info = worker.ask("info")
        res["weight_bytes"] = int(info["weight_bytes"])
        res["decode_path"] = info["info"].get("decode_path", "")
        res["thread_pool"] = info["info"].get("thread_pool", "")
    finally:
        worker.close()
    return res


def level_process(args: argparse.Namespace, arms: list[tuple[str, str, str]]) -> tuple[list, list, str]:
    from perfx_compiler.bench import machine

    logs = Path(tempfile.mkdtemp(prefix="perfx-ab-"))
    labels = [a[0] for a in arms]
    rows: list[dict[str, Any]] = []
    first_token: int | None = None
    with machine.BandwidthProbe(args.threads) as probe:
        for r in range(args.rounds):
            for label, art, env in alternated(arms, r):
                gbs = probe.measure()
                res, place, ns = placement_around(lambda a=art, e=env, lab=label: run_process_arm(
                    a, e, args, logs / f"{lab}.log"))
                first_token = res["last_token"] if first_token is None else first_token
                achieved = res["weight_bytes"] * res["decode_tok_s"] / 1e9
                rows.append({"round": r, "arm": label, "placement": place, "pingpong_ns": round(ns, 1),
                             "probe_gbs": round(gbs, 2), "decode_tok_s": round(res["decode_tok_s"], 2),
                             **{k: round(v, 1) for k, v in res.items() if k.startswith("prefill")},
                             "decode_gbs": round(achieved, 2), "bw_fraction": round(achieved / gbs, 4),
                             "same_last_token": res["last_token"] == first_token, "decode_path": res["decode_path"],
                             "thread_pool": res["thread_pool"], "load_avg_1m": round(os.getloadavg()[0], 2)})
                print(rows[-1], flush=True)
    summary = paired(rows, labels, "decode_tok_s", True)
    for n in args.prefill:  # prefill is compute-bound: pooled over placements
        pooled = [{**r, "placement": "all"} for r in rows]
        summary += paired(pooled, labels, f"prefill{n}_tok_s", True)
    if not all(r["same_last_token"] for r in rows):
        print("note: the arms' last greedy tokens differ (a kernel that rounds differently can flip a later "
              "argmax of a random-weight model)")
    return rows, summary, "decode_tok_s"


# -- step and kernel levels ------------------------------------------------------------------------

def traced_steps(args: argparse.Namespace, arms: list[tuple[str, str, str]]) -> list[Any]:
    from tvm.script import tirx  # noqa: F401 - imported before the engine's modules (import order)

    from perfx_compiler.bench.replay import TracedStep

    prompt = [int(t) for t in np.random.default_rng(0).integers(100, 30000, args.position + 8)]
    steps = []
    for label, art, env in arms:
        with arm_env(env):
            steps.append(TracedStep(label, art, prompt, args.position))
        print(f"{label}: {art}, {len(steps[-1].calls)} kernel calls", flush=True)
    return steps


def level_step(args: argparse.Namespace, arms: list[tuple[str, str, str]]) -> tuple[list, list, str]:
    from perfx_compiler.bench.replay import build_replay_module

    replay = build_replay_module().replay
    steps = traced_steps(args, arms)
    labels = [s.label for s in steps]
    rows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        def one_round(r: int = r) -> dict[str, tuple[float, float]]:
            got = {}
            for s in alternated(steps, r):
                ms = statistics.median(list(replay(s.calls, args.passes))) * 1e3
                eng = s.time_engine_step(args.engine_steps) * 1e3 if args.engine_steps else 0.0
                got[s.label] = (ms, eng)
            return got
        got, place, ns = placement_around(one_round)
        load = round(os.getloadavg()[0], 2)
        for s in steps:
            ms, eng = got[s.label]
            rows.append({"round": r, "arm": s.label, "placement": place, "pingpong_ns": round(ns, 1),
                         "step_ms": round(ms, 4), "weight_gbs": round(sum(s.weight_bytes) / ms / 1e6, 2),
                         "engine_step_ms": round(eng, 4) if eng else "",
                         "overhead_frac": round(1 - ms / eng, 4) if eng else "", "load_avg_1m": load})
        if r % 20 == 0 or r == args.rounds - 1:
            print(rows[-len(steps):], flush=True)
    summary = paired(rows, labels, "step_ms", False)
    if args.engine_steps:
        summary += paired(rows, labels, "engine_step_ms", False)
        for label in labels:
            mine = [float(r["overhead_frac"]) for r in rows if r["arm"] == label]
            summary.append({"round": "median", "placement": "all", "arm": label,
                            "overhead_frac": round(statistics.median(mine), 4), "rounds": len(mine)})
            print(summary[-1])
    return rows, summary, "step_ms"


def level_kernel(args: argparse.Namespace, arms: list[tuple[str, str, str]]) -> tuple[list, list, str]:
    from perfx_compiler.bench.replay import build_replay_module

    replay_each = build_replay_module().replay_each
    steps = traced_steps(args, arms)
    first = steps[0]
    syms = list(dict.fromkeys(first.names))
    for s in steps[1:]:
        if list(dict.fromkeys(s.names)) != syms:
            sys.exit(f"ab.py: {s.label} calls other kernels than {first.label} (compare them at --level step)")
        if args.shared_args:
            s.calls = [[mine[0], *base[1:]] for mine, base in zip(s.calls, first.calls, strict=True)]
    count = {sym: first.names.count(sym) for sym in syms}
    wbytes = {sym: sum(b for n, b in zip(first.names, first.weight_bytes, strict=True) if n == sym) for sym in syms}
    wbytes["__step__"] = sum(first.weight_bytes)
    for s in steps:
        s.per_kernel(replay_each, 3)  # warm-up
    med: dict[str, list[dict[str, float]]] = {s.label: [] for s in steps}
    low: dict[str, list[dict[str, float]]] = {s.label: [] for s in steps}
    rows: list[dict[str, Any]] = []

    def row(rnd: Any, label: str, sym: str, t: float, t10: float, **extra: Any) -> dict[str, Any]:
        w = wbytes.get(sym, 0)
        return {"round": rnd, "arm": label, "kernel": sym, "calls": count.get(sym, len(first.calls)),
                "us": round(t * 1e6, 2), "us_call_p10": round(t10 * 1e6, 2), "weight_mb": round(w / 1e6, 2),
                "gbs": round(w / t / 1e9, 2) if w else "", "gbs_call_p10": round(w / t10 / 1e9, 2) if w else "",
                **extra}

    for r in range(args.rounds):
        for s in alternated(steps, r):
            got, got10 = s.per_kernel(replay_each, args.steps)
            med[s.label].append(got)
            low[s.label].append(got10)
            load = round(os.getloadavg()[0], 2)
            rows += [row(r, s.label, sym, got[sym], got10[sym], load_avg_1m=load) for sym in [*syms, "__step__"]]
            print(f"round {r} {s.label}: step {got['__step__'] * 1e3:.3f} ms (kernels only), load {load}", flush=True)
    summary = []
    for s in steps:
        for sym in [*syms, "__step__"]:
            ratio = statistics.median(b[sym] / g[sym] for b, g in zip(med[first.label], med[s.label], strict=True))
            r10 = statistics.median(b[sym] / g[sym] for b, g in zip(low[first.label], low[s.label], strict=True))
            summary.append(row("median", s.label, sym, statistics.median(g[sym] for g in med[s.label]),
                               statistics.median(g[sym] for g in low[s.label]),
                               speedup=round(ratio, 4), speedup_p10=round(r10, 4), shared_args=args.shared_args))
    top = sorted({x["kernel"] for x in summary}, key=lambda k: -max(x["us"] for x in summary if x["kernel"] == k))
    for k in top[:12]:
        print(f"{k[:44]:<44} " + "  ".join(f"{x['arm']} {x['us']:8.1f} us x{x['speedup']:.3f}"
                                           for x in summary if x["kernel"] == k))
    return rows, summary, ""


# -- compile level ---------------------------------------------------------------------------------

def compile_once(args: argparse.Namespace, extra: str, env: str, work: Path) -> dict[str, float]:
    """One ``perfx-compile`` of ``args.compile`` with ``extra`` arguments in a fresh process under ``env``
    (``{empty}``: a new empty folder); its wall seconds and the manifest's phase seconds."""
    empty = Path(tempfile.mkdtemp(prefix="empty-", dir=work))
    out = work / "art"
    with arm_env(env.replace("{empty}", str(empty))):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "perfx_compiler.cli.compile", args.compile, "--target", args.target,
                        "-o", str(out), "--quiet", *shlex.split(extra)], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - start
    phases = json.loads((out / "perfx-config.json").read_text())["compile_seconds"]
    shutil.rmtree(out)
    shutil.rmtree(empty, ignore_errors=True)
    return {"wall_s": round(wall, 2), **{f"{k}_s": round(float(v), 2) for k, v in phases.items()}}


def level_compile(args: argparse.Namespace, arms: list[tuple[str, str, str]]) -> tuple[list, list, str]:
    work = Path(args.work or tempfile.mkdtemp(prefix="perfx-ab-compile-"))
    if args.warmup:
        for _, extra, env in arms:
            compile_once(args, extra, env, work)
    rows = []
    for r in range(args.rounds):
        for label, extra, env in alternated(arms, r):
            row = {"round": r, "arm": label, "placement": "-", **compile_once(args, extra, env, work),
                   "load_avg_1m": round(os.getloadavg()[0], 2)}
            rows.append(row)
            print(f"round {r} {label:8s} {row['wall_s']:.1f} s", flush=True)
    return rows, paired(rows, args.labels, "wall_s", higher_is_better=False), "wall_s"


LEVELS = {"process": level_process, "step": level_step, "kernel": level_kernel, "compile": level_compile}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("arms", nargs="+", help="artifact directories (with --compile: perfx-compile arguments per arm)")
    ap.add_argument("--level", choices=sorted(LEVELS), default="process")
    ap.add_argument("--labels", default="", help="comma-separated, one per arm (default: the artifact names)")
    ap.add_argument("--name", default="ab", help="results/ab_<level>_<name>.csv")
    ap.add_argument("--out", default=None, help="CSV path instead of the default")
    ap.add_argument("--env", action="append", default=None,
                    help="VAR=VAL[,VAR=VAL] for one arm, in arm order (repeat per arm; '' for none)")
    ap.add_argument("--compile", default=None, metavar="MODEL", help="compile MODEL once per arm first")
    ap.add_argument("--target", default="host", help="with --compile")
    ap.add_argument("--work", default=None, help="with --compile: where the artifacts go (default: a temp dir)")
    ap.add_argument("--rounds", type=int, default=None, help="default: process 8, step 200, kernel 8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", action="store_true", help="compile: one untimed compile per arm first")
    g = ap.add_argument_group("process level")
    g.add_argument("--tokens", type=int, default=128, help="greedy decode steps per run")
    g.add_argument("--prompt", type=int, default=32, help="prompt tokens before the decode")
    g.add_argument("--prefill", default="128,512", help="prefill lengths ('' for none)")
    g.add_argument("--runs", type=int, default=3, help="runs per process (median)")
    g = ap.add_argument_group("step and kernel levels")
    g.add_argument("--position", type=int, default=96, help="the traced step's sequence position")
    g.add_argument("--passes", type=int, default=15, help="step: replay passes per round (median)")
    g.add_argument("--engine-steps", type=int, default=0, help="step: also time N Engine.decode steps per round")
    g.add_argument("--steps", type=int, default=30, help="kernel: replayed steps per round")
    g.add_argument("--shared-args", action="store_true", help="kernel: every arm on the first arm's tensors")
    args = ap.parse_args(argv)
    args.prefill = [int(x) for x in args.prefill.split(",") if x.strip()]
    args.rounds = args.rounds or {"process": 8, "step": 200, "kernel": 8, "compile": 3}[args.level]
    if args.level == "compile" and not args.compile:
        ap.error("--level compile: give the model with --compile MODEL")
    if len(args.arms) < 2:
        ap.error("give at least two arms (the first is the baseline)")
    args.env = args.env or [""] * len(args.arms)
    labels = args.labels.split(",") if args.labels else [Path(a).name or f"arm{i}" for i, a in enumerate(args.arms)]
    if len(labels) != len(args.arms) or len(set(labels)) != len(labels) or len(args.env) != len(args.arms):
        ap.error("--labels and --env: one per arm (labels distinct)")
    args.labels = labels
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)  # before the runtime creates its pool
    if args.level != "process":
        os.environ.setdefault("PERFX_SPIN_US", "100")  # an idle arm's thread team must not hold a vCPU
    arts = args.arms
    if args.compile and args.level != "compile":
        work = Path(args.work or tempfile.mkdtemp(prefix="perfx-ab-build-"))
        arts = compile_arms(args.compile, args.target, args.arms, work)
    arms = list(zip(args.labels, arts, args.env, strict=True))
    t0 = time.perf_counter()
    rows, summary, key = LEVELS[args.level](args, arms)
    out = Path(args.out) if args.out else RESULTS / f"ab_{args.level}_{args.name}.csv"
    for r in rows + summary:
        r.setdefault("threads", args.threads)
    write_csv(out, rows + summary, list(dict.fromkeys(k for r in rows + summary for k in r)))
    if key:
        plot_ratios(out.with_suffix(".png"), rows, args.labels, key, f"{args.name}: {key} per round")
    print(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
