"""Perplexity of the default model per quantization on a public-domain text.

Text: ``benchmarks/data/kjv_eval_mark_ruth.txt`` (KJV Gospel of Mark + Ruth, public domain; see
``benchmarks/data/README.md``), tokenized with the model's tokenizer, cut into non-overlapping
windows of ``--window`` tokens; each window runs ``Engine.prefill_all`` from an empty cache and
scores its tokens 2..W. Perplexity = exp(mean negative log-likelihood) over all scored tokens.
``f32`` is the dequantized-GGUF baseline (the float weights the file describes).

    python benchmarks/perplexity.py [--tokens 20480] [--quantizations f32 gguf q4_g128 q4_awq_g128 q8]

Writes ``benchmarks/results/perplexity.csv`` and ``perplexity.png``; artifacts are cached in --work.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TEXT = REPO / "benchmarks" / "data" / "kjv_eval_mark_ruth.txt"
RESULTS = REPO / "benchmarks" / "results"


def eval_ids(desc: object, n: int) -> list[int]:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_str(desc.tokenizer_json).encode(TEXT.read_text()).ids  # type: ignore[attr-defined]
    if len(ids) < n:
        print(f"note: the text has {len(ids)} tokens, fewer than --tokens {n}; using all")
    return ids[:n]


def perplexity(art: Path, ids: list[int], window: int) -> tuple[float, int, float]:
    """(perplexity, scored tokens, seconds)."""
    from perfx_compiler.runtime.engine import Engine

    eng = Engine(art)
    nll, count, start = 0.0, 0, time.perf_counter()
    for lo in range(0, len(ids) - 1, window):
        chunk = ids[lo : lo + window]
        if len(chunk) < 2:
            break
        eng.reset()
        logits = np.asarray(eng.prefill_all(chunk), dtype=np.float64)
        logits = logits.reshape(-1, logits.shape[-1])[: len(chunk) - 1]
        m = logits.max(axis=1, keepdims=True)
        logp = logits - m - np.log(np.exp(logits - m).sum(axis=1, keepdims=True))
        nll -= float(logp[np.arange(len(chunk) - 1), chunk[1:]].sum())
        count += len(chunk) - 1
    return float(np.exp(nll / count)), count, time.perf_counter() - start


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    names = [r["quantization"] for r in rows]
    vals = [float(r["perplexity"]) for r in rows]
    bars = ax.bar(names, vals, color=["#777" if n == "f32" else "#3a7" for n in names])
    for b, v in zip(bars, vals, strict=True):
        ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.3f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylim(min(vals) * 0.95, max(vals) * 1.03)
    ax.set_ylabel("perplexity (lower is better)")
    ax.set_title(f"{rows[0]['model']}: {rows[0]['tokens']} tokens of KJV Mark+Ruth, window {rows[0]['window']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quantizations", nargs="+", default=["f32", "gguf", "q4_g128", "q4_awq_g128", "q8"])
    p.add_argument("--tokens", type=int, default=20480)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--work", type=Path, default=Path("/tmp/perfx-perplexity"))
    p.add_argument("--out", type=Path, default=RESULTS / "perplexity.csv")
    args = p.parse_args()

    from perfx_compiler.model.loader import load_model
    from perfx_compiler.pipeline import compile_model

    desc = load_model(args.model, max_context=args.window)
    ids = eval_ids(desc, args.tokens)
    rows = []
    for q in args.quantizations:
        art = args.work / f"{args.model}-{q}-w{args.window}"
        if not (art / "perfx-config.json").is_file():
            t = time.perf_counter()
            compile_model(desc, "host", art, progress=False, quantization=q, batching=False)
            print(f"{q}: compiled in {time.perf_counter() - t:.0f} s", flush=True)
        ppl, n, secs = perplexity(art, ids, args.window)
        manifest = json.loads((art / "perfx-config.json").read_text())
        rows.append({"model": args.model, "quantization": q, "tokens": n, "window": args.window,
                     "perplexity": round(ppl, 4), "weight_bytes": manifest["weight_bytes"], "seconds": round(secs, 1)})
        print(rows[-1], flush=True)
    base = next((r["perplexity"] for r in rows if r["quantization"] == "f32"), None)
    for r in rows:
        r["delta_vs_f32_pct"] = round(100 * (r["perplexity"] / base - 1), 3) if base else ""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
