"""A/B of two compiled artifacts' prefill speed at fixed prompt lengths (default 128 and 512
tokens), e.g. a quantized model before / after a change of its prefill path.

Both artifacts are loaded in one process; each round times one prefill of every length on A,
then on B (alternated, so a shared machine's load hits both alike), after one warm-up each.
Prompts are fixed random token ids (seed 0). Also checks that A and B give the same logits
(max |diff| relative to max |logit|). Writes every run plus the medians to a CSV and a bar plot.
``--profile R``: also R alternated per-kernel profiles (``bench.profile``) of each side, summed
per kernel group (dequantize / matmul / rest) into ``<out>_kernels.csv``; a kernel's median over
instrumented runs is less exposed to a shared machine's load than the end-to-end time.

    python benchmarks/quant_prefill_ab.py ART_A ART_B [--labels before,after] [--rounds 7]
        [--lengths 128,512] [--out benchmarks/results/quant_prefill_ab.csv]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import time
from pathlib import Path

import numpy as np
from _common import write_csv

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--labels", default="A,B")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--lengths", default="128,512")
    p.add_argument("--out", default=str(RESULTS / "quant_prefill_ab.csv"))
    p.add_argument("--profile", type=int, default=0, help="alternated per-kernel profile rounds")
    args = p.parse_args()

    from perfx_compiler.runtime.engine import Engine

    labels = args.labels.split(",")
    lengths = [int(x) for x in args.lengths.split(",")]
    engines = {label: Engine(art, verify=False) for label, art in zip(labels, (args.a, args.b), strict=True)}
    vocab = min(e.vocab_size for e in engines.values())
    ids = np.random.default_rng(0).integers(0, vocab, size=max(lengths)).tolist()

    logits = {}
    for label, eng in engines.items():  # warm-up (first-call allocation) + the logits check
        for n in lengths:
            eng.reset()
            logits[(label, n)] = np.asarray(eng.prefill(ids[:n]))
    diff = max(float(np.abs(logits[(labels[0], n)] - logits[(labels[1], n)]).max()
                     / np.abs(logits[(labels[0], n)]).max()) for n in lengths)

    runs = []
    for r in range(args.rounds):
        for label in labels:
            eng = engines[label]
            for n in lengths:
                eng.reset()
                t0 = time.perf_counter()
                eng.prefill(ids[:n])
                dt = time.perf_counter() - t0
                runs.append({"round": r, "variant": label, "prompt_tokens": n, "prefill_ms": round(dt * 1e3, 2),
                             "prefill_tok_s": round(n / dt, 1), "load_avg_1m": round(os.getloadavg()[0], 2)})
                print(runs[-1], flush=True)
    rows = list(runs)
    for label in labels:
        for n in lengths:
            mine = [x for x in runs if x["variant"] == label and x["prompt_tokens"] == n]
            rows.append({"round": "median", "variant": label, "prompt_tokens": n,
                         "prefill_ms": statistics.median(x["prefill_ms"] for x in mine),
                         "prefill_tok_s": statistics.median(x["prefill_tok_s"] for x in mine),
                         "load_avg_1m": statistics.median(x["load_avg_1m"] for x in mine)})
            print(f"{label} prefill{n}: median {rows[-1]['prefill_tok_s']:.1f} tok/s")
    print(f"max relative logit difference A vs B: {diff:.2e}")
    arts = dict(zip(labels, (args.a, args.b), strict=True))
    out = write_csv(args.out, [{**row, "artifact": arts[row["variant"]], "max_rel_logit_diff": f"{diff:.2e}"}
                               for row in rows])
    print(f"wrote {out}")
    _plot(rows, labels, lengths, out.with_suffix(".png"))
    if args.profile:
        _kernel_groups(engines, ids, lengths, args.profile, out.with_name(out.stem + "_kernels.csv"))


def _group(kernel: str) -> str:
    if "dequant" in kernel:
        return "dequantize"
    return "matmul" if "matmul" in kernel else "rest"


def _kernel_groups(engines: dict, ids: list[int], lengths: list[int], rounds: int, path: Path) -> None:
    from perfx_compiler.bench.profile import profile_engine

    per: dict[tuple[str, str, str], list[float]] = {}
    for _ in range(rounds):
        for label, eng in engines.items():
            for prof in profile_engine(eng, ids[:16], decode_steps=1, prefill_lens=lengths):
                if not prof.phase.startswith("prefill"):
                    continue
                sums: dict[str, float] = {}
                for k in prof.kernels:
                    sums[_group(k.kernel)] = sums.get(_group(k.kernel), 0.0) + k.seconds / prof.steps
                for g, sec in sums.items():
                    per.setdefault((label, prof.phase, g), []).append(sec * 1e3)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "phase", "kernel_group", "median_ms", "rounds_ms"])
        for (label, phase, g), ms in sorted(per.items()):
            w.writerow([label, phase, g, round(statistics.median(ms), 2), " ".join(f"{x:.1f}" for x in ms)])
            print(f"{label} {phase} {g}: median {statistics.median(ms):.1f} ms")
    print(f"wrote {path}")


def _plot(rows: list[dict], labels: list[str], lengths: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = {(x["variant"], x["prompt_tokens"]): x["prefill_tok_s"] for x in rows if x["round"] == "median"}
    fig, ax = plt.subplots(figsize=(5, 3.2))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        xs = [j + i * width for j in range(len(lengths))]
        ax.bar(xs, [med[(label, n)] for n in lengths], width, label=label)
        for r in (x for x in rows if x["variant"] == label and x["round"] != "median"):
            ax.plot(lengths.index(r["prompt_tokens"]) + i * width, r["prefill_tok_s"], "k.", ms=3)
    ax.set_xticks([j + width * (len(labels) - 1) / 2 for j in range(len(lengths))], [f"prefill {n}" for n in lengths])
    ax.set_ylabel("tok/s (median; dots: rounds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
