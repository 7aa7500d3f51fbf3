"""SmolLM2-135M (GGUF Q4_1, f32 activations) batched decode with the int4 GEMV unpacking each
weight once for all rows of the batch (``once``, the default) vs once per row (``per_row``:
``PERFX_GEMV_UNPACK_ONCE=0`` at compile time): same outputs, and decode tokens/s.

Both artifacts are compiled with batching=True. Correctness (each artifact, in a child process):
5 sequences prefilled with fixed random prompts, 6 batched decode steps at changing batch sizes
(5, 2..4); every sequence's logits must equal the single-sequence Engine's on the same artifact
(whose decode is the unchanged one-row kernel) within 2e-5 relative, and the two artifacts' batched
logits must agree within 2e-5. Throughput: ``bench_batched_decode.measure`` (prefill 16 tokens
per sequence, 3 warm-up steps, ``--steps`` timed steps), variants alternated round by round, each
row with the 1-minute load average (shared machine). Writes
benchmarks/results/batched_decode_unpack.csv and .png (median over rounds).

    python benchmarks/batched_decode_unpack_ab.py [--batches 1 4 8] [--rounds 3] [--steps 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
from _common import REPO, RESULTS, figure, write_csv

BUILD = REPO / "build" / "bench-unpack-once"
VARIANTS = {"once": "1", "per_row": "0"}  # PERFX_GEMV_UNPACK_ONCE at compile time


def compile_variant(name: str, model: str) -> Path:
    out = BUILD / f"smollm2-q4_1-f32-{name}"
    if not (out / "model.so").exists():
        env = {**os.environ, "PERFX_GEMV_UNPACK_ONCE": VARIANTS[name]}
        code = ("import sys; from perfx_compiler.pipeline import compile_model; compile_model(sys.argv[1], 'host', "
                "sys.argv[2], progress=False, batching=True, activations='f32')")
        subprocess.run([sys.executable, "-c", code, model, str(out)], env=env, check=True)
    return out


def batched_logits(artifact: Path, out: Path) -> float:
    """Writes the batched decode's logits to ``out`` (.npy); returns the largest relative error
    against the single-sequence Engine on the same artifact."""
    from perfx_compiler.runtime.batch_engine import BatchEngine
    from perfx_compiler.runtime.engine import Engine

    rng = np.random.default_rng(7)
    prompts = [5, 11, 17, 23, 9]
    steps = 6
    seqs = [rng.integers(0, 1000, n + steps) for n in prompts]
    eng = BatchEngine(artifact, max_batch=8)
    ids = [eng.add_sequence() for _ in prompts]
    got: list[list[np.ndarray]] = [[np.array(eng.prefill(i, s[:n])).reshape(-1)]
                                   for i, s, n in zip(ids, seqs, prompts, strict=True)]
    for t in range(steps):
        active = ids if t % 2 == 0 else ids[: 2 + t % 3]
        toks = [int(seqs[ids.index(i)][prompts[ids.index(i)] + len(got[ids.index(i)]) - 1]) for i in active]
        logits = eng.decode(active, toks)
        for r, i in enumerate(active):
            got[ids.index(i)].append(np.array(logits[r]).reshape(-1))
    single = Engine(artifact)
    worst = 0.0
    for r, n in enumerate(prompts):
        single.reset()
        want = [np.array(single.prefill(seqs[r][:n].tolist())).reshape(-1)]
        for tok in seqs[r][n : n + len(got[r]) - 1]:
            want.append(np.array(single.decode(int(tok))).reshape(-1))
        g, w = np.stack(got[r]), np.stack(want)
        worst = max(worst, float((np.abs(g - w).max(axis=1) / np.abs(w).max()).max()))
    np.save(out, np.concatenate([np.stack(g) for g in got]))
    return worst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--child", nargs=3, metavar=("MODE", "ARTIFACT", "ARG"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        mode, art, arg = args.child
        if mode == "check":
            print(json.dumps({"err": batched_logits(Path(art), Path(arg))}))
        else:
            from bench_batched_decode import measure

            print(json.dumps({"tok_s": measure(Path(art), int(arg), args.steps)}))
        return 0
    arts = {name: compile_variant(name, args.model) for name in VARIANTS}

    def child(*a: str) -> dict:
        res = subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--child", *a],
                             capture_output=True, text=True, check=True)
        return json.loads(res.stdout.strip().splitlines()[-1])

    logits, checks = {}, {}
    for name, art in arts.items():
        npy = BUILD / f"logits-{name}.npy"
        checks[name] = child("check", str(art), str(npy))["err"]
        logits[name] = np.load(npy)
        print(f"{name}: batched vs single-sequence max rel err {checks[name]:.2e}", flush=True)
    cross = float(np.abs(logits["once"] - logits["per_row"]).max() / np.abs(logits["per_row"]).max())
    print(f"once vs per_row batched logits: max rel err {cross:.2e}", flush=True)
    assert max(checks.values()) < 2e-5 and cross < 2e-5, (checks, cross)

    rows = []
    for rnd in range(args.rounds):
        for batch in args.batches:
            order = list(VARIANTS) if rnd % 2 == 0 else list(reversed(VARIANTS))
            for name in order:
                tok_s = child("measure", str(arts[name]), str(batch))["tok_s"]
                row = {"variant": name, "batch": batch, "round": rnd, "decode_tok_s": round(tok_s, 2),
                       "load_1m": round(os.getloadavg()[0], 2), "steps": args.steps,
                       "max_rel_err_vs_single": f"{checks[name]:.2e}", "rel_err_once_vs_per_row": f"{cross:.2e}",
                       "model": "SmolLM2-135M-Instruct Q4_1 (gguf), f32 activations"}
                rows.append(row)
                print(row, flush=True)
    out = RESULTS / "batched_decode_unpack.csv"
    write_csv(out, rows)
    with figure(out.with_suffix(".png"), figsize=(6, 4)) as (_, ax):
        width = 0.38
        for k, name in enumerate(VARIANTS):
            med = [statistics.median(r["decode_tok_s"] for r in rows if r["variant"] == name and r["batch"] == b)
                   for b in args.batches]
            ax.bar([i + (k - 0.5) * width for i in range(len(args.batches))], med, width, label=name)
        load = statistics.median(r["load_1m"] for r in rows)
        ax.set_xticks(range(len(args.batches)), [f"batch {b}" for b in args.batches])
        ax.set_ylabel("decode tokens/s (median of rounds)")
        ax.set_title(f"paged_decode SmolLM2 Q4_1 f32: int4 GEMV unpack once vs per row (load ~{load:.1f})", fontsize=8)
        ax.legend()
    for b in args.batches:
        med = {n: statistics.median(r["decode_tok_s"] for r in rows if r["variant"] == n and r["batch"] == b)
               for n in VARIANTS}
        # paired per round (the two variants ran back to back): robust to the load drifting between rounds
        ratios = [next(r["decode_tok_s"] for r in rows if r["variant"] == "once" and r["batch"] == b and r["round"] == k)
                  / next(r["decode_tok_s"] for r in rows if r["variant"] == "per_row" and r["batch"] == b
                         and r["round"] == k) for k in range(args.rounds)]
        gm = float(np.exp(np.mean(np.log(ratios))))
        print(f"batch {b}: " + ", ".join(f"{n} {v:.1f} tok/s" for n, v in med.items())
              + f"; once/per_row per round {[round(x, 2) for x in ratios]} (geomean {gm:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
