"""Teacher-forced agreement with llama.cpp on the same GGUF file, and perplexity, per model.

For each model the first ``--tokens`` tokens of ``benchmarks/data/kjv_eval_mark_ruth.txt`` (BOS first)
run as one ``prefill_all`` through PerfX (its default build: the file's blocks, int8 activations on
AVX-512 VNNI machines; and ``--activations f32``) and through llama.cpp twice: as it runs the file (fp16
KV cache) and with an f32 KV cache. Reported per model: top-1 agreement of each PerfX build with
llama.cpp, llama.cpp's agreement with itself across its two KV settings (the ceiling: two runs of the
same engine that differ only in rounding), and each run's perplexity over the scored tokens.

    python benchmarks/agreement.py [--models gemma3-270m-q4_k_m,smollm2-q4_k_m] [--tokens 640]

Models are run_peers.py's names (random-weight files are left out: their logits are near flat, so
top-1 agreement measures noise). Writes ``agreement.csv`` and ``agreement.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

TEXT = ROOT / "benchmarks" / "data" / "kjv_eval_mark_ruth.txt"


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(-1, keepdims=True)
    lp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return float(np.exp(-lp[np.arange(len(ids) - 1), ids[1:]].mean()))


def top1(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(a.argmax(-1) == b.argmax(-1)))


def measure(name: str, work: Path, tokens: int) -> list[dict]:
    from run_peers import model_file

    from perfx_compiler.bench.llamacpp_logits import llamacpp_logits
    from perfx_compiler.model.loader import load_model
    from perfx_compiler.model.tokenizer import load_tokenizer
    from perfx_compiler.pipeline import compile_model
    from perfx_compiler.runtime.engine import Engine, read_manifest

    path = model_file(name, work / "models")
    desc = load_model(path, max_context=max(1024, tokens))
    ids = load_tokenizer(desc.tokenizer_json).encode(TEXT.read_text(encoding="utf-8")[: 12 * tokens]).ids
    if len(ids) < tokens - 1:
        raise SystemExit(f"{name}: the text gives {len(ids)} tokens, fewer than {tokens}")
    ids = [desc.config.bos_token_id, *ids[: tokens - 1]]
    ref = llamacpp_logits(path, ids)
    runs = {"llama.cpp f32 KV": llamacpp_logits(path, ids, mode="f32-kv")}
    for act in ("auto", "f32"):
        art = compile_model(desc, "host", work / f"agree-{name}-{act}", progress=False, activations=act)
        used = read_manifest(art)["activations"]
        runs[f"perfx ({used} activations)"] = np.asarray(Engine(art).prefill_all(ids))
    base = perplexity(ref, ids)
    rows = [{"model": name, "run": "llama.cpp", "tokens": len(ids), "top1_vs_llamacpp": 1.0,
             "perplexity": round(base, 4), "perplexity_vs_llamacpp": 1.0}]
    for run, logits in runs.items():
        ppl = perplexity(logits, ids)
        rows.append({"model": name, "run": run, "tokens": len(ids), "top1_vs_llamacpp": round(top1(logits, ref), 4),
                     "perplexity": round(ppl, 4), "perplexity_vs_llamacpp": round(ppl / base, 4)})
    return rows


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.2), squeeze=False)
    for ax, m in zip(axes[0], models, strict=True):
        rs = [r for r in rows if r["model"] == m and r["run"] != "llama.cpp"]
        ax.barh([r["run"] for r in rs], [100 * r["top1_vs_llamacpp"] for r in rs], color="tab:blue")
        ax.set_xlim(80, 100)
        ax.set_xlabel("top-1 agreement with llama.cpp (%)")
        ax.set_title(m)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gemma3-270m-q4_k_m,smollm2-q4_k_m")
    p.add_argument("--tokens", type=int, default=640)
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "perfx-bench"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder of the CSV and plot")
    args = p.parse_args(argv)
    rows = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        rows += measure(name, Path(args.work), args.tokens)
        for r in rows[-4:]:
            print(f"{r['model']:22s} {r['run']:28s} top-1 {100 * r['top1_vs_llamacpp']:5.1f}%  "
                  f"ppl {r['perplexity']:.3f} ({r['perplexity_vs_llamacpp']:.4f}x llama.cpp)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "agreement.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plot(rows, out / "agreement.png")
    print(f"wrote {out / 'agreement.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
