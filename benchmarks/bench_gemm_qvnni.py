"""Prefill linears with int8 activations: the VNNI GEMM (``schedules/gemm_qvnni_cpu.py``) against the
path it replaces, dequantize-to-panels + the packed float32 GEMM (the compile pipeline's kernels,
tuned records applied as in a build), on the prefill shapes of SmolLM2-135M (Q4_1, as shipped) and
TinyLlama-1.1B (Q4_0), plus SmolLM2's shapes in Q8_0.

Variants per case (alternated round by round, medians; the machine is shared, so the 1-minute load
average is recorded per row):

* ``f32_dequant_gemm``: dequantize (into [N/nb, K, nb] panels) + float GEMM, summed per round;
* ``int8_gemm``: the VNNI GEMM, default config (in-call repack of each block's weights);
* ``int8_gemm_mrX_nrY``: other register tilings;
* ``int8_gemm_prepacked``: the same GEMM on panels repacked at compile time (``prepack``), i.e. the
  cost of keeping one copy of the weights is the gap to ``int8_gemm``.

Also checks each int8 output against the float path on the same input (relative max error; int8
activations move it by ~1e-2, a broken kernel by ~1).

    python benchmarks/bench_gemm_qvnni.py [--rounds 5] [--m 128,512] [--only smollm2|tinyllama]
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from typing import Any

import numpy as np
from _common import RESULTS, figure, write_csv

# (model, format, K, N) of each prefill linear after merge_projections (q|k|v, gate|up merged)
CASES = [
    ("smollm2", "Q4_1", 576, 960), ("smollm2", "Q4_1", 576, 576), ("smollm2", "Q4_1", 576, 3072),
    ("smollm2", "Q4_1", 1536, 576),
    ("smollm2", "Q8_0", 576, 3072), ("smollm2", "Q8_0", 1536, 576),
    ("tinyllama", "Q4_0", 2048, 2560), ("tinyllama", "Q4_0", 2048, 2048), ("tinyllama", "Q4_0", 2048, 11264),
    ("tinyllama", "Q4_0", 5632, 2048),
]
INT8_CONFIGS = {"int8_gemm_mr6_nr2": {"mr": 6, "nr": 2}, "int8_gemm_mr4_nr1": {"mr": 4, "nr": 1},
                "int8_gemm_mr2_nr4": {"mr": 2, "nr": 4}}


def _packed(fmt: str, n: int, k: int, rng: np.random.Generator) -> Any:
    from perfx_compiler.passes._gguf_blocks import Q4_0, Q4_1
    from perfx_compiler.passes._quant8 import quantize_int8
    from perfx_compiler.passes._qvnni import q4_vnni_packed, q8_vnni_packed

    if fmt == "Q8_0":
        codes, scale = quantize_int8((rng.standard_normal((n, k)) * 0.05).astype(np.float32), 32)
        return q8_vnni_packed(codes, scale, 32)
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    d = (rng.random((n, k // 32)) * 0.01).astype(np.float16)
    if fmt == "Q4_1":
        return q4_vnni_packed(codes, d, (-rng.random((n, k // 32)) * 0.08).astype(np.float16), Q4_1)
    return q4_vnni_packed(codes, d, np.full((n, k // 32), 8, np.uint8), Q4_0)


def _timer(rt: Any, args: list[Any]) -> Any:
    import tvm

    ev = rt.time_evaluator("main", tvm.cpu(), number=1, repeat=3)
    return lambda: min(ev(*args).results)


def run_case(model: str, fmt: str, k: int, n: int, m: int, rounds: int, target: Any, records: Any) -> list[dict]:
    import tvm

    from perfx_compiler.passes.weight_layout import packed_dequant
    from perfx_compiler.schedule import schedule_func
    from perfx_compiler.tune.measure import build_func
    from perfx_compiler.tune.workloads import packed_linear_func
    from schedules._matmul import panel_width
    from schedules.gemm_qvnni_cpu import TEMPLATE, kernel, prepack

    dev = tvm.cpu()
    rng = np.random.default_rng(0)
    pk = _packed(fmt, n, k, rng)
    qargs = [tvm.runtime.tensor(a, dev) for _, a in pk.arrays]
    x = rng.standard_normal((1, m, k)).astype(np.float32)
    xt = tvm.runtime.tensor(x, dev)
    nb = panel_width(target)

    # the float path as built by the pipeline (records applied where they exist)
    deq, deq_t, _ = schedule_func(packed_dequant(pk.compute("dequant", (None, None)), nb), target, records)
    gemm, gemm_t, gemm_cfg = schedule_func(packed_linear_func(None, k, n, nb), target, records, m_hint=m)
    rt_d, rt_g = build_func(deq, target), build_func(gemm, target)
    panels = tvm.runtime.tensor(np.zeros((n // nb, k, nb), np.float32), dev)
    y32 = tvm.runtime.tensor(np.zeros((1, m, n), np.float32), dev)
    shapes = [tuple(int(d) if isinstance(getattr(d, "value", None), int) else -1 for d in p.shape) for p in gemm.params]
    gargs = [xt if i == 0 else y32 if i == len(shapes) - 1 else panels for i in range(len(shapes))]
    assert shapes[1] == (n // nb, k, nb) and len(shapes) == 3, shapes  # (x, W panels, y)
    t_deq, t_gemm = _timer(rt_d, [*qargs, panels]), _timer(rt_g, gargs)
    t_deq()
    t_gemm()
    ref = y32.numpy().astype(np.float64)

    func = pk.compute("matmul", (1, None))
    wl = TEMPLATE.match(func, target)
    d, info = wl.dims, wl.info
    default = TEMPLATE.default_config(wl, target)
    timers: dict[str, Any] = {"f32_dequant_gemm": lambda: t_deq() + t_gemm()}
    errs: dict[str, float] = {}
    configs = {"int8_gemm": default, **{name: {**default, **c} for name, c in INT8_CONFIGS.items()}}
    for name, cfg in configs.items():
        if not TEMPLATE.is_valid(wl, cfg, target):
            continue
        rt = build_func(TEMPLATE.apply(func, wl, cfg, target), target)
        y = tvm.runtime.tensor(np.zeros((1, m, n), np.float32), dev)
        timers[name] = _timer(rt, [xt, *qargs, y])
        timers[name]()
        errs[name] = float(np.abs(y.numpy() - ref).max() / np.abs(ref).max())
    args = (d["bits"], n, k, d["G"], info["sym"], info["offset"])
    pre = prepack(*args, [a for _, a in pk.arrays], int(default["nr"]))
    rt_p = build_func(kernel(*args, int(default["mr"]), int(default["nr"]), int(default["tasks"]), prepacked=True),
                      target)
    yp = tvm.runtime.tensor(np.zeros((1, m, n), np.float32), dev)
    timers["int8_gemm_prepacked"] = _timer(rt_p, [xt, *[tvm.runtime.tensor(a, dev) for a in pre], yp])
    timers["int8_gemm_prepacked"]()
    errs["int8_gemm_prepacked"] = float(np.abs(yp.numpy() - ref).max() / np.abs(ref).max())

    times: dict[str, list[float]] = {name: [] for name in timers}
    loads: list[float] = []
    for _ in range(rounds):
        for name, t in timers.items():
            times[name].append(t())
        loads.append(os.getloadavg()[0])
    base = statistics.median(times["f32_dequant_gemm"])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({"model": model, "format": fmt, "M": m, "K": k, "N": n, "variant": name,
                     "config": default if name == "int8_gemm" else configs.get(name, gemm_cfg if name.startswith("f32")
                                                                                   else default),
                     "median_ms": round(med * 1e3, 3), "gops": round(2 * m * n * k / med / 1e9, 1),
                     "speedup_vs_f32": round(base / med, 2), "rel_err_vs_f32": errs.get(name, 0.0),
                     "f32_templates": f"{deq_t}+{gemm_t}", "load_avg_1m": round(statistics.median(loads), 2)})
        print(rows[-1], flush=True)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    cases = sorted({(r["model"], r["format"], r["K"], r["N"], r["M"]) for r in rows}, key=lambda c: (c[0], c[4], c[3]))
    variants = ["f32_dequant_gemm", "int8_gemm", "int8_gemm_prepacked"]
    w = 0.8 / len(variants)
    with figure(path, figsize=(max(8, len(cases) * 0.9), 4.5)) as (_fig, ax):
        for i, v in enumerate(variants):
            vals = [next((r["gops"] for r in rows if (r["model"], r["format"], r["K"], r["N"], r["M"]) == c
                          and r["variant"] == v), 0) for c in cases]
            ax.bar(np.arange(len(cases)) + i * w, vals, w, label=v)
        ax.set_xticks(np.arange(len(cases)) + 0.4 - w / 2)
        ax.set_xticklabels([f"{c[0]} {c[1]}\n{c[3]}x{c[2]} M={c[4]}" for c in cases], fontsize=7, rotation=30)
        ax.set_ylabel("GOP/s (2 M N K / time)")
        ax.set_title(f"Prefill linears, int8 VNNI GEMM vs dequantize + fp32 GEMM (2 threads, load ~{rows[0]['load_avg_1m']})")
        ax.legend()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--m", default="128,512")
    p.add_argument("--only", default="")
    p.add_argument("--out", default=str(RESULTS / "gemm_qvnni.csv"))
    args = p.parse_args()

    from perfx_compiler.targets import load_target
    from perfx_compiler.tune.measure import configure_threads
    from perfx_compiler.tune.records import default_records

    target = load_target("host")
    configure_threads(target.cores or 2)
    records = default_records(target.name)
    rows: list[dict] = []
    for model, fmt, k, n in CASES:
        if args.only and model != args.only:
            continue
        for m in (int(v) for v in args.m.split(",")):
            rows.extend(run_case(model, fmt, k, n, m, args.rounds, target, records))
    out = write_csv(args.out, rows)
    plot(rows, out.with_suffix(".png"))
    for model in sorted({r["model"] for r in rows}):
        sp = [r["speedup_vs_f32"] for r in rows if r["model"] == model and r["variant"] == "int8_gemm"]
        print(f"{model}: int8 GEMM vs dequant + f32 GEMM, median speed-up {statistics.median(sp):.2f}x over {len(sp)}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
