"""``python benchmarks/kernels.py ggml``: PerfX's VNNI kernels against llama.cpp's ggml kernels on the same
GGUF blocks (what it measures and how: benchmarks/kernels.py's docstring)."""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from typing import Any

import numpy as np
from _common import L3_BYTES, RESULTS, figure, write_csv

from perfx_compiler.bench.machine import read_bandwidth
from perfx_compiler.targets import load_target
from perfx_compiler.tune.measure import configure_threads

# -- ggml: PerfX's VNNI kernels against llama.cpp's ggml kernels, same GGUF blocks --------------------

TINYLLAMA = {"attn": (2048, 2048), "kv": (256, 2048), "gate_up": (5632, 2048), "down": (2048, 5632),
             "lm_head": (32000, 2048)}  # TinyLlama-1.1B's linears: name -> (N, K)
GGML_QTYPES = ("Q4_K", "Q6_K", "Q5_K", "Q3_K", "Q2_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS")
INT8_TOL = 2e-2  # max |y - ref| / max |ref| for int8 activations (measured <= 1e-2); a wrong layout is O(1)


def ggml_main(args: argparse.Namespace) -> int:
    import gguf

    from perfx_compiler.bench import ggml_mul_mat as _ggml
    from perfx_compiler.tune.records import default_records

    target = load_target("host")
    threads = configure_threads(target.cores or os.cpu_count() or 1)
    db = None if args.default_configs else default_records(target.name)
    rounds, budget = (2, 0.05) if args.quick else (args.rounds, 0.25)
    rng = np.random.default_rng(0)
    rows_out: list[dict[str, Any]] = []
    l3 = max(L3_BYTES, _ggml.l3_bytes())  # decode rotates over 2x this of weight copies per variant
    for qtype in args.types.split(","):
        for shape in args.shapes.split(","):
            n, k = TINYLLAMA[shape]
            raw = _ggml.random_blocks(qtype, n, k, rng)
            w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float64)
            for m in (int(v) for v in args.rows.split(",")):
                x = rng.standard_normal((m, k)).astype(np.float32)
                ref = x.astype(np.float64) @ w.T
                copies = -(-2 * l3 // raw.nbytes) if m == 1 else 1  # decode: weights from DRAM
                bw = read_bandwidth(args.threads, 1 << 30, reps=2 if args.quick else 3)
                pk, rt, label = _ggml.perfx_kernel(qtype, raw, n, k, m, target, db)
                calls = {"perfx": _ggml.perfx_call(pk, rt, x, n, copies)}
                mms = {"ggml_plain": _ggml.MulMat(qtype, raw, n, k, m, copies, threads)}
                if _ggml.repacked(qtype) and n % 8 == 0:  # what llama.cpp loads these types as
                    mms["ggml_repack"] = _ggml.MulMat(qtype, raw, n, k, m, copies, threads, repack=True)
                for name, mm in mms.items():
                    mm.set_x(x)
                    calls[name] = (mm, mm.output)
                err = {}
                for name, (call, out) in calls.items():
                    call()
                    err[name] = float(np.abs(out() - ref).max() / np.abs(ref).max())
                    if not err[name] <= INT8_TOL:
                        raise SystemExit(f"{name} {qtype} {n}x{k} rows={m}: max error {err[name]:.2e} of max |y| "
                                         f"against float64 (tolerance {INT8_TOL})")
                samples: dict[str, list[float]] = {name: [] for name in calls}
                for r in range(rounds):
                    for name in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
                        samples[name].append(_ggml.burst(calls[name][0], budget))
                for mm in mms.values():
                    mm.close()
                sec = {name: statistics.median(v) for name, v in samples.items()}
                llama = "ggml_repack" if "ggml_repack" in sec else "ggml_plain"  # the kernel llama.cpp runs
                row = {"type": qtype, "shape": f"{shape} {n}x{k}", "N": n, "K": k, "rows": m,
                       "ggml_kernel": llama.removeprefix("ggml_"), "ggml_ms": sec[llama] * 1e3,
                       "ggml_plain_ms": sec["ggml_plain"] * 1e3, "perfx_ms": sec["perfx"] * 1e3,
                       "ratio": statistics.median(a / b for a, b in zip(samples[llama], samples["perfx"], strict=True)),
                       "ggml_GBps": raw.nbytes / sec[llama] / 1e9,
                       "perfx_GBps": pk.nbytes / sec["perfx"] / 1e9, "read_ceiling_GBps": bw,
                       "ggml_bytes": raw.nbytes, "perfx_bytes": pk.nbytes, "weight_copies": copies,
                       "ggml_err": err[llama], "perfx_err": err["perfx"], "perfx_config": label,
                       "ggml_features": _ggml.features(), "threads": threads, "rounds": rounds,
                       "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""), "load_avg_1m": os.getloadavg()[0]}
                rows_out.append(row)
                print(f"{qtype} {shape:>8} {n}x{k} rows={m:<4} ggml ({row['ggml_kernel']}) {row['ggml_ms']:8.3f} ms "
                      f"{row['ggml_GBps']:5.1f} GB/s | perfx {row['perfx_ms']:8.3f} ms {row['perfx_GBps']:5.1f} GB/s"
                      f" | {row['ratio']:.2f}x (ceiling {bw:.1f} GB/s, load {row['load_avg_1m']:.1f})", flush=True)
            del w
    out = Path(args.out) if args.out else RESULTS / _ggml.machine_name() / "kernels_vs_ggml.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.merge and out.exists():  # the cases not rerun stay as their own run measured them, in place
        import pandas as pd

        def case(r: dict[str, Any]) -> tuple[str, str, int]:
            return r["type"], r["shape"], int(r["rows"])

        merged = {case(r): r for r in pd.read_csv(out, keep_default_na=False).to_dict("records")}
        merged.update({case(r): r for r in rows_out})
        rows_out = list(merged.values())
    write_csv(out, rows_out, floats=".4g")
    ratios = [r["ratio"] for r in rows_out]
    print(f"PerfX vs ggml: median {statistics.median(ratios):.2f}x, min {min(ratios):.2f}x over {len(ratios)} cases; "
          f"{sum(r >= 1.0 for r in ratios)} at >= 1.0x")
    plot_ggml(rows_out, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def plot_ggml(rows: list[dict[str, Any]], path: Path) -> None:
    with figure(path, 2, 1, figsize=(max(10, len(rows) * 0.35), 8)) as (_fig, (ax1, ax2)):
        dec = [r for r in rows if r["rows"] == 1]
        x = np.arange(len(dec))
        ax1.bar(x - 0.2, [r["ggml_GBps"] for r in dec], 0.4, label="ggml (llama.cpp's kernel for the type)")
        ax1.bar(x + 0.2, [r["perfx_GBps"] for r in dec], 0.4, label="PerfX gemv_qvnni_cpu")
        if dec:
            ceil = statistics.median(r["read_ceiling_GBps"] for r in dec)
            ax1.axhline(ceil, color="k", ls="--", lw=1, label=f"read bandwidth {ceil:.1f} GB/s")
        ax1.set_xticks(x)
        ax1.set_xticklabels([f"{r['type']}\n{r['shape'].split()[0]}" for r in dec], fontsize=7)
        ax1.set_ylabel("GB/s of weights (decode, 1 row)")
        ax1.legend(fontsize=8)
        ax1.set_title("TinyLlama-1.1B linears on GGUF blocks: PerfX VNNI kernels vs ggml mul_mat (2 threads)")
        x = np.arange(len(rows))
        for m, color in ((1, "C0"), (0, "C2")):  # bars from 1.0 to the ratio: up where PerfX is faster
            sel = [i for i, r in enumerate(rows) if (r["rows"] == 1) == (m == 1)]
            ax2.bar(x[sel], [rows[i]["ratio"] - 1 for i in sel], 0.6, bottom=1, color=color,
                    label="decode (1 row)" if m else "prefill (512 rows)")
        ax2.axhline(1.0, color="k", lw=0.8)
        ax2.legend(fontsize=8)
        ax2.set_xticks(x)
        ax2.set_xticklabels([f"{r['type']}\n{r['shape'].split()[0]}\nM={r['rows']}" for r in rows], fontsize=6)
        ax2.set_ylabel("ggml time / PerfX time (>1: PerfX faster)")
