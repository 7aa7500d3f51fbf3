"""Whole-model A/B of the VNNI int4 GEMV configuration: decode tokens/s of one model compiled twice,
the baseline with ``PERFX_VNNI_GEMV_BASE=1`` (gemv_qvnni_cpu before its ``split`` / ``hinib`` knobs)
and the current default, timed in alternating rounds in one process (the machine is shared: the
median of the rounds is reported, with the 1-minute load average of each round).

Both artifacts are checked to produce the same greedy tokens (the two kernels differ only in float
summation order, so a rare tie could differ: the number of matching tokens is recorded).

    python benchmarks/gemv_qvnni_decode_ab.py MODEL.gguf --name smollm2-q4_1 [--rounds 7] [--tokens 32]
        [--artifacts BASE_DIR NEW_DIR]

Writes benchmarks/results/gemv_qvnni_decode_ab_<name>.csv and .png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import figure, write_csv

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def _compile(model: str, out: Path, base: bool) -> Path:
    env = {**os.environ, "PERFX_VNNI_GEMV_BASE": "1" if base else "0"}
    subprocess.run(["perfx-compile", model, "-o", str(out), "--max-context", "1024", "--quiet"], env=env, check=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a .gguf file (Q4_0 / Q4_1 weights)")
    ap.add_argument("--name", required=True, help="label of the CSV / plot")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=32, help="greedy decode tokens per round")
    ap.add_argument("--artifacts", nargs=2, default=None, metavar=("BASE_DIR", "NEW_DIR"))
    args = ap.parse_args(argv)

    if args.artifacts:
        arts = {"base": Path(args.artifacts[0]), "new": Path(args.artifacts[1])}
    else:
        tmp = Path(tempfile.mkdtemp(prefix="perfx-gemv-ab-"))
        arts = {k: _compile(args.model, tmp / k, k == "base") for k in ("base", "new")}
    sys.path.insert(0, str(REPO))
    from perfx_compiler.runtime.engine import Engine

    engines = {k: Engine(p) for k, p in arts.items()}
    tps: dict[str, list[float]] = {k: [] for k in arts}
    toks: dict[str, list[int]] = {}
    loads: list[float] = []
    for r in range(args.rounds):
        for k in (list(arts) if r % 2 == 0 else list(reversed(list(arts)))):
            eng = engines[k]
            eng.reset()
            tok = int(np.argmax(eng.prefill([1, 2, 3, 4, 5, 6, 7, 8])[0]))
            seq = [tok]
            t0 = time.perf_counter()
            for _ in range(args.tokens):
                tok = int(np.argmax(eng.decode(tok)))
                seq.append(tok)
            tps[k].append(args.tokens / (time.perf_counter() - t0))
            toks.setdefault(k, seq)
        loads.append(os.getloadavg()[0])
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in tps.items())
              + f" (load {loads[-1]:.1f})", flush=True)
    same = sum(a == b for a, b in zip(toks["base"], toks["new"], strict=True))
    med = {k: statistics.median(v) for k, v in tps.items()}
    rows = [{"model": args.name, "variant": k, "decode_tok_s_median": round(med[k], 2),
             "rounds": " ".join(f"{x:.2f}" for x in v), "speedup_vs_base": round(med[k] / med["base"], 3),
             "same_greedy_tokens": f"{same}/{len(toks['base'])}", "tokens_per_round": args.tokens,
             "load_avg_1m_median": round(statistics.median(loads), 1),
             "tvm_threads": os.environ.get("TVM_NUM_THREADS", "")} for k, v in tps.items()]
    out = write_csv(RESULTS / f"gemv_qvnni_decode_ab_{args.name}.csv", rows)
    _plot(tps, out.with_suffix(".png"), args.name, statistics.median(loads))
    for row in rows:
        print(row)
    print(f"wrote {out}")
    return 0


def _plot(tps: dict[str, list[float]], path: Path, name: str, load: float) -> None:
    with figure(path, figsize=(6, 3.5)) as (fig, ax):
        for i, v in enumerate(tps.values()):
            ax.scatter([i] * len(v), v, alpha=0.5)
            ax.hlines(statistics.median(v), i - 0.3, i + 0.3, color="k")
        ax.set_xticks(range(len(tps)))
        ax.set_xticklabels(["gemv_qvnni base (split=1, hinib=0)", "gemv_qvnni new (default)"], fontsize=8)
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"{name}: decode, alternated rounds (median line), load ~{load:.0f}", fontsize=9)


if __name__ == "__main__":
    raise SystemExit(main())
