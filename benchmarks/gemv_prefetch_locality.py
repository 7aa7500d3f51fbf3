"""Where the VNNI decode GEMV should prefetch its weight codes, on this machine: non-temporally
(``nta=1``: prefetchnta), into L1 (``ploc=3``: prefetcht0), L2 (``ploc=2``: prefetcht1) or L3
(``ploc=1``), at TinyLlama-1.1B's and SmolLM2's decode shapes (Q4_0 codes, one activation row).

Each shape's GEMV is built once per arm from the template default (``schedules/gemv_qvnni_cpu.py``)
with only the prefetch knobs changed, over enough copies of its weights (~1.5 GB) that every call
streams from DRAM; a round times every arm (order reversed every round) as back-to-back calls over
the copies, between two runs of the read-bandwidth probe (``bench/machine.py``). Reported per shape
and arm: the median over rounds of weight GB/s, its fraction of the probe and the speedup over the
first arm, with the CPU vendor; the target file's per-vendor defaults (``targets/x86-avx512.json``
``vendor_templates``) come from this table.

    python benchmarks/gemv_prefetch_locality.py [--rounds 5] [--threads 2] [--name intel]

Writes benchmarks/results/gemv_prefetch_locality_<name>.csv and a PNG.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
from _common import REPO, RESULTS, alternated, figure, write_csv

sys.path.insert(0, str(REPO / "tests" / "schedules"))

SHAPES = {  # name: (N, K)
    "tinyllama_qkv": (2560, 2048), "tinyllama_o": (2048, 2048), "tinyllama_gate_up": (11264, 2048),
    "tinyllama_down": (2048, 5632), "tinyllama_lm_head": (32000, 2048),
    "smollm2_gate_up": (3072, 576), "smollm2_down": (576, 1536),
}
ARMS = {"nta": {"nta": 1}, "l1_t0": {"nta": 0, "ploc": 3}, "l2_t1": {"nta": 0, "ploc": 2}, "l3_t2": {"nta": 0, "ploc": 1}}


def _build(shape: tuple[int, int], target: Any, rng: np.random.Generator) -> tuple[dict[str, Any], list[Any], int]:
    import tvm
    from sched_helpers import vnni_weights

    from perfx_compiler.tune.measure import build_func
    from schedules.gemv_qvnni_cpu import TEMPLATE

    n, k = shape
    packed, _ = vnni_weights("Q4_0", n, k, rng)
    func = packed.compute("matmul", (1, 1))
    wl = TEMPLATE.match(func, target)
    base = TEMPLATE.builtin_default(wl, target)
    fns = {arm: build_func(TEMPLATE.apply(func, wl, {**base, **knobs}, target), target)["main"]
           for arm, knobs in ARMS.items()}
    arrays = [a for _, a in packed.arrays]
    dev = tvm.cpu()
    copies = max(2, int(1.5e9 // sum(a.nbytes for a in arrays)))
    sets = [[tvm.runtime.tensor(a.copy(), dev) for a in arrays] for _ in range(copies)]
    x = tvm.runtime.tensor(rng.standard_normal((1, 1, k)).astype(np.float32), dev)
    y = tvm.runtime.tensor(np.zeros((1, 1, n), np.float32), dev)
    # codes + scales: the zero array of Q4_0's symmetric layout is never read under int8 activations
    streamed = sum(a.nbytes for a in arrays[:2])
    return fns, [x, sets, y], streamed


def _time(fn: Any, args: list[Any], passes: int = 3) -> float:
    x, sets, y = args
    t0 = time.perf_counter()
    for _ in range(passes):
        for s in sets:
            fn(x, *s, y)
    return (time.perf_counter() - t0) / (passes * len(sets))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="")
    args = ap.parse_args(argv)
    from perfx_compiler.tune.measure import configure_threads

    configure_threads(args.threads)
    from perfx_compiler.bench.machine import BandwidthProbe, cpu_model
    from perfx_compiler.targets import _cpu_vendor, load_target

    target = load_target("host")
    vendor = _cpu_vendor()
    name = args.name or {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(vendor, "host")
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    with BandwidthProbe(args.threads) as probe:
        for shape_name, shape in SHAPES.items():
            fns, call_args, streamed = _build(shape, target, rng)
            per_arm: dict[str, list[float]] = {arm: [] for arm in ARMS}
            probes: list[float] = []
            for r in range(args.rounds):
                before = probe.measure(reps=2)
                for arm in alternated(list(ARMS), r):
                    per_arm[arm].append(streamed / _time(fns[arm], call_args) / 1e9)
                probes.append((before + probe.measure(reps=2)) / 2)
            ceiling = statistics.median(probes)
            first = statistics.median(per_arm[next(iter(ARMS))])
            for arm, gbs in per_arm.items():
                med = statistics.median(gbs)
                rows.append({"shape": shape_name, "N": shape[0], "K": shape[1], "arm": arm, **ARMS[arm],
                             "gbs": round(med, 2), "probe_gbs": round(ceiling, 2), "frac_of_probe": round(med / ceiling, 3),
                             "speedup_vs_first": round(med / first, 3), "rounds": args.rounds, "threads": args.threads,
                             "cpu": cpu_model(), "vendor": vendor, "load_avg_1m": round(os.getloadavg()[0], 2)})
                print(f"{shape_name:18s} {arm:6s} {med:6.1f} GB/s ({med / ceiling:.0%} of the probe)")
    out = write_csv(RESULTS / f"gemv_prefetch_locality_{name}.csv", rows)
    with figure(RESULTS / f"gemv_prefetch_locality_{name}.png", figsize=(9, 4)) as (fig, ax):
        shapes = list(SHAPES)
        width = 0.8 / len(ARMS)
        for i, arm in enumerate(ARMS):
            vals = [next(r["frac_of_probe"] for r in rows if r["shape"] == s and r["arm"] == arm) for s in shapes]
            ax.bar(np.arange(len(shapes)) + i * width, vals, width, label=arm)
        ax.set_xticks(np.arange(len(shapes)) + width * (len(ARMS) - 1) / 2, shapes, rotation=20, fontsize=8)
        ax.set_ylabel("weight GB/s / read probe")
        ax.set_title(f"VNNI GEMV code prefetch locality, {cpu_model()}, {args.threads} threads")
        ax.legend(fontsize=8)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
