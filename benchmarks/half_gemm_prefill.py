"""Half-weight (f16 / bf16) linears on this CPU: the compile-time half panels read by
``gemm_half_cpu`` against the path they replace, per SmolLM2 linear shape and row count M.

    python benchmarks/half_gemm_prefill.py [--rounds 7] [--families bf16,f16]

* M > 1 (prefill): before, each call dequantized W into fp32 panels (``gemv_half_cpu``'s dequant
  kernel, 4 N K bytes written) and ran the fp32 packed GEMM (``gemm_cpu``); now one kernel
  (``gemm_half_cpu``) reads the half panels and widens them in registers.
* M = 1 (decode): before, ``gemv_half_cpu``'s row GEMV on W [N, K]; now ``gemm_half_cpu`` with
  mr = 1 on the same half panels (the weight is stored once, in panels).

Template default configurations on both sides (no tuning records). Passes are alternated (old,
new, old, new, ...) so background load on the shared machine hits both alike; per pass the
fastest of a few calls, then the median over passes. The 1-minute load average is recorded per
row. Results: benchmarks/results/half_gemm_prefill.csv and .png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from _common import write_csv

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results"
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
ROWS = (1, 16, 64, 256)


def _scheduled(template, func, target):
    wl = template.match(func, target)
    if wl is None:
        raise SystemExit(f"{template.name} does not match {func}")
    return template.apply(func, wl, template.default_config(wl, target), target)


def _fp32_panel_matmul(x_shape, n, k, nb):
    from tvm import te, tirx

    i64 = lambda d: tirx.IntImm("int64", d) if isinstance(d, int) else d  # noqa: E731
    x = te.placeholder([i64(d) for d in x_shape], "float32", name="x")
    w = te.placeholder((i64(n // nb), i64(k), i64(nb)), "float32", name="w")
    r = te.reduce_axis((i64(0), i64(k)), name="k")
    y = te.compute((x.shape[0], x.shape[1], i64(n)), lambda b, i, j: te.sum(x[b, i, r] * w[j // nb, r, j % nb], axis=r),
                   name="NT_matmul")
    return te.create_prim_func([x, w, y])


def build(family: str, n: int, k: int, target) -> dict:
    """The kernels of both paths for one shape: callables taking (x) and writing y."""
    import tvm
    from tvm import tirx

    from perfx_compiler.passes._half import half_compute, to_half
    from perfx_compiler.passes._half_panels import half_panel_matmul
    from perfx_compiler.passes.weight_layout import pack_weight, packed_dequant
    from perfx_compiler.tune.measure import build_func
    from schedules import gemm_cpu, gemm_half_cpu, gemv_half_cpu
    from schedules._matmul import panel_width

    nb = panel_width(target)
    rng = np.random.default_rng(0)
    h = to_half(rng.standard_normal((n, k)).astype(np.float32) * 0.05, family)
    dev = tvm.cpu()
    w_rows = tvm.runtime.tensor(h, dev)
    w_panels = tvm.runtime.tensor(pack_weight(h, nb), dev)
    w_f32 = tvm.runtime.tensor(np.zeros((n // nb, k, nb), np.float32), dev)
    m = tirx.Var("m", "int64")
    fns = {
        "dequant": build_func(_scheduled(gemv_half_cpu.TEMPLATE, packed_dequant(half_compute(n, k, family, "dequant", (None, None)), nb), target), target),
        "gemm_f32": build_func(_scheduled(gemm_cpu.TEMPLATE, _fp32_panel_matmul([1, m, k], n, k, nb), target), target),
        "gemm_half": build_func(_scheduled(gemm_half_cpu.TEMPLATE, half_panel_matmul([1, m, k], n, k, nb, family), target), target),
        "gemv_rows": build_func(_scheduled(gemv_half_cpu.TEMPLATE, half_compute(n, k, family, "matmul", (1, 1)), target), target),
        "gemv_panels": build_func(_scheduled(gemm_half_cpu.TEMPLATE, half_panel_matmul([1, 1, k], n, k, nb, family), target), target),
    }
    return {"fns": fns, "w_rows": w_rows, "w_panels": w_panels, "w_f32": w_f32, "dev": dev}


def call_old(b: dict, x, y) -> None:
    f = b["fns"]
    if x.shape[1] == 1:
        f["gemv_rows"]["main"](x, b["w_rows"], y)
    else:
        f["dequant"]["main"](b["w_rows"], b["w_f32"])
        f["gemm_f32"]["main"](x, b["w_f32"], y)


def call_new(b: dict, x, y) -> None:
    f = b["fns"]
    (f["gemv_panels"] if x.shape[1] == 1 else f["gemm_half"])["main"](x, b["w_panels"], y)


def best_of(fn, b, x, y, calls: int) -> float:
    fn(b, x, y)  # warm
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(b, x, y)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--families", default="bf16,f16")
    p.add_argument("--out", default=str(RESULTS / "half_gemm_prefill.csv"))
    args = p.parse_args()
    import tvm

    from perfx_compiler.targets import load_target

    target = load_target("host")
    rows = []
    for family in args.families.split(","):
        for name, (n, k) in SHAPES.items():
            b = build(family, n, k, target)
            for M in ROWS:
                x = tvm.runtime.tensor(np.random.default_rng(1).standard_normal((1, M, k)).astype(np.float32), b["dev"])
                y = tvm.runtime.tensor(np.zeros((1, M, n), np.float32), b["dev"])
                y2 = tvm.runtime.tensor(np.zeros((1, M, n), np.float32), b["dev"])
                call_old(b, x, y)
                call_new(b, x, y2)
                diff = float(np.abs(y.numpy() - y2.numpy()).max() / max(1e-30, np.abs(y.numpy()).max()))
                calls = 3 if M >= 64 else 10
                old_t, new_t = [], []
                for _ in range(args.rounds):
                    old_t.append(best_of(call_old, b, x, y, calls))
                    new_t.append(best_of(call_new, b, x, y2, calls))
                o, nw = statistics.median(old_t), statistics.median(new_t)
                row = {"family": family, "linear": name, "N": n, "K": k, "M": M,
                       "old_path": "gemv_half_cpu rows" if M == 1 else "dequant fp32 panels + gemm_cpu",
                       "old_us": round(o * 1e6, 1), "new_us": round(nw * 1e6, 1), "speedup": round(o / nw, 2),
                       "new_GFLOPs": round(2 * M * n * k / nw / 1e9, 1), "max_rel_diff": f"{diff:.1e}",
                       "load1": round(os.getloadavg()[0], 2), "rounds": args.rounds}
                rows.append(row)
                print(row, flush=True)
    out = write_csv(args.out, rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fams = args.families.split(",")
        fig, axes = plt.subplots(1, len(fams), figsize=(6 * len(fams), 4), squeeze=False)
        for ax, fam in zip(axes[0], fams, strict=True):
            for name in SHAPES:
                sel = [r for r in rows if r["family"] == fam and r["linear"] == name]
                ax.plot([r["M"] for r in sel], [r["speedup"] for r in sel], marker="o", label=name)
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("rows M (1 = decode GEMV)")
            ax.set_ylabel("speed-up of half panels (old time / new time)")
            ax.set_title(f"{fam} weights: gemm_half_cpu vs previous path")
            ax.legend()
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=110)
    except ImportError:
        pass
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
