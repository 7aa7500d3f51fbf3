"""``python benchmarks/kernels.py quantize``: quantizing float weights to Q4_K / Q5_K / Q6_K (``--quantization q4_k`` / ``q5_k`` /
``q6_k`` of a float model) against llama.cpp's own quantizer on the same weights.

Variants, each quantizing a whole random float32 matrix of TinyLlama-1.1B's shapes per call:
  perfx       ``formats/ggml/<type>.quantize``: the compiled searches of ``kernels/kquant_search.py``, rows
              in chunks on the machine's threads (what the compile runs)
  perfx_numpy the same with the numpy searches (the references the kernels are held to; ``--numpy-shapes``)
  ggml        ``ggml_quantize_chunk`` from llama-cpp-python's libggml, the rows split over as many threads
              (what ``llama_model_quantize`` does, without an importance matrix)
Variants alternate per round; the reported time is the median over rounds, ratio = ggml / perfx (> 1: PerfX
faster). Every variant's blocks are compared byte for byte with ggml's (``identical_blocks``: the share of
256-weight superblocks equal). Writes benchmarks/results/<machine>/kernels_quantize.csv and .png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from _common import RESULTS, alternated, figure, write_csv
from _kernels_ggml import TINYLLAMA

QUANT_TYPES = ("Q4_K", "Q5_K", "Q6_K")


def _ggml_quantizer(qtype: str, w: np.ndarray, threads: int) -> tuple[Callable[[], None], np.ndarray]:
    """A call quantizing ``w`` with ggml's quantize_chunk on ``threads`` row ranges, and its output buffer."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from perfx_compiler.bench.ggml_mul_mat import ggml

    fn = ggml().quantize_chunk
    qt = GGMLQuantizationType[qtype]
    block, nbytes = GGML_QUANT_SIZES[qt]
    n, k = w.shape
    out = np.zeros((n, k // block * nbytes), np.uint8)
    step = -(-n // threads)
    ranges = [(r, min(step, n - r)) for r in range(0, n, step)]

    def part(r_rows: tuple[int, int]) -> None:
        r, rows = r_rows
        fn(int(qt), w[r:].ctypes.data, out[r:].ctypes.data, 0, rows, k, None)

    pool = ThreadPoolExecutor(threads)
    weakref.finalize(out, pool.shutdown)  # the pool goes with the case's output buffer

    def call() -> None:
        list(pool.map(part, ranges))  # ctypes drops the GIL: the row ranges run side by side

    return call, out


def _perfx_quantizer(qtype: str, w: np.ndarray, numpy_search: bool) -> tuple[Callable[[], None], list[np.ndarray]]:
    import importlib

    mod = importlib.import_module(f"perfx_compiler.formats.ggml.{qtype.lower()}")
    result: list[np.ndarray] = []

    def call() -> None:  # numpy_search: the module's numpy references; else the kernel where it can run
        result[:] = [mod.quantize(w, compiled=False if numpy_search else None)]

    return call, result


def quantize_main(args: argparse.Namespace) -> int:
    """``quantize``: PerfX's K-quant quantizers against ggml's (module docstring)."""
    from perfx_compiler.bench import ggml_mul_mat as _ggml
    from perfx_compiler.formats.ggml import q4_k
    from perfx_compiler.kernels import kquant_search

    threads = q4_k.THREADS
    rng = np.random.default_rng(0)
    numpy_shapes = set(filter(None, args.numpy_shapes.split(",")))
    shapes, types = args.shapes.split(","), args.types.split(",")
    for what, names, known in (("shape", shapes + sorted(numpy_shapes), TINYLLAMA), ("type", types, QUANT_TYPES)):
        unknown = [n for n in names if n not in known]
        if unknown:
            raise SystemExit(f"kernels.py quantize: unknown {what} {', '.join(unknown)}; known: {', '.join(known)}")
    rows_out: list[dict[str, Any]] = []
    for qtype in types:
        for shape in shapes:
            n, k = TINYLLAMA[shape]
            w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
            ggml_call, ggml_out = _ggml_quantizer(qtype, w, threads)
            calls: dict[str, tuple[Callable[[], None], Callable[[], np.ndarray]]] = {
                "ggml": (ggml_call, lambda out=ggml_out: out)}
            variants = [("perfx", False)] + ([("perfx_numpy", True)] if shape in numpy_shapes else [])
            for name, numpy_search in variants:
                call, res = _perfx_quantizer(qtype, w, numpy_search)
                calls[name] = (call, lambda res=res: res[0])
            for call, _ in calls.values():  # warm: the kernels' first use builds them (once a process)
                call()
            samples: dict[str, list[float]] = {name: [] for name in calls}
            for r in range(args.rounds):
                for name in alternated(list(calls), r):
                    t0 = time.perf_counter()
                    calls[name][0]()
                    samples[name].append(time.perf_counter() - t0)
            sb_bytes = ggml_out.shape[1] // (k // 256)
            want = ggml_out.reshape(n, k // 256, sb_bytes)
            row: dict[str, Any] = {"type": qtype, "shape": f"{shape} {n}x{k}", "N": n, "K": k}
            for name in calls:
                sec = statistics.median(samples[name])
                same = (calls[name][1]().reshape(n, k // 256, sb_bytes) == want).all(axis=-1).mean()
                row |= {f"{name}_ms": sec * 1e3, f"{name}_Mweights_s": n * k / sec / 1e6,
                        f"{name}_identical_blocks": float(same)}
            row["ratio"] = statistics.median(a / b for a, b in zip(samples["ggml"], samples["perfx"], strict=True))
            if "perfx_numpy_ms" in row:
                row["compiled_speedup"] = row["perfx_numpy_ms"] / row["perfx_ms"]
            row |= {"compiled": kquant_search.compiled(), "threads": threads, "rounds": args.rounds,
                    "ggml_features": _ggml.features(), "load_avg_1m": os.getloadavg()[0]}
            rows_out.append(row)
            print(f"{qtype} {shape:>8} {n}x{k}: perfx {row['perfx_ms']:8.1f} ms | ggml {row['ggml_ms']:8.1f} ms | "
                  f"{row['ratio']:.2f}x | identical blocks {row['perfx_identical_blocks']:.4f}"
                  + (f" | numpy search {row['perfx_numpy_ms']:.0f} ms" if "perfx_numpy_ms" in row else ""), flush=True)
    out = Path(args.out) if args.out else RESULTS / _ggml.machine_name() / "kernels_quantize.csv"
    write_csv(out, rows_out, columns=list(dict.fromkeys(c for r in rows_out for c in r)), floats=".4g")
    _plot(rows_out, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    with figure(path, figsize=(9, 4)) as (_fig, ax):
        x = np.arange(len(rows))
        names = [n for n in ("perfx", "ggml", "perfx_numpy") if any(f"{n}_Mweights_s" in r for r in rows)]
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            ax.bar(x + (i - (len(names) - 1) / 2) * width, [r.get(f"{name}_Mweights_s", 0) for r in rows], width,
                   label=name)
        ax.set_xticks(x)
        ax.set_xticklabels([f"{r['type']}\n{r['shape']}" for r in rows], fontsize=8)
        ax.set_ylabel("million weights quantized / s")
        ax.set_title(f"K-quant quantization of float weights, {rows[0]['threads']} threads")
        ax.legend(fontsize=8)


def add_parser(sub: Any) -> None:
    q = sub.add_parser("quantize", help="float -> Q4_K / Q5_K / Q6_K quantization: PerfX vs llama.cpp's quantizer")
    q.add_argument("--types", default=",".join(QUANT_TYPES))
    q.add_argument("--shapes", default="attn,gate_up,lm_head", help="subset of " + ",".join(TINYLLAMA))
    q.add_argument("--numpy-shapes", default="attn", help="shapes that also time the numpy searches ('' for none)")
    q.add_argument("--rounds", type=int, default=3)
    q.add_argument("--out", default=None, help="default: results/<machine>/kernels_quantize.csv")

