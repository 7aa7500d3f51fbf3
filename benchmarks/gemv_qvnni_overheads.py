"""Where a small decode GEMV's time goes (issue #8: TinyLlama's q/k/v/o GEMVs read a smaller share
of the probe per call than gate|up, down and the lm-head): the fixed per-call costs next to the
weight stream, VNNI Q4_0 kernel of ``schedules/gemv_qvnni_cpu.py``, one activation row, 2 threads.

Cases, each timed by TVM's time_evaluator (C++ timer, one call per sample, no Python in the timed
region), hot (nothing flushed) and cold (every argument but x clflushed before each call, as the
tuner times decode GEMVs):

* ``fork_join``: an empty parallel loop of 16 tasks (the pool wake-up and join a GEMV pays);
* ``fork_join_2``: the same with 2 tasks;
* ``prologue_K``: the GEMV with N=2 (one row pair): x's int8 quantization of K values + one launch
  (also at SmolLM2's K); ``prologue_K_qtree``: the same with x's per-group max and code sum folded in
  registers (``qtree=1``) instead of a 15-step chain;
* ``gemv_NxK``: the real shapes (qkv 2560x2048, o 2048x2048, gate_up 11264x2048, down 2048x5632) at
  the default config, and with tasks=2 (one chunk of rows per thread) instead of 16.

Reported: p10 and median of ``--calls`` samples per round, median over ``--rounds`` alternated rounds,
and for the GEMVs the weight GB/s of the p10 and the share of it the fixed costs explain (the
``prologue_K`` case: launch + quantization + one row pair), with the GB/s of the rest.

    python benchmarks/gemv_qvnni_overheads.py [--rounds 5] [--calls 200]

Writes benchmarks/results/gemv_qvnni_overheads.csv.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

import numpy as np
from _common import RESULTS, write_csv  # noqa: E402  (puts the repo root on sys.path)

from perfx_compiler.passes._gguf_blocks import Q4_0  # noqa: E402
from perfx_compiler.passes._qvnni import q4_vnni_packed  # noqa: E402
from perfx_compiler.targets import load_target  # noqa: E402
from perfx_compiler.tune.measure import build_func, configure_threads, time_calls  # noqa: E402

SMOLLM2_K = (576, 1536)  # SmolLM2's rows: its prologues are a larger share of a shorter call
SHAPES = {"qkv": (2560, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632)}


def _empty(tasks: int) -> Any:
    from tvm.script import tirx as T

    @T.prim_func
    def empty(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32")):  # noqa: ANN202
        for t in T.parallel(tasks):
            b[t] = a[t] + T.float32(1)

    return empty


def _gemv(n: int, k: int, target: Any, rng: np.random.Generator, over: dict[str, int] | None = None,
          ) -> tuple[Any, list[Any], int, np.ndarray, np.ndarray, dict[str, Any]]:
    import tvm

    from schedules.gemv_qvnni_cpu import TEMPLATE

    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    d = (rng.random((n, k // 32)) * 0.01 + 1e-3).astype(np.float16)
    packed = q4_vnni_packed(codes, d, np.full((n, k // 32), 8, np.uint8), Q4_0)
    func = packed.compute("matmul", (1, 1))
    wl = TEMPLATE.match(func, target)
    config = {**TEMPLATE.default_config(wl, target), **(over or {})}
    rt = build_func(TEMPLATE.apply(func, wl, config, target), target)
    dev = tvm.cpu()
    x = rng.standard_normal((1, 1, k)).astype(np.float32)
    args = [tvm.runtime.tensor(x, dev), *[tvm.runtime.tensor(a, dev) for _, a in packed.arrays],
            tvm.runtime.tensor(np.zeros((1, 1, n), np.float32), dev)]
    nbytes = sum(a.nbytes for name, a in packed.arrays if not name.endswith("_zero"))  # sym: zeros unread
    w = (codes.astype(np.float64) - 8.0) * np.repeat(d.astype(np.float64), 32, axis=1)
    return rt, args, nbytes, w, x.ravel().astype(np.float64), config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", default=str(RESULTS / "gemv_qvnni_overheads.csv"))
    args = ap.parse_args(argv)
    import tvm

    target = load_target("host")
    threads = configure_threads(target.cores or os.cpu_count() or 1)
    rng = np.random.default_rng(0)
    cases: list[dict[str, Any]] = []
    for tasks in (16, 2):
        a, b = (tvm.runtime.tensor(np.zeros(64, np.float32), tvm.cpu()) for _ in range(2))
        cases.append({"case": "fork_join" + ("" if tasks == 16 else "_2"), "rt": build_func(_empty(tasks), target),
                      "args": [a, b], "bytes": 0, "K": 0, "N": 0})
    for k in sorted({k for _, k in SHAPES.values()} | set(SMOLLM2_K)):
        for qtree in (0, 1):  # x's per-group max / code sum: chain vs folded in registers
            rt, a, nb, _, _, _ = _gemv(2, k, target, rng, {"qtree": qtree})
            cases.append({"case": f"prologue_{k}" + ("_qtree" if qtree else ""), "rt": rt, "args": a, "bytes": nb,
                          "K": k, "N": 2})
    for name, (n, k) in SHAPES.items():
        for over, suffix in ((None, ""), ({"tasks": 2}, "_tasks2")):
            rt, a, nb, w, x, config = _gemv(n, k, target, rng, over)
            rt["main"](*a)
            ref = w @ x
            err = np.abs(a[-1].numpy().ravel() - ref).max() / np.abs(ref).max()
            assert err < 2e-2, (name, over, err)  # int8 activations: ~1e-2 relative at most
            cases.append({"case": f"gemv_{name}{suffix}", "rt": rt, "args": a, "bytes": nb, "K": k, "N": n,
                          "qtree": int(config.get("qtree", 0))})
    samples: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    for r in range(args.rounds):
        for c in (cases if r % 2 == 0 else cases[::-1]):
            for cold in (False, True):
                t = time_calls(c["rt"], c["args"], args.calls, cold)
                samples.setdefault((c["case"], cold), []).append((float(np.percentile(t, 10)), float(np.median(t))))
        print(f"round {r + 1}/{args.rounds}, load {os.getloadavg()[0]:.1f}", flush=True)
    load = os.getloadavg()[0]
    p10 = {key: statistics.median(s[0] for s in v) for key, v in samples.items()}
    rows = []
    for c in cases:
        for cold in (False, True):
            sec = p10[(c["case"], cold)]
            med = statistics.median(s[1] for s in samples[(c["case"], cold)])
            # the N=2 GEMV is the fixed part: one launch (fork/join) + x's quantization + one row pair
            # (the prologue built with the GEMV's own qtree)
            fixed = p10.get((f"prologue_{c['K']}" + ("_qtree" if c.get("qtree") else ""), cold), 0.0)
            gemv = c["case"].startswith("gemv")
            rows.append({"case": c["case"], "N": c["N"], "K": c["K"], "cold": cold, "p10_us": round(sec * 1e6, 2),
                         "median_us": round(med * 1e6, 2),
                         "p10_gbs": round(c["bytes"] / sec / 1e9, 2) if c["bytes"] else "",
                         "fixed_us": round(fixed * 1e6, 2) if gemv else "",
                         "fixed_share": round(fixed / sec, 3) if gemv else "",
                         "stream_gbs": round(c["bytes"] / max(sec - fixed, 1e-9) / 1e9, 2) if gemv else "",
                         "rounds": args.rounds, "calls": args.calls, "load_avg_1m": round(load, 2), "threads": threads})
            x = rows[-1]
            print(f"{x['case']:<18} {'cold' if cold else 'hot ':<4} p10 {x['p10_us']:8.2f} us  median {x['median_us']:8.2f}"
                  + (f"  {x['p10_gbs']:6.1f} GB/s" if x["p10_gbs"] != "" else "")
                  + (f"  fixed {x['fixed_us']:.1f} us = {100 * x['fixed_share']:.0f}%, rest {x['stream_gbs']:.1f} GB/s"
                     if gemv else ""))
    out = write_csv(args.out, rows)
    print(f"wrote {out} (load {load:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
