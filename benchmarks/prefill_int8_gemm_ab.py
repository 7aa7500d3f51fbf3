"""Whole-model prefill A/B of the int8 VNNI GEMM: PerfX built with it (``gemm``), PerfX built with
``PERFX_VNNI_GEMM=0`` (``dequant``: dequantize + fp32 GEMM, the path it replaces), and llama.cpp
(llama-cpp-python on the same GGUF), each in its own worker process (``perfx_compiler.bench.worker``),
same thread count.

Each round times one prefill of every length on every engine in turn (A B C, A B C, ...), after one
warm-up each; prompts are fixed random token ids (seed 0). Per round it records the 1-minute load
average (the host is shared; the medians and per-round ratios are the result).

    python benchmarks/prefill_int8_gemm_ab.py --model smollm2-q4_1 --gemm ART --dequant ART --gguf FILE
        [--rounds 7] [--lengths 128,512] [--threads 2]
Writes benchmarks/results/prefill_int8_gemm_<model>.csv (every run + medians) and a bar plot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
from _common import figure, write_csv

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent


class Worker:
    def __init__(self, engine: str, path: str, threads: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the working tree's package, not an installed copy
        spec = json.dumps({"engine": engine, "path": path, "threads": threads})
        self.proc = subprocess.Popen([sys.executable, "-m", "perfx_compiler.bench.worker", spec], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline()  # {"ready": true, "load_s": ...} once the engine is built
        if '"ready"' not in ready:
            raise RuntimeError(f"{engine} worker failed to start: {ready!r}")
        self.info = self.ask({"op": "info"})

    def ask(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {req} died")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(out["error"])
        return out

    def close(self) -> None:
        try:
            self.ask({"op": "quit"})
        except (RuntimeError, BrokenPipeError, ValueError):
            pass
        self.proc.wait(timeout=30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--gemm", required=True)
    p.add_argument("--dequant", required=True)
    p.add_argument("--gguf", default="")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--lengths", default="128,512")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="")
    args = p.parse_args()

    lengths = [int(v) for v in args.lengths.split(",")]
    specs = {"perfx_gemm": ("perfx", args.gemm), "perfx_dequant": ("perfx", args.dequant)}
    if args.gguf:
        specs["llama.cpp"] = ("llama.cpp", args.gguf)
    workers: dict[str, Worker] = {}
    for label, (engine, path) in specs.items():
        workers[label] = Worker(engine, path, args.threads)
        print(label, workers[label].info, flush=True)
    ids = np.random.default_rng(0).integers(100, 30000, size=max(lengths)).tolist()
    runs: list[dict[str, Any]] = []
    try:
        for w in workers.values():
            for n in lengths:
                w.ask({"op": "prefill", "ids": ids[:n]})  # warm-up
        for r in range(args.rounds):
            for label, w in workers.items():
                for n in lengths:
                    dt = float(w.ask({"op": "prefill", "ids": ids[:n]})["prefill_s"])
                    runs.append({"round": r, "engine": label, "prompt_tokens": n, "prefill_ms": round(dt * 1e3, 2),
                                 "prefill_tok_s": round(n / dt, 1), "load_avg_1m": round(os.getloadavg()[0], 2)})
                    print(runs[-1], flush=True)
    finally:
        for w in workers.values():
            w.close()
    rows = list(runs)
    for label in workers:
        for n in lengths:
            mine = [x for x in runs if x["engine"] == label and x["prompt_tokens"] == n]
            base = {x["round"]: x["prefill_tok_s"] for x in runs if x["engine"] == "perfx_dequant"
                    and x["prompt_tokens"] == n}
            peer = {x["round"]: x["prefill_tok_s"] for x in runs if x["engine"] == "llama.cpp" and x["prompt_tokens"] == n}
            rows.append({"round": "median", "engine": label, "prompt_tokens": n,
                         "prefill_ms": statistics.median(x["prefill_ms"] for x in mine),
                         "prefill_tok_s": statistics.median(x["prefill_tok_s"] for x in mine),
                         "load_avg_1m": statistics.median(x["load_avg_1m"] for x in mine),
                         "ratio_vs_dequant": round(statistics.median(x["prefill_tok_s"] / base[x["round"]] for x in mine), 3),
                         "ratio_vs_llama_cpp": round(statistics.median(x["prefill_tok_s"] / peer[x["round"]] for x in mine), 3)
                         if peer else ""})
            print(rows[-1], flush=True)
    out = Path(args.out or RESULTS / f"prefill_int8_gemm_{args.model}.csv")
    out.parent.mkdir(parents=True, exist_ok=True)
    fields = ["round", "engine", "prompt_tokens", "prefill_ms", "prefill_tok_s", "load_avg_1m", "ratio_vs_dequant",
              "ratio_vs_llama_cpp"]
    write_csv(out, rows, columns=fields)
    _plot([r for r in rows if r["round"] == "median"], out.with_suffix(".png"), args.model)
    print(f"wrote {out}")


def _plot(meds: list[dict[str, Any]], path: Path, model: str) -> None:
    engines = list(dict.fromkeys(r["engine"] for r in meds))
    lengths = sorted({r["prompt_tokens"] for r in meds})
    with figure(path, figsize=(7, 4)) as (fig, ax):
        w = 0.8 / len(engines)
        for i, e in enumerate(engines):
            vals = [next(r["prefill_tok_s"] for r in meds if r["engine"] == e and r["prompt_tokens"] == n) for n in lengths]
            ax.bar(np.arange(len(lengths)) + i * w, vals, w, label=e)
        ax.set_xticks(np.arange(len(lengths)) + 0.4 - w / 2)
        ax.set_xticklabels([f"prefill {n}" for n in lengths])
        ax.set_ylabel("tokens/s (median of alternated rounds)")
        ax.set_title(f"{model}: int8 VNNI GEMM prefill (load ~{meds[0]['load_avg_1m']})")
        ax.legend()


if __name__ == "__main__":
    main()
