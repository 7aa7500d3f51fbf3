"""Decode and prefill at long context: PerfX against llama.cpp (flash attention on and off), same GGUF.

For each prompt length L (default 128, 1k, 4k, 8k; capped at the model's context less the decode
tokens), each engine prefills L tokens (prefill tok/s = L / time to the first token) and then decodes
``--decode-tokens`` greedy tokens. A decode step reads the weights and the KV cache written so far, so
the achieved GB/s counts both: weight bytes + KV bytes at the decode's mean context (each engine's own
cache type: PerfX's from its manifest, llama.cpp's f16). The machine's read bandwidth is probed at the
start of every round and is the ceiling. Engines run in alternated order per round, lengths in
increasing order, each engine in its own worker process; its peak RSS is read after each length of
the first round (the peak up to that length), beside the weights + full KV cache it holds.

    python benchmarks/long_context.py --models smollm2-q4_1,tinyllama-q4_0 [--contexts 128,1024,4096,8192]
                                      [--rounds 3] [--decode-tokens 32] [--out benchmarks/results/intel-xeon]

Writes long_context_<model>.csv (medians; ``decode_vs_best_llamacpp`` and ``prefill_vs_best_llamacpp``
against the faster llama.cpp setting at that length), long_context_<model>_rounds.csv and a plot.
Model names as in run_peers.py, or a GGUF path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from _common import RESULTS, alternated, figure, write_csv
from run_peers import model_file

from perfx_compiler.bench import machine as mach
from perfx_compiler.bench import models
from perfx_compiler.cli.bench import Worker
from perfx_compiler.model.gguf_header import read_gguf_header

# label -> (worker engine, llama.cpp flash attention)
ENGINES = {"perfx": ("perfx", None), "llama.cpp": ("llama.cpp", False), "llama.cpp-fa": ("llama.cpp", True)}
COLUMNS = ["model", "engine", "prompt_tokens", "decode_tok_s", "prefill_tok_s", "weight_mb_per_token",
           "kv_mb_per_token", "achieved_gbs", "bw_ceiling_gbs", "bw_fraction", "peak_rss_mb", "weights_kv_mb",
           "decode_vs_best_llamacpp", "prefill_vs_best_llamacpp", "rounds"]


def trained_context(gguf: Path) -> int:
    fields = read_gguf_header(gguf).fields
    key = f"{fields.get('general.architecture', 'llama')}.context_length"
    if key not in fields:
        raise SystemExit(f"{gguf}: no {key} in its metadata")
    return int(fields[key])


def perfx_kv_bytes_per_position(manifest: dict[str, Any]) -> int:
    """Bytes one cached position takes over all layers (K and V, scales included where the cache has them):
    each cache array holds ``max_context`` positions."""
    kv, positions = manifest["kv_cache"], int(manifest["model"]["max_context"])
    per = int(kv["count"]) * int(np.prod(kv["shape"])) * np.dtype(kv["dtype"]).itemsize
    scales = kv.get("scales")
    if scales:
        per += int(kv["count"]) * int(np.prod(scales["shape"])) * np.dtype(scales["dtype"]).itemsize
    return per // positions


def llamacpp_kv_bytes_per_position(manifest: dict[str, Any]) -> int:
    """llama.cpp's default cache: K and V in f16 for every layer."""
    m = manifest["model"]
    return int(m["num_layers"]) * 2 * int(m["num_kv_heads"]) * int(m["head_dim"]) * 2


