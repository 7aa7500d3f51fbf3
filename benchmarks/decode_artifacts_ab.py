"""Decode A/B of PerfX artifacts of one model (e.g. a template knob at two values), alternated in one
process, each decode bracketed by the read-bandwidth probe; per-token times kept.

    PERFX_VNNI_GEMV_PREFETCH=0 perfx-compile model.gguf -o /tmp/a ...   (and the other build to /tmp/b)
    python benchmarks/decode_artifacts_ab.py /tmp/a /tmp/b --labels prefetch0,prefetch128 --name tinyllama-q4_0
        [--rounds 8] [--tokens 64] [--prompt-tokens 32] [--threads 2]
    python benchmarks/decode_artifacts_ab.py /tmp/a /tmp/a --labels thp,4k --name tinyllama-q4_0_weights_thp \
        --load-env "PERFX_WEIGHTS_THP=1,PERFX_WEIGHTS_THP=0"     (a runtime switch, one artifact)

Per round and artifact (order reversed every round): probe (1 GiB, best of 3), greedy decode of
``--tokens`` tokens after the prompt, each token timed, probe again. Reported per artifact:

* ``tok_s``: median over rounds of the round's tokens/s; ``frac_of_probe``: median over rounds of
  weight GB/s (bytes the decode step reads, ``perfx_weight_bytes``) over the round's probe mean;
* ``token_p10_ms`` / ``p10_gbs``: the 10th-percentile token time over all rounds, and its GB/s: on a
  busy machine the fastest tokens are the ones no other process disturbed;
* ``speedup``: per round, the first artifact's time over this one's (paired), median.

With two artifacts the engines are loaded A, B, B, A (``--no-mirror``: A, B): a copy's load order
moves its speed by 5-12%, so the ``mirrored`` row (B's two copies over A's two, per round, median)
is the figure to read.

Each turn also records the vCPU placement (``pingpong_ns`` before its decode: ``shared`` = one
core's two hyperthreads, ``split`` = two cores; the host moves them mid-run, and the ceiling with
them) and whether the probe stayed within 10% across the turn (``steady``). Rows ``shared`` /
``split``: per variant (both copies), the median over its steady turns in that placement.

The count of greedy tokens equal to the first engine's is recorded: equal for a change that keeps
every float result; a kernel that rounds differently can flip an int8 activation code and, on the
random-token prompt, later argmaxes (not an error by itself: compare logits with the reference).
Writes benchmarks/results/decode_ab_<name>.csv (every round, then the summary) and a PNG.
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
from _common import RESULTS, alternated, figure, medians, write_csv


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="+")
    ap.add_argument("--labels", default=None)
    ap.add_argument("--name", required=True)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--load-env", default=None,
                    help="per artifact, comma-separated: KEY=VAL;KEY=VAL set while that engine loads "
                         "(an A/B of a runtime switch on one artifact)")
    ap.add_argument("--no-mirror", action="store_true",
                    help="with two artifacts, load them once each (default: A, B, B, A; see below)")
    args = ap.parse_args(argv)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    from perfx_compiler.bench.engines import perfx_weight_bytes
    from perfx_compiler.bench.machine import BandwidthProbe, pingpong_ns, placement
    from perfx_compiler.bench.report import STEADY_TURN, probe_move
    from perfx_compiler.runtime.engine import Engine

    labels = args.labels.split(",") if args.labels else [Path(a).name for a in args.artifacts]
    # Two engines of one artifact decode 5-12% apart depending on load order (where their weight
    # copies land; decode_kernels_tinyllama-q4_0_long_rows_loadorder.csv), as large as the changes
    # an A/B looks for. Mirrored, each side gets an early and a late copy.
    mirrored = len(args.artifacts) == 2 and not args.no_mirror
    if mirrored:
        args.artifacts = [*args.artifacts, *args.artifacts[::-1]]
        labels = [*labels, *(f"{lb}#2" for lb in labels[::-1])]
    load_env = [dict(kv.split("=", 1) for kv in spec.split(";") if kv) for spec in args.load_env.split(",")] \
        if args.load_env else []
    if load_env and mirrored:
        load_env = [*load_env, *load_env[::-1]]

    def load(i: int, art: str) -> Any:
        # an engine's load-time switches (e.g. PERFX_WEIGHTS_THP), set only while it loads
        env = load_env[i] if i < len(load_env) else {}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return Engine(art, verify=False)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    engines = [load(i, a) for i, a in enumerate(args.artifacts)]
    wbytes = [perfx_weight_bytes(e.manifest, a) for e, a in zip(engines, args.artifacts, strict=True)]
    vocab = int(engines[0].manifest["model"]["vocab_size"])
    prompt = np.random.default_rng(0).integers(100, max(101, min(vocab, 20000)), args.prompt_tokens).tolist()

    def decode(e: Any) -> tuple[list[float], list[int]]:
        e.reset()
        tok = int(np.argmax(e.prefill(prompt)))
        times, toks = [], []
        for _ in range(args.tokens):
            t = time.perf_counter()
            tok = int(np.argmax(e.decode(tok)))
            times.append(time.perf_counter() - t)
            toks.append(tok)
        return times, toks

    for e in engines:  # warm-up: page in the weights
        decode(e)
    rows: list[dict[str, Any]] = []
    all_times: dict[str, list[float]] = {lb: [] for lb in labels}
    ref_tokens: list[int] | None = None
    same: dict[str, int] = {}
    with BandwidthProbe(args.threads, 1 << 30) as probe:
        for r in range(args.rounds):
            for i in alternated(range(len(engines)), r):
                before = probe.measure(3)
                pp = pingpong_ns()
                time.sleep(0.05)
                times, toks = decode(engines[i])
                time.sleep(0.3)  # the engine's pool threads stop spinning before the probe
                after = probe.measure(3)
                if i == 0 or ref_tokens is None:  # greedy tokens are deterministic: any round's will do
                    ref_tokens = toks if i == 0 else ref_tokens
                same[labels[i]] = sum(a == b for a, b in zip(toks, ref_tokens or toks, strict=False))
                total = sum(times)
                gbs = wbytes[i] * len(times) / total / 1e9
                all_times[labels[i]] += times
                rows.append({"round": r, "variant": labels[i], "artifact": args.artifacts[i], "tok_s": round(len(times) / total, 3),
                             "gbs": round(gbs, 2), "probe_before_gbs": round(before, 2), "probe_after_gbs": round(after, 2),
                             "frac_of_probe": round(gbs / ((before + after) / 2), 4),
                             "token_p10_ms": round(1e3 * float(np.percentile(times, 10)), 3),
                             "weight_mb": round(wbytes[i] / 1e6, 1), "load_avg_1m": round(os.getloadavg()[0], 2),
                             "threads": args.threads, "pingpong_ns": round(pp), "placement": placement(pp),
                             "steady": probe_move(before, after) < STEADY_TURN})
                print(f"round {r} {labels[i]:<14} {rows[-1]['tok_s']:7.2f} tok/s  {gbs:5.1f} GB/s  probe {before:5.1f}/"
                      f"{after:5.1f}  {100 * rows[-1]['frac_of_probe']:4.0f}%  p10 {rows[-1]['token_p10_ms']:.2f} ms  "
                      f"{rows[-1]['placement']}  load {rows[-1]['load_avg_1m']}", flush=True)
    summary = []
    for i, lb in enumerate(labels):
        mine = [r for r in rows if r["variant"] == lb]
        base = [r for r in rows if r["variant"] == labels[0]]
        p10 = float(np.percentile(all_times[lb], 10))
        summary.append({"round": "median", "variant": lb, "artifact": args.artifacts[i],
                        **medians(mine, tok_s=3, gbs=2, probe_before_gbs=2, probe_after_gbs=2, frac_of_probe=4),
                        "token_p10_ms": round(1e3 * p10, 3), "p10_gbs": round(wbytes[i] / p10 / 1e9, 2),
                        "speedup": round(statistics.median(m["tok_s"] / b["tok_s"] for m, b in zip(mine, base, strict=True)), 4),
                        "same_greedy_tokens": f"{same.get(lb, 0)}/{args.tokens}",
                        "weight_mb": round(wbytes[i] / 1e6, 1),
                        **medians(mine, load_avg_1m=2), "threads": args.threads})
    if mirrored:  # per round, B's two copies over A's two: the load-order effect cancels
        a, b = labels[0], labels[1]
        tok = {(r["round"], r["variant"]): r["tok_s"] for r in rows}
        ratio = statistics.median((tok[(i, b)] + tok[(i, f"{b}#2")]) / (tok[(i, a)] + tok[(i, f"{a}#2")])
                                  for i in range(args.rounds))
        summary.append({**{k: "" for k in summary[0]}, "round": "mirrored", "variant": f"{b} vs {a}",
                        "speedup": round(ratio, 4), "threads": args.threads})
    for place in ("shared", "split"):  # per variant (both copies), steady turns in one placement
        for lb in dict.fromkeys(x.removesuffix("#2") for x in labels):
            mine = [r for r in rows if r["variant"].removesuffix("#2") == lb and r["placement"] == place and r["steady"]]
            if mine:
                summary.append({**{k: "" for k in summary[0]}, "round": place, "variant": lb, "turns": len(mine),
                                **medians(mine, tok_s=3, frac_of_probe=4), "threads": args.threads})
    out = Path(args.out) if args.out else RESULTS / f"decode_ab_{args.name}.csv"
    write_csv(out, rows + summary, columns=[*summary[0], "turns", "pingpong_ns", "placement", "steady"])
    for s in summary:
        if s["round"] in ("shared", "split"):
            print(f"{s['variant']:<14} {s['tok_s']:7.2f} tok/s  {100 * s['frac_of_probe']:4.0f}% of probe  "
                  f"({s['turns']} steady {s['round']} turns)")
            continue
        if s["round"] == "mirrored":
            print(f"{s['variant']}: x{s['speedup']:.3f} (both copies of each, paired per round)")
            continue
        print(f"{s['variant']:<14} {s['tok_s']:7.2f} tok/s  x{s['speedup']:.3f} paired  {100 * s['frac_of_probe']:4.0f}% of "
              f"probe  p10 token {s['token_p10_ms']:.2f} ms = {s['p10_gbs']:.1f} GB/s  same tokens {s['same_greedy_tokens']}"
              f"  load {s['load_avg_1m']}")
    _plot(rows, labels, out.with_suffix(".png"), args.name)
    print(f"wrote {out}")
    return 0


def _plot(rows: list[dict[str, Any]], labels: list[str], path: Path, name: str) -> None:
    with figure(path, 1, 2, figsize=(11, 4)) as (fig, axes):
        for lb in labels:
            mine = [r for r in rows if r["variant"] == lb]
            axes[0].plot([r["round"] for r in mine], [r["tok_s"] for r in mine], "o-", label=lb)
            axes[1].plot([r["round"] for r in mine], [100 * r["frac_of_probe"] for r in mine], "o-", label=lb)
        axes[0].set_ylabel("decode tok/s")
        axes[1].set_ylabel("weight GB/s, % of the bracketing probe")
        for a in axes:
            a.set_xlabel("round (alternated)")
            a.grid(alpha=0.3)
            a.legend(fontsize=8)
        load = statistics.median(r["load_avg_1m"] for r in rows)
        fig.suptitle(f"{name}: decode A/B, {rows[0]['threads']} threads, load {load:.1f}", fontsize=10)


if __name__ == "__main__":
    sys.exit(main())
