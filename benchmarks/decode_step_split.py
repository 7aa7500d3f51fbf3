"""Where a decode step's bandwidth goes: the whole step against its GEMVs alone, per vCPU placement.

For #8's "decode >= 90% of the read bandwidth" on a memory-bound model: is the shortfall in the GEMVs
(how fast they stream the weights) or between them (attention, norms, the step's order)? One decode
step is traced once (``decode_overhead.Subject``: the kernel calls in order, on the VM's own buffers),
then per round, bracketed by the read-bandwidth probe and tagged with the placement (ping-pong):

* ``full_ms``   every kernel of the step replayed back to back from C++ (no VM, no Python);
* ``gemv_ms``   only the quantized GEMVs (``*matmul*``), back to back in the step's order;
* ``other_ms``  only the rest (attention, norms, swiglu, the embedding gather), back to back;
* ``interaction_ms`` = full - gemv - other: what running them interleaved costs beyond their sum
  (each GEMV restarting its weight stream after a small kernel, caches the small kernels refill);
* ``full_frac`` / ``gemv_frac``: the step's weight bytes over ``full_ms`` / ``gemv_ms``, as a
  fraction of the probe (mean of the two probes around the round).

Per kernel, ``replay_each`` times every call on its own in the full sequence; the per-kind table
(``_kernels.csv``) holds the median us per step and GB/s (GEMVs) per placement.

    python benchmarks/decode_step_split.py ARTIFACT --name tinyllama-q4_0 [--rounds 12] [--passes 30]
                                           [--threads 2] [--position 32]

Writes benchmarks/results/decode_step_split_<name>.csv (every round, then a median row per placement),
decode_step_split_<name>_kernels.csv and a PNG.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
from _common import RESULTS, figure, medians, write_csv

GEMV = re.compile(r"matmul")


def gemv_weights(call: list[Any], manifest: dict[str, Any]) -> list[np.ndarray]:
    """The weight arrays a recorded quantized-GEMV call streams: its uint8 codes and float16 scales and
    Q4_1 min / asymmetric zero array, whatever float32 activations come before or after them (x, or a
    fused prologue's a, b, norm weight and sum; y, or an epilogue's y and h); a zero array the kernel
    never reads (``engines.is_unread_sym_zero``: Q4_0's all-8 zeros under int8 activations) is not
    counted. (Before 2026-12-01 a fused add_rms_norm GEMV's unread zeros and its a/b/w/sum counted too:
    its GB/s in results/decode_step_split_*_kernels.csv of that date read ~6% high.)"""
    from perfx_compiler.bench.engines import is_unread_sym_zero

    arrays = [a for a in (np.from_dlpack(t) for t in call[1:]) if a.dtype != np.float32]
    if len(arrays) == 3 and is_unread_sym_zero(manifest, arrays[2]):
        arrays = arrays[:2]
    return arrays


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--name", required=True)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--passes", type=int, default=30, help="replay passes per measurement (median taken)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--position", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    from tvm.script import tirx  # noqa: F401 - imported before the engine's modules (import order)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from decode_overhead import Subject, build_replay_module

    from perfx_compiler.bench import machine
    from perfx_compiler.bench.engines import perfx_weight_bytes
    from perfx_compiler.bench.report import probe_move

    replay = build_replay_module()
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(100, 30000, args.position + 8)]
    subj = Subject("a", args.artifact, prompt, args.position)
    wbytes = perfx_weight_bytes(subj.engine.manifest, args.artifact)
    names = subj.names
    gemv = [c for c, n in zip(subj.calls, names, strict=True) if GEMV.search(n)]
    other = [c for c, n in zip(subj.calls, names, strict=True) if not GEMV.search(n)]
    print(f"{args.artifact}: {len(subj.calls)} kernel calls ({len(gemv)} GEMVs), {wbytes / 1e9:.3f} GB per step",
          flush=True)
    probe = machine.BandwidthProbe(args.threads)
    rows: list[dict[str, Any]] = []
    per_call: dict[str, list[np.ndarray]] = {}
    try:
        for r in range(args.rounds):
            ns = machine.pingpong_ns(settle_s=0.2)
            place = machine.placement(ns)
            bw0 = probe.measure()
            full = statistics.median(list(replay.replay(subj.calls, args.passes, False)))
            g = statistics.median(list(replay.replay(gemv, args.passes, False)))
            o = statistics.median(list(replay.replay(other, args.passes, False)))
            each = np.array(list(replay.replay_each(subj.calls, args.passes))).reshape(args.passes, -1)
            bw1 = probe.measure()
            bw = (bw0 + bw1) / 2
            per_call.setdefault(place, []).append(np.median(each, axis=0))
            row = {"round": r, "placement": place, "pingpong_ns": round(ns, 1), "probe_gbs": round(bw, 2),
                   "probe_move": round(probe_move(bw0, bw1), 3),
                   "full_ms": round(full * 1e3, 4), "gemv_ms": round(g * 1e3, 4), "other_ms": round(o * 1e3, 4),
                   "interaction_ms": round((full - g - o) * 1e3, 4),
                   "full_frac": round(wbytes / full / 1e9 / bw, 4), "gemv_frac": round(wbytes / g / 1e9 / bw, 4),
                   "threads": args.threads, "load_avg_1m": round(os.getloadavg()[0], 2)}
            rows.append(row)
            print(f"round {r} {place:6s} {ns:4.0f} ns probe {bw:5.1f} GB/s | full {row['full_ms']:.3f} ms "
                  f"({row['full_frac']:.1%}) gemv-only {row['gemv_ms']:.3f} ({row['gemv_frac']:.1%}) "
                  f"other-only {row['other_ms']:.3f} interaction {row['interaction_ms']:+.3f}", flush=True)
    finally:
        probe.close()
    summary = []
    for place in sorted({r["placement"] for r in rows}):
        mine = [r for r in rows if r["placement"] == place]
        med = medians(mine, probe_gbs=4, full_ms=4, gemv_ms=4, other_ms=4, interaction_ms=4, full_frac=4,
                      gemv_frac=4)
        summary.append({"round": "median", "placement": place, **med, "threads": args.threads,
                        **medians(mine, load_avg_1m=2), "rounds": len(mine)})
        print(f"{place}: {len(mine)} rounds, full {med['full_frac']:.1%} of the probe, GEMVs alone "
              f"{med['gemv_frac']:.1%}, other kernels {med['other_ms']:.3f} ms, interaction "
              f"{med['interaction_ms']:+.3f} ms", flush=True)
    out = Path(args.out) if args.out else RESULTS / f"decode_step_split_{args.name}.csv"
    write_csv(out, rows + summary, columns=[*rows[0], "rounds"])
    kinds = []
    for place, arrs in sorted(per_call.items()):
        med = np.median(np.stack(arrs), axis=0)
        probe_med = statistics.median(r["probe_gbs"] for r in rows if r["placement"] == place)
        agg: dict[str, list[float]] = {}
        call_bytes: dict[str, int] = {}
        for c, n, t in zip(subj.calls, names, med, strict=True):
            agg.setdefault(n, []).append(float(t))
            if GEMV.search(n):
                call_bytes[n] = sum(a.nbytes for a in gemv_weights(c, subj.engine.manifest))
        for n, ts in sorted(agg.items(), key=lambda kv: -sum(kv[1])):
            b = call_bytes.get(n)
            gbs = b * len(ts) / sum(ts) / 1e9 if b else float("nan")
            kinds.append({"placement": place, "kernel": n, "calls_per_step": len(ts),
                          "us_per_step": round(sum(ts) * 1e6, 1), "us_per_call": round(sum(ts) / len(ts) * 1e6, 2),
                          "gb_s": round(gbs, 2), "frac_of_probe": round(gbs / probe_med, 4) if b else float("nan")})
    kout = out.with_name(out.stem + "_kernels.csv")
    write_csv(kout, kinds)
    _plot(rows, out.with_suffix(".png"), args)
    print(f"wrote {out}, {kout} and {out.with_suffix('.png')}")
    return 0


def _plot(rows: list[dict[str, Any]], path: Path, args: argparse.Namespace) -> None:
    colors = {"shared": "tab:blue", "split": "tab:orange"}
    with figure(path, 1, 2, figsize=(11, 4)) as (fig, axes):
        for place in sorted({r["placement"] for r in rows}):
            mine = [r for r in rows if r["placement"] == place]
            axes[0].plot([r["round"] for r in mine], [100 * r["full_frac"] for r in mine], "o",
                         color=colors.get(place), label=f"whole step ({place})")
            axes[0].plot([r["round"] for r in mine], [100 * r["gemv_frac"] for r in mine], "^",
                         color=colors.get(place), alpha=0.5, label=f"GEMVs alone ({place})")
            axes[1].bar([r["round"] for r in mine], [r["other_ms"] for r in mine], color=colors.get(place),
                        label=f"other kernels alone ({place})")
            axes[1].bar([r["round"] for r in mine], [r["interaction_ms"] for r in mine],
                        bottom=[r["other_ms"] for r in mine], color=colors.get(place), alpha=0.4,
                        label=f"interaction ({place})")
        axes[0].axhline(90, color="gray", ls="--", lw=1)
        axes[0].set_xlabel("round")
        axes[0].set_ylabel("weight GB/s, % of the probe")
        axes[0].legend(fontsize=8)
        axes[1].set_xlabel("round")
        axes[1].set_ylabel("ms per step beyond the GEMVs")
        axes[1].legend(fontsize=8)
        fig.suptitle(f"decode step vs its GEMVs, {args.name}, {args.threads} threads", fontsize=10)


if __name__ == "__main__":
    raise SystemExit(main())
