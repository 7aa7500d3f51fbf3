"""Decode and prefill speed of half-precision weights (``--quantization f16 | bf16``) and bf16
matmul inputs (``--precision bf16``) against f32, for one model on this CPU.

    python benchmarks/half_precision.py [--model smollm2-135m] [--rounds 5] [--steps 64]

Each variant is compiled once (artifacts cached under --work). Rounds are interleaved (A B C D A B
...) so background load on a shared machine hits every variant alike; the table reports the median
and best round, with the 1-minute load average next to each round (rounds are kept, not filtered).
Results: benchmarks/results/half_precision.csv (summary), half_precision_rounds.csv, half_precision.png.

    python benchmarks/half_precision.py --kernels

times the decode GEMVs alone (SmolLM2's linear shapes, f32 ``gemv_cpu`` vs ``gemv_half_cpu`` with
its default configs), fastest single call over interleaved passes: less sensitive to a loaded
machine than whole-model rounds. Results: benchmarks/results/half_precision_kernels.csv.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from _common import RESULTS, figure, prefill_decode_rates, write_csv

PROMPT_IDS = [9, 1432, 2115, 253, 655, 28, 665, 436, 253, 1347, 2214, 30, 4, 17, 1, 900] * 4  # 64 ids
VARIANTS: dict[str, dict[str, str]] = {
    "f32": {"quantization": "f32"},
    "bf16": {"quantization": "bf16"},
    "f16": {"quantization": "f16"},
    "bf16_act": {"quantization": "bf16", "precision": "bf16"},
}


def compile_if_needed(model: str, name: str, work: Path) -> Path:
    from perfx_compiler.pipeline import compile_model

    out = work / f"{Path(model).name}-{name}"
    if not (out / "perfx-config.json").is_file():
        compile_model(model, "host", out, progress=False, batching=False, **VARIANTS[name])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--work", type=Path, default=Path("/tmp/perfx-bench-half"))
    ap.add_argument("--kernels", action="store_true", help="time the decode GEMVs alone instead")
    args = ap.parse_args()
    if args.kernels:
        kernels(args.rounds)
        return

    import tvm  # noqa: F401 - the full library first: the engine alone would load only the runtime

    from perfx_compiler.runtime.engine import Engine

    arts = {v: compile_if_needed(args.model, v, args.work) for v in args.variants}
    engines = {v: Engine(a) for v, a in arts.items()}
    for e in engines.values():
        prefill_decode_rates(e, PROMPT_IDS, 4)  # warm up (thread pool, page cache)
    rounds = []
    for r in range(args.rounds):
        for v, e in engines.items():
            load = os.getloadavg()[0]
            pre, dec = prefill_decode_rates(e, PROMPT_IDS, args.steps)
            rounds.append({"round": r, "variant": v, "prefill_tok_s": round(pre, 1), "decode_tok_s": round(dec, 1),
                           "load1": round(load, 2)})
            print(rounds[-1], flush=True)

    write_csv(RESULTS / "half_precision_rounds.csv", rounds)
    summary = []
    for v, a in arts.items():
        m = json.loads((a / "perfx-config.json").read_text())
        mine = [x for x in rounds if x["variant"] == v]
        dec = [x["decode_tok_s"] for x in mine]
        pre = [x["prefill_tok_s"] for x in mine]
        summary.append({
            "model": args.model, "variant": v, "quantization": m["quantization"], "precision": m.get("precision", "f32"),
            "weight_bytes": m["weight_bytes"], "bytes_per_param": round(m["weight_bytes"] / m["parameters"], 4),
            "decode_tok_s_median": round(statistics.median(dec), 1), "decode_tok_s_best": max(dec),
            "prefill64_tok_s_median": round(statistics.median(pre), 1), "prefill64_tok_s_best": max(pre),
            "rounds": len(mine), "load1_median": round(statistics.median(x["load1"] for x in mine), 2),
            "cpu_cores": os.cpu_count(),
        })
    write_csv(RESULTS / "half_precision.csv", summary)
    for s in summary:
        print(s)
    _plot(summary)


KERNEL_SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                 "lm_head": (49152, 576)}


def kernels(passes: int) -> None:
    import numpy as np
    import tvm

    from perfx_compiler.passes._half import half_compute, to_half
    from perfx_compiler.targets import load_target
    from perfx_compiler.tune.measure import build_func, configure_threads
    from schedules.gemv_cpu import TEMPLATE as F32
    from schedules.gemv_half_cpu import TEMPLATE as HALF

    tgt = load_target("host")
    configure_threads(max(1, tgt.cores or 1))
    dev = tvm.cpu()
    rows = []
    for label, (n, k) in KERNEL_SHAPES.items():
        f32 = _f32_gemv(n, k)
        wl = F32.match(f32, tgt)
        ws = np.random.default_rng().standard_normal((n, k)).astype(np.float32)
        xs = tvm.runtime.tensor(np.random.default_rng().standard_normal((1, 1, k)).astype(np.float32), dev)
        out = tvm.runtime.tensor(np.zeros((1, 1, n), np.float32), dev)
        runs = {"f32": (build_func(F32.apply(f32, wl, F32.default_config(wl, tgt), tgt), tgt),
                        tvm.runtime.tensor(ws, dev), 4)}
        for fam, act in (("bf16", "f32"), ("f16", "f32"), ("bf16", "bf16")):
            hf = half_compute(n, k, fam, "matmul", (1, 1), act)
            hw = HALF.match(hf, tgt)
            runs[f"{fam}_w" + ("" if act == "f32" else "_act")] = (
                build_func(HALF.apply(hf, hw, HALF.default_config(hw, tgt), tgt), tgt),
                tvm.runtime.tensor(to_half(ws, fam), dev), 2)
        best = {v: float("inf") for v in runs}
        for _ in range(passes):  # interleaved: A B C D A B C D ...
            for v, (rt, wt, _) in runs.items():
                timer = rt.time_evaluator("main", dev, number=1, repeat=20)
                best[v] = min(best[v], min(timer(xs, wt, out).results))
        for v, (_, _, nbytes) in runs.items():
            rows.append({"linear": label, "N": n, "K": k, "variant": v, "best_us": round(best[v] * 1e6, 1),
                         "weight_GB_s": round(n * k * nbytes / best[v] / 1e9, 1),
                         "speedup_vs_f32": round(best["f32"] / best[v], 2), "load1": round(os.getloadavg()[0], 2)})
            print(rows[-1], flush=True)
    write_csv(RESULTS / "half_precision_kernels.csv", rows)


def _f32_gemv(n: int, k: int) -> object:
    """The float linear as the pipeline lowers it: y[0, 0, n] = sum_k x[0, 0, k] * W[n, k]."""
    from tvm import te

    x = te.placeholder((1, 1, k), "float32", name="x")
    w = te.placeholder((n, k), "float32", name="w")
    r = te.reduce_axis((0, k), "k")
    y = te.compute((1, 1, n), lambda b, i, j: te.sum(x[b, i, r] * w[j, r], axis=r), name="NT_matmul")
    return te.create_prim_func([x, w, y])


def _plot(summary: list[dict]) -> None:
    names = [s["variant"] for s in summary]
    with figure(RESULTS / "half_precision.png", 1, 2, figsize=(9, 3.5)) as (fig, ax):
        ax[0].bar(names, [s["decode_tok_s_median"] for s in summary], color="tab:blue")
        ax[0].set_title("decode tok/s (median of rounds)")
        ax[1].bar(names, [s["weight_bytes"] / 1e6 for s in summary], color="tab:gray")
        ax[1].set_title("weight MB")
        fig.suptitle(f"{summary[0]['model']}: half-precision weights (load avg {summary[0]['load1_median']})")


if __name__ == "__main__":
    main()
