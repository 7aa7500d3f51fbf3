"""Does the tuner's cold-cache timing rank decode GEMV configurations as the model runs them?

For every decode GEMV of a model (static rows; ``gemv_qvnni_cpu`` by default), the template default
and the best record of ``--tuning-log`` are timed three ways, in alternated rounds:

* ``warm_us``: the old tuner timing (min of single calls, same inputs: weights stay in cache),
  median of rounds;
* ``cold_us``: the tuner's timing now (``measure.time_module(cold=True)``: every argument but x
  flushed before each call, min of single calls), median of rounds;
* ``stream_us``: model-like, back-to-back calls over rotating copies of the weights (more than 2x
  the LLC in all, so each call reads from DRAM with the thread pool hot), loop time / calls
  (includes ~1 us of Python call overhead per call); the fastest round. A mean over calls: under
  load a preempted pool thread stalls the call, so only a quiet machine gives meaningful values.

    python benchmarks/gemv_cold_timing.py --tuning-log /tmp/tlog [--model smollm2-135m] [--rounds 5]

Writes benchmarks/results/gemv_cold_timing.csv and .png (with the 1-minute load average).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from _common import figure, write_csv

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results"


def _stream_s(fn, sets, seconds: float = 0.05) -> float:  # noqa: ANN001
    for s in sets:  # one pass to start the pool and page everything in
        fn(*s)
    start = time.perf_counter()
    calls = 0
    while time.perf_counter() - start < seconds:
        for s in sets:
            fn(*s)
        calls += len(sets)
    return (time.perf_counter() - start) / calls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tuning-log", required=True, metavar="DIR", help="records to compare with the defaults")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--target", default="host")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--template", default="gemv_qvnni_cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS / "gemv_cold_timing.csv"))
    args = ap.parse_args(argv)

    import tvm
    from tvm import tirx

    from perfx_compiler.pipeline import lower_model
    from perfx_compiler.schedule_template import template_by_name
    from perfx_compiler.targets import load_target
    from perfx_compiler.tune import measure as m
    from perfx_compiler.tune.records import default_records
    from perfx_compiler.tune.traffic import llc_bytes

    target = load_target(args.target)
    m.configure_threads(target.cores or 2)
    mod, _ = lower_model(args.model, args.target, quantization=args.quantization)
    db = default_records(target.name, args.tuning_log)
    template = template_by_name(args.template)
    dev = tvm.cpu()
    rows = []
    seen: set[str] = set()
    for gvar, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        wl = template.match(func, target)
        if wl is None or wl.symbolic or wl.info.get("kind", "matmul") != "matmul" or wl.key in seen:
            continue
        seen.add(wl.key)
        best = db.best(wl.key, wl.target_key) if db is not None else None
        configs = {"default": template.default_config(wl, target)}
        if best is not None and best.config != configs["default"]:
            configs["record"] = best.config
        rts = {k: m.build_func(template.apply(func, wl, c, target), target) for k, c in configs.items()}
        arrays = m.random_inputs(func, 1, seed=1)
        weight_bytes = sum(a.nbytes for a in arrays[1:-1])
        copies = max(3, 2 * llc_bytes() // max(1, weight_bytes) + 1)
        x = tvm.runtime.tensor(arrays[0], dev)
        sets = [[x, *(tvm.runtime.tensor(a, dev) for a in arrays[1:])] for _ in range(copies)]
        got: dict[str, dict[str, list[float]]] = {k: {"warm": [], "cold": [], "stream": []} for k in configs}
        loads = []
        for r in range(args.rounds):
            for k in (list(configs) if r % 2 == 0 else list(reversed(list(configs)))):
                rt = rts[k]
                got[k]["warm"].append(m.time_module(rt, func, 1, cold=False)[0])
                got[k]["cold"].append(m.time_module(rt, func, 1, cold=True)[0])
                got[k]["stream"].append(_stream_s(rt["main"], sets))
            loads.append(os.getloadavg()[0])
        for k, cfg in configs.items():
            row = {"function": gvar.name_hint, "N": wl.dims["N"], "K": wl.dims["K"], "weight_mb": round(weight_bytes / 1e6, 3),
                   "variant": k, "config": cfg, "copies": copies, "rounds": args.rounds,
                   "load_avg_1m_median": round(statistics.median(loads), 2)}
            for kind, values in got[k].items():
                pick = min if kind == "stream" else statistics.median
                row[f"{kind}_us"] = round(pick(values) * 1e6, 2)
            row["cold_gbs"] = round(weight_bytes / (row["cold_us"] * 1e-6) / 1e9, 1)
            rows.append(row)
            print(row, flush=True)
        del sets

    out = write_csv(args.out, rows)
    _plot(rows, out.with_suffix(".png"))
    print(f"wrote {out}")
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    labels = [f"{r['N']}x{r['K']}\n{r['variant']}" for r in rows]
    with figure(path, figsize=(max(6, len(rows) * 0.9), 3.8)) as (fig, ax):
        xs = range(len(rows))
        for j, kind in enumerate(("warm", "cold", "stream")):
            ax.bar([x + (j - 1) * 0.27 for x in xs], [r[f"{kind}_us"] for r in rows], width=0.27, label=kind)
        ax.set_yscale("log")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel("us per call")
        ax.set_title(f"decode GEMV timings: warm / cold (tuner) / streaming, load ~{rows[0]['load_avg_1m_median']}", fontsize=9)
        ax.legend(fontsize=8)


if __name__ == "__main__":
    raise SystemExit(main())
