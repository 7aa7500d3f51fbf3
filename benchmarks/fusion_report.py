"""Decode kernels and decode time of each fusion variant (the numbers behind ``perfx-compile --report``).

Variants (``perfx_compiler.compile_report.fusion_variants``): no fusion pass, then one fusion pass
added at a time in pipeline order (fuse_add_norm, merge_projections,
fuse_swiglu); the other default passes (weight format, precision, weight layout) run in every
variant. Each variant is compiled once, for real (all phases); its kernel launches per decode step
and per prefill call are counted in the module after phase 2 (lower), where every launch is a
``call_tir``.

Timing: all variants are loaded in this process; each round times ``--steps`` greedy decode steps of
every variant after the same 16-token prompt (order reversed on odd rounds, so drift on this shared
2-core machine hits every variant alike); ``decode_ms`` is the median over rounds of each round's
median step. The fastest single step is kept beside it (``decode_ms_fastest``), with the load
average: on this machine single fastest steps swing by ~30% with the vCPU placement (two variants
with identical kernels differ that much), while the medians of identical variants agree.

    python benchmarks/fusion_report.py [--model smollm2-135m] [--quantization auto] [--rounds 7]

Writes ``benchmarks/results/fusion_report.csv`` and ``fusion_report.png``. Artifacts (and their launch
counts) are kept in ``--work`` and reused by a later run; delete a variant's folder to rebuild it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from _common import figure, write_csv

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results"


def build(desc: object, target: str, out: Path, passes: list[str], quantization: str) -> tuple[int, int]:
    """Compile one variant (every phase, as compile_model does) and return (decode, prefill) launches
    counted after phase 2."""
    from perfx_compiler import pipeline
    from perfx_compiler.compile_report import kernel_counts
    from perfx_compiler.targets import load_target

    tdesc = load_target(target)
    opts = pipeline.CompileOptions(target=target, output_dir=out, progress=False, passes=passes,
                                   quantization=quantization, batching=False)
    opts.quantization = pipeline.resolve_quantization(opts.quantization, desc, tdesc)
    state = pipeline.CompileState(desc=desc, target=tdesc, options=opts)
    state.notes["model_spec"] = str(getattr(desc, "source", "") or "model")
    counts = None
    for name, fn in pipeline.PHASES:
        fn(state)
        if name == "lower":
            counts = kernel_counts(state.mod)
    assert counts is not None
    return counts["decode"], counts["prefill"]


def step_times(eng: object, steps: int) -> list[float]:
    eng.reset()  # type: ignore[attr-defined]
    logits = eng.prefill(list(range(1, 17)))  # type: ignore[attr-defined]
    out = []
    for i in range(steps + 2):
        tok = int(np.argmax(logits))
        t = time.perf_counter()
        logits = eng.decode(tok)  # type: ignore[attr-defined]
        if i >= 2:
            out.append(time.perf_counter() - t)
    return out


def plot(rows: list[dict], path: Path, title: str) -> None:
    with figure(path, 1, 2, figsize=(10, 3.8), dpi=120) as (fig, (a1, a2)):
        names = [r["variant"] for r in rows]
        for ax, key, label, color in ((a1, "decode_kernels", "kernel launches per decode step", "#48c"),
                                      (a2, "decode_ms", "decode step, ms (median)", "#3a7")):
            vals = [float(r[key]) for r in rows]
            bars = ax.bar(range(len(rows)), vals, color=color)
            for b, v in zip(bars, vals, strict=True):
                ax.text(b.get_x() + b.get_width() / 2, v, f"{v:g}" if key == "decode_kernels" else f"{v:.2f}",
                        ha="center", va="bottom", fontsize=8)
            ax.set_xticks(range(len(rows)), names, rotation=20, ha="right", fontsize=8)
            ax.set_ylabel(label)
        fig.suptitle(title, fontsize=10)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--target", default="host")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--max-context", type=int, default=256)
    p.add_argument("--work", type=Path, default=Path("/tmp/perfx-fusion-report"))
    p.add_argument("--out", type=Path, default=RESULTS / "fusion_report.csv")
    args = p.parse_args()

    from perfx_compiler.compile_report import fusion_variants
    from perfx_compiler.model.loader import load_model
    from perfx_compiler.runtime.engine import Engine

    desc = load_model(args.model, max_context=args.max_context)
    variants = fusion_variants()
    rows, engines = [], []
    for i, (label, passes) in enumerate(variants):
        out = args.work / f"{Path(args.model).stem}-{args.quantization}-v{i}"
        t = time.perf_counter()
        counts_file = out / "launch_counts.json"
        if counts_file.is_file() and (out / "perfx-config.json").is_file():  # compiled by an earlier run
            dec, pre = json.loads(counts_file.read_text())
        else:
            dec, pre = build(desc, args.target, out, passes, args.quantization)
            counts_file.write_text(json.dumps([dec, pre]))
        print(f"{label}: {dec} decode / {pre} prefill launches ({time.perf_counter() - t:.0f} s)", flush=True)
        rows.append({"model": args.model, "quantization": args.quantization, "variant": label,
                     "passes": " ".join(passes), "decode_kernels": dec, "prefill_kernels": pre})
        engines.append(Engine(out))

    per_round: list[list[float]] = [[] for _ in variants]
    best = [float("inf")] * len(variants)
    loads = []
    for r in range(args.rounds):
        order = list(range(len(variants)))
        for i in order if r % 2 == 0 else order[::-1]:
            steps = step_times(engines[i], args.steps)
            per_round[i].append(float(np.median(steps)))
            best[i] = min(best[i], min(steps))
        loads.append(os.getloadavg()[0])
        print(f"round {r}: " + ", ".join(f"{1e3 * v[-1]:.2f}" for v in per_round) + f" ms (load {loads[-1]:.1f})",
              flush=True)
    for row, times, fastest in zip(rows, per_round, best, strict=True):
        row["decode_ms"] = round(1e3 * float(np.median(times)), 3)
        row["decode_tok_s"] = round(1e3 / row["decode_ms"], 1)
        row["decode_ms_fastest"] = round(1e3 * fastest, 3)
        row["rounds"] = args.rounds
        row["steps_per_round"] = args.steps
        row["load_avg_median"] = round(float(np.median(loads)), 1)
    write_csv(args.out, rows)
    plot(rows, args.out.with_suffix(".png"),
         f"{args.model} ({args.quantization}, {args.target}): fusion variants, median of {args.rounds} rounds, "
         f"load avg {rows[0]['load_avg_median']}")
    for row in rows:
        print(f"{row['variant']:<24} {row['decode_kernels']:>5} launches  {row['decode_ms']:.2f} ms/step (median), "
              f"{row['decode_ms_fastest']:.2f} (fastest)")
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