def run_model(name: str, args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    work = Path(args.work)
    gguf = Path(name) if Path(name).is_file() else model_file(name, work / "models")
    name = gguf.stem if Path(name).is_file() else name
    n = args.decode_tokens
    limit = trained_context(gguf) - n - 1
    lengths = sorted({min(int(x), limit) for x in args.contexts.split(",")})
    max_context = lengths[-1] + n + 1
    art, _ = models.compile_perfx(gguf, work, max_context=max_context)
    manifest = json.loads((art / "perfx-config.json").read_text())
    kv_per_pos = {"perfx": perfx_kv_bytes_per_position(manifest)}
    for label in ENGINES:
        kv_per_pos.setdefault(label, llamacpp_kv_bytes_per_position(manifest))
    prompt = np.random.default_rng(0).integers(3, int(manifest["model"]["vocab_size"]), lengths[-1]).tolist()

    workers: dict[str, Worker] = {}
    raw: list[dict[str, Any]] = []
    peaks: dict[tuple[str, int], float] = {}
    try:
        for label, (kind, flash) in ENGINES.items():
            opts = {} if kind == "perfx" else {"n_ctx": max_context, "n_batch": 512, "flash_attn": flash}
            workers[label] = Worker(kind, art if kind == "perfx" else gguf, args.threads,
                                    work / f"worker-long-{name}-{label}.log", opts)
        weight_bytes = {label: int(w.ask("info")["weight_bytes"]) for label, w in workers.items()}
        with mach.BandwidthProbe(args.threads, args.bw_size_mb << 20) as probe:
            for r in range(args.rounds):
                ceiling = probe.measure(3)
                for length in lengths:
                    for label in alternated(list(ENGINES), r + lengths.index(length)):
                        d = workers[label].ask("decode", prompt=prompt[:length], n=n)
                        mean_ctx = length + (n + 1) / 2
                        kv_bytes = kv_per_pos[label] * mean_ctx
                        tok_s = n / d["decode_s"]
                        gbs = (weight_bytes[label] + kv_bytes) * tok_s / 1e9
                        raw.append({"model": name, "engine": label, "round": r, "prompt_tokens": length,
                                    "decode_tok_s": tok_s, "prefill_tok_s": length / d["ttft_s"],
                                    "weight_mb_per_token": weight_bytes[label] / 1e6, "kv_mb_per_token": kv_bytes / 1e6,
                                    "achieved_gbs": gbs, "bw_ceiling_gbs": ceiling, "bw_fraction": gbs / ceiling})
                        if r == 0:
                            peaks[(label, length)] = float(workers[label].ask("peak")["peak_rss_mb"])
                        print(f"round {r} {label:13s} L={length:5d}: decode {tok_s:6.1f} tok/s ({gbs:5.1f} GB/s, "
                              f"{gbs / ceiling:4.0%}), prefill {length / d['ttft_s']:7.1f} tok/s", flush=True)
    finally:
        for w in workers.values():
            w.close()

    summary = []
    full_kv_mb = {label: kv_per_pos[label] * max_context / 1e6 for label in ENGINES}
    for length in lengths:
        for label in ENGINES:
            rows = [x for x in raw if x["engine"] == label and x["prompt_tokens"] == length]
            med = {k: statistics.median(x[k] for x in rows) for k in
                   ("decode_tok_s", "prefill_tok_s", "achieved_gbs", "bw_ceiling_gbs", "bw_fraction")}
            summary.append({"model": name, "engine": label, "prompt_tokens": length, **med,
                            "weight_mb_per_token": weight_bytes[label] / 1e6, "kv_mb_per_token": rows[0]["kv_mb_per_token"],
                            "peak_rss_mb": peaks[(label, length)],
                            "weights_kv_mb": weight_bytes[label] / 1e6 + full_kv_mb[label], "rounds": len(rows)})
        best = {k: max(s[k] for s in summary if s["prompt_tokens"] == length and s["engine"] != "perfx")
                for k in ("decode_tok_s", "prefill_tok_s")}
        for s in summary:
            if s["prompt_tokens"] == length:
                s["decode_vs_best_llamacpp"] = s["decode_tok_s"] / best["decode_tok_s"]
                s["prefill_vs_best_llamacpp"] = s["prefill_tok_s"] / best["prefill_tok_s"]
    return raw, summary


def plot(summary: list[dict[str, Any]], path: Path, name: str) -> None:
    with figure(path, 1, 3, figsize=(15, 4.2)) as (fig, (ax_dec, ax_bw, ax_pre)):
        for label in ENGINES:
            rows = [s for s in summary if s["engine"] == label]
            xs = [s["prompt_tokens"] for s in rows]
            ax_dec.plot(xs, [s["decode_tok_s"] for s in rows], marker="o", label=label)
            ax_bw.plot(xs, [s["bw_fraction"] for s in rows], marker="o", label=label)
            ax_pre.plot(xs, [s["prefill_tok_s"] for s in rows], marker="o", label=label)
        for ax, title in ((ax_dec, "decode tok/s"), (ax_bw, "decode: (weights + KV) GB/s / read bandwidth"),
                          (ax_pre, "prefill tok/s")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("prompt tokens")
            ax.set_title(title)
            ax.grid(alpha=0.3)
        ax_bw.axhline(0.85, color="gray", ls="--", lw=1)
        ax_dec.legend()
        fig.suptitle(f"{name}: long context, 2 threads")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2-q4_1,tinyllama-q4_0")
    p.add_argument("--contexts", default="128,1024,4096,8192")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bw-size-mb", type=int, default=1024)
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "perfx-bench"))
    p.add_argument("--out", default=str(RESULTS / "intel-xeon"))
    args = p.parse_args(argv)
    out = Path(args.out)
    for spec in [m.strip() for m in args.models.split(",") if m.strip()]:
        raw, summary = run_model(spec, args)
        name = summary[0]["model"]
        write_csv(out / f"long_context_{name}_rounds.csv", raw, floats=".5g")
        write_csv(out / f"long_context_{name}.csv", summary, COLUMNS, floats=".5g")
        plot(summary, out / f"long_context_{name}.png", name)
        print(f"wrote {out / f'long_context_{name}.csv'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
