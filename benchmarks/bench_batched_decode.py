"""Batched decode throughput of ``paged_decode`` (BatchEngine.decode) before/after the batched
quantized GEMV: SmolLM2-135M GGUF Q4_1, host target, f32 activations (``--activations int8``:
the VNNI GEMM over the batch vs ``PERFX_VNNI_GEMM=0``'s dequantize + GEMM, written to
batched_decode_int8.csv/.png).

Two artifacts are compiled (batching=True): ``gemv`` (default: paged_decode's int4/int8 linears call
the quantized GEMV over the symbolic batch) and ``dequant`` (``PERFX_BATCH_GEMV=0``: each linear
dequantizes W to fp32 every step, then the float GEMM). A process loads one model.so, so each
measurement runs in a subprocess; the variants alternate round by round (A/B/A/B...) and every
row records the 1-minute load average, since the machine is shared.
Per (variant, batch): prefill ``batch`` sequences of 16 tokens, 3 warm-up steps, then ``--steps``
timed decode steps; tokens/s = batch * steps / time. Writes
benchmarks/results/batched_decode.csv and .png (median over rounds).

    python benchmarks/bench_batched_decode.py [--batches 1 4 8] [--rounds 3] [--steps 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import figure, write_csv

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "build" / "bench-batched-decode"
OUT = REPO / "benchmarks" / "results" / "batched_decode.csv"
VARIANTS = {"gemv": "1", "dequant": "0"}  # PERFX_BATCH_GEMV (f32) / PERFX_VNNI_GEMM (int8)
SWITCH = {"f32": "PERFX_BATCH_GEMV", "int8": "PERFX_VNNI_GEMM"}


def compile_variant(name: str, model: str, act: str) -> Path:
    out = BUILD / f"smollm2-q4_1-{act}-{name}"
    if not (out / "model.so").exists():
        env = {**os.environ, SWITCH[act]: VARIANTS[name]}
        code = ("import sys; from perfx_compiler.pipeline import compile_model; compile_model(sys.argv[1], 'host', "
                "sys.argv[2], progress=False, batching=True, activations=sys.argv[3])")
        subprocess.run([sys.executable, "-c", code, model, str(out), act], env=env, check=True)
    return out


def measure(artifact: Path, batch: int, steps: int) -> float:
    """Decode tokens/s of one batch size (run in a child process)."""
    import numpy as np

    from perfx_compiler.runtime.batch_engine import BatchEngine

    eng = BatchEngine(artifact, max_batch=max(batch, 1))
    rng = np.random.default_rng(0)
    ids = [eng.add_sequence() for _ in range(batch)]
    for i in ids:
        eng.prefill(i, rng.integers(0, 1000, 16).tolist())
    toks = rng.integers(0, 1000, batch).tolist()
    for _ in range(3):
        eng.decode(ids, toks)
    t = time.perf_counter()
    for _ in range(steps):
        eng.decode(ids, toks)
    return batch * steps / (time.perf_counter() - t)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--activations", choices=["f32", "int8"], default="f32",
                   help="int8: gemv = the VNNI GEMM over the batch, dequant = PERFX_VNNI_GEMM=0")
    p.add_argument("--child", nargs=3, metavar=("ARTIFACT", "BATCH", "STEPS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps({"tok_s": measure(Path(args.child[0]), int(args.child[1]), int(args.child[2]))}))
        return 0
    arts = {name: compile_variant(name, args.model, args.activations) for name in VARIANTS}
    out = OUT if args.activations == "f32" else OUT.with_name(f"batched_decode_{args.activations}.csv")
    rows = []
    for rnd in range(args.rounds):
        for batch in args.batches:
            order = list(VARIANTS) if rnd % 2 == 0 else list(reversed(VARIANTS))
            for name in order:
                res = subprocess.run([sys.executable, __file__, "--child", str(arts[name]), str(batch), str(args.steps)],
                                     capture_output=True, text=True, check=True)
                tok_s = json.loads(res.stdout.strip().splitlines()[-1])["tok_s"]
                row = {"variant": name, "batch": batch, "round": rnd, "decode_tok_s": round(tok_s, 2),
                       "load_1m": round(os.getloadavg()[0], 2), "steps": args.steps, "activations": args.activations,
                       "model": "SmolLM2-135M-Instruct Q4_1 (gguf)"}
                rows.append(row)
                print(row, flush=True)
    write_csv(out, rows)
    plot(rows, args.batches, out)
    return 0


def plot(rows: list[dict], batches: list[int], out: Path) -> None:
    with figure(out.with_suffix(".png"), figsize=(6, 4)) as (fig, ax):
        width = 0.38
        for k, name in enumerate(VARIANTS):
            med = [statistics.median(r["decode_tok_s"] for r in rows if r["variant"] == name and r["batch"] == b)
                   for b in batches]
            ax.bar([i + (k - 0.5) * width for i in range(len(batches))], med, width, label=name)
        load = statistics.median(r["load_1m"] for r in rows)
        ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
        ax.set_ylabel("decode tokens/s (median of rounds)")
        ax.set_title(f"paged_decode, SmolLM2 Q4_1, {rows[0]['activations']} act. (load ~{load:.1f}, 2 shared cores)",
                     fontsize=9)
        ax.legend()


if __name__ == "__main__":
    sys.exit(main())
