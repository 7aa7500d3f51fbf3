"""Int4 decode GEMV (one row of x) on CPU: GB/s of the weight stream against the machine's read bandwidth.

Variants, timed in alternating rounds in one run (the machine is shared: medians of each round's
best are reported, and the read bandwidth is probed in every round too):

  vnni      schedules/gemv_qvnni_cpu.py: int8 activations, vpdpbusd (default config)
  vnni_alt  the same template with the other split/hinib pair (A/B of the default's choice: long rows
            run split=1, hinib=0 by default, short rows split=2, hinib=1)
  vnni_cold (``--cold-tuned``) the fastest of split x hinib x sprefetch timed as the tuner times
            decode GEMVs (tune/measure.py time_module cold=True: arguments but x clflushed per call)
  fp32      schedules/gemv_int4_cpu.py: fp32 activations, unpack + convert + FMA (default config)
  numpy     numpy reference: dequantize the int4 codes, then matvec (OpenBLAS)
  numpy_f32 numpy matvec on the already dequantized float32 W (4x the bytes; GB/s on its own bytes)

GB/s = bytes of the packed weight arrays (codes + scales + mins) / seconds. Weights bigger than
the last-level cache are read from DRAM: each call takes the next of several weight copies (at
least 3x the L3 size in all), so no call finds its weights cached. The bandwidth probe is
``perfx_compiler.bench.machine.read_bandwidth`` (a multi-threaded sum over 1 GiB).

Writes benchmarks/results/gemv_int4.csv and gemv_int4.png.

``--decode``: instead, SmolLM2-135M (GGUF) compiled twice for this CPU, ``--activations f32`` (the fp32
int4 kernels) and ``int8`` (VNNI), decode tokens/s of each in alternating rounds (64 greedy tokens after
an 8-token prefill, median of the rounds; and a 128-token prefill, which reads the weights through the
dequantize kernels) -> benchmarks/results/gemv_int4_decode.csv.

    python benchmarks/bench_gemv_int4.py [--format Q4_1|Q4_0] [--rounds 5] [--threads 2] [--quick]
    python benchmarks/bench_gemv_int4.py --decode [--rounds 7] [--artifacts F32_DIR INT8_DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO, REPO / "benchmarks"):  # also when imported by the other benchmarks
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from _common import RESULTS, figure, write_csv  # noqa: E402

from perfx_compiler.bench.machine import read_bandwidth  # noqa: E402
from perfx_compiler.passes._gguf_blocks import Q4_0, Q4_1  # noqa: E402
from perfx_compiler.passes._quant import int4_packed  # noqa: E402
from perfx_compiler.schedule_template import find_template  # noqa: E402
from perfx_compiler.targets import load_target  # noqa: E402
from perfx_compiler.tune.measure import build_func  # noqa: E402

BIG = [(11008, 4096), (4096, 11008), (4096, 4096)]
SMOL = [(3072, 576), (576, 1536), (960, 576), (576, 576), (49152, 576)]
L3_BYTES = 32 << 20
VARIANTS = ("vnni", "vnni_alt", "vnni_cold", "fp32", "numpy", "numpy_f32")


def _weights(fmt: str, n: int, k: int, rng: np.random.Generator) -> tuple[Any, np.ndarray]:
    f = Q4_1 if fmt == "Q4_1" else Q4_0
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    d = (rng.random((n, k // 32)) * 0.01).astype(np.float16)
    third = (-rng.random((n, k // 32)) * 0.08).astype(np.float16) if f.offset else np.full((n, k // 32), 8, np.uint8)
    return int4_packed(codes, d, third, f), codes


def _kernel(packed: Any, target: Any, override: dict[str, Any] | None = None) -> tuple[Any, str]:
    func = packed.compute("matmul", (1, 1))
    template, wl = find_template(func, target)
    config = {**template.default_config(wl, target), **(override or {})}
    return build_func(template.apply(func, wl, config, target), target), f"{template.name} {config}"


def _cold_tuned(packed: Any, target: Any) -> tuple[Any, str]:
    """The fastest of the split x hinib x sprefetch grid (other knobs at the default) as the tuner
    times decode GEMVs: ``time_module(cold=True)``, every argument but x clflushed before each call,
    fastest single call."""
    from perfx_compiler.tune.measure import time_module

    func = packed.compute("matmul", (1, 1))
    template, wl = find_template(func, target)
    base = template.default_config(wl, target)
    best: tuple[float, Any, str] | None = None
    for split in (1, 2):
        for hinib in (0, 1):
            for spf in (0, 1):
                config = {**base, "split": split, "hinib": hinib, "sprefetch": spf}
                if not template.is_valid(wl, config, target):
                    continue
                rt = build_func(template.apply(func, wl, config, target), target)
                sec, _ = time_module(rt, func, 1, cold=True)
                if best is None or sec < best[0]:
                    best = (sec, rt, f"{template.name} {config} (cold {sec * 1e6:.0f} us)")
    assert best is not None
    return best[1], best[2]


def _timer(rt: Any, copies: list[list[Any]], x: Any, y: Any) -> Any:
    """Mean seconds per call over ``calls`` calls; every call's own time is kept in ``run.calls``
    (the 10th percentile is the load-robust figure: the undisturbed calls)."""
    fn, clock = rt["main"], time.perf_counter

    def run(calls: int) -> float:
        t0 = clock()
        for _ in range(calls):
            # the copies rotate across runs too: a run starting at copy 0 again would find it cached
            # right after a one-call run (the warm-up call) had read it
            run.pos = (run.pos + 1) % len(copies)
            t = clock()
            fn(x, *copies[run.pos], y)
            run.calls.append(clock() - t)
        return (clock() - t0) / calls
    run.calls, run.pos = [], 0
    return run


def _numpy_timer(codes: np.ndarray, d: np.ndarray, third: np.ndarray, offset: bool, x: np.ndarray) -> Any:
    idx = np.arange(codes.shape[1]) // 32

    def run(calls: int) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            s = d.astype(np.float32)[:, idx]
            t = third.astype(np.float32)[:, idx]
            w = codes * s + t if offset else (codes - t) * s
            _ = w @ x
        return (time.perf_counter() - t0) / calls
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="Q4_1", choices=["Q4_1", "Q4_0"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="threads of the bandwidth probe (the kernels use all cores)")
    ap.add_argument("--quick", action="store_true", help="3 rounds, no numpy dequant on the big shapes")
    ap.add_argument("--out", default=str(RESULTS / "gemv_int4"))
    ap.add_argument("--cold-tuned", action="store_true", help="add vnni_cold (a cold-timed split/hinib/sprefetch grid)")
    ap.add_argument("--shapes", default=None, help="comma-separated NxK (default: all)")
    ap.add_argument("--decode", action="store_true", help="SmolLM2 decode tokens/s, activations f32 vs int8")
    ap.add_argument("--artifacts", nargs=2, default=None, metavar=("F32_DIR", "INT8_DIR"),
                    help="with --decode: already compiled artifacts (else compiled into a temp dir)")
    args = ap.parse_args(argv)
    if args.decode:
        return decode_main(args)
    rounds = 3 if args.quick else args.rounds
    import tvm

    target = load_target("host")
    # TVM's pool defaults to hardware_concurrency / 2 = ONE thread on this 2-vCPU host (it assumes
    # SMT): size it to the cores first, as the runtime Engine does, else the kernels run on one core
    # while the probe and numpy use all of them
    from perfx_compiler.tune.measure import configure_threads

    tvm_threads = configure_threads(target.cores or os.cpu_count() or 1)
    dev = tvm.cpu()
    rng = np.random.default_rng(0)
    shapes = [tuple(int(v) for v in t.split("x")) for t in args.shapes.split(",")] if args.shapes else BIG + SMOL
    setups = {}
    for n, k in shapes:
        packed, codes = _weights(args.format, n, k, rng)
        vpacked = packed.vnni()  # the same weights in the VNNI layout
        x = rng.standard_normal(k).astype(np.float32)
        xt = tvm.runtime.tensor(x.reshape(1, 1, k), dev)
        yt = tvm.runtime.tensor(np.zeros((1, 1, n), np.float32), dev)
        ncopies = max(1, -(-3 * L3_BYTES // packed.nbytes)) if packed.nbytes > L3_BYTES // 4 else 1
        timers, labels, nbytes = {}, {}, {}
        # vnni and vnni_base read the SAME weight copies: with copies of their own, an A/A pair of one
        # config differed by 5-8% (the placement of the memory, not the kernel)
        shared: dict[int, list[list[Any]]] = {}
        variants = [("vnni", vpacked, None), ("vnni_alt", vpacked, "alt"), ("fp32", packed, None)]
        if args.cold_tuned:
            variants.insert(2, ("vnni_cold", vpacked, "cold"))
        for name, pk, over in variants:
            if over == "cold":
                rt, labels[name] = _cold_tuned(pk, target)
            elif over == "alt":  # the other split/hinib pair than the default's
                plain = _kernel(pk, target)[1].find("'split': 1") >= 0
                rt, labels[name] = _kernel(pk, target, {"split": 2, "hinib": 1} if plain else {"split": 1, "hinib": 0})
            else:
                rt, labels[name] = _kernel(pk, target, over)
            if id(pk) not in shared:
                shared[id(pk)] = [[tvm.runtime.tensor(a.copy(), dev) for _, a in pk.arrays] for _ in range(ncopies)]
            timers[name] = _timer(rt, shared[id(pk)], xt, yt)
            nbytes[name] = pk.nbytes
        arrays = dict(packed.arrays)
        d = arrays["_q4_scale"]
        third = arrays.get("_q4_min", arrays.get("_q4_zero"))
        if not (args.quick and (n, k) in BIG):
            timers["numpy"] = _numpy_timer(codes, d, third, args.format == "Q4_1", x)
            nbytes["numpy"] = packed.nbytes
        idx = np.arange(k) // 32
        wf = (codes * d.astype(np.float32)[:, idx] + third.astype(np.float32)[:, idx]) if args.format == "Q4_1" \
            else ((codes - third.astype(np.float32)[:, idx]) * d.astype(np.float32)[:, idx])
        wf = np.ascontiguousarray(wf, dtype=np.float32)
        wcopies = [wf] + [wf.copy() for _ in range(max(0, -(-3 * L3_BYTES // wf.nbytes) - 1))] \
            if wf.nbytes > L3_BYTES // 4 else [wf]

        def f32(calls: int, wcopies: list[np.ndarray] = wcopies, x: np.ndarray = x) -> float:
            t0 = time.perf_counter()
            for i in range(calls):
                _ = wcopies[i % len(wcopies)] @ x
            return (time.perf_counter() - t0) / calls

        timers["numpy_f32"], nbytes["numpy_f32"] = f32, wf.nbytes
        # check the two TVM kernels once (against numpy on float64)
        for name in [v for v in timers if not v.startswith("numpy")]:
            timers[name](1)
            ref = wf.astype(np.float64) @ x.astype(np.float64)
            err = np.abs(yt.numpy().ravel() - ref).max() / np.abs(ref).max()
            assert err < (2e-2 if name.startswith("vnni") else 1e-4), (name, n, k, err)
        setups[(n, k)] = (timers, labels, nbytes)
        print(f"built {n}x{k}: {labels}", flush=True)

    samples: dict[tuple[int, int, str], list[float]] = {}
    bw: list[float] = []
    for r in range(rounds):
        bw.append(read_bandwidth(args.threads, 1 << 30, reps=3))
        for (n, k), (timers, _, _) in setups.items():
            order = list(timers) if r % 2 == 0 else list(reversed(list(timers)))
            for name in order:
                t = timers[name]
                # Let the previous case's threads go idle first: TVM's pool spins a while after a call,
                # OpenBLAS's (numpy_f32) for up to ~0.1 s, the probe's OpenMP threads too. Without this
                # for the TVM variants, the first one after numpy_f32 ("vnni" in every forward round) ran
                # beside spinning BLAS threads (x0.96 at 4096x11008 under load: blas_spin_interference.py)
                time.sleep(0.25)
                single = t(1)
                calls = max(3, min(400, int(0.25 / max(single, 1e-7))))
                samples.setdefault((n, k, name), []).append(t(calls))
        print(f"round {r + 1}/{rounds}: read bandwidth {bw[-1]:.1f} GB/s", flush=True)
    bandwidth = statistics.median(bw)
    load = os.getloadavg()[0]  # the machine is shared: how busy it was at the end of the rounds

    rows = []
    for (n, k), (_, labels, nbytes) in setups.items():
        for name in VARIANTS:
            if (n, k, name) not in samples:
                continue
            sec = statistics.median(samples[(n, k, name)])
            gbs = nbytes[name] / sec / 1e9
            per_call = getattr(setups[(n, k)][0][name], "calls", None)
            p10 = float(np.percentile(per_call, 10)) if per_call else None
            rows.append({"N": n, "K": k, "variant": name, "format": args.format, "us": round(sec * 1e6, 2),
                         "GBps": round(gbs, 2), "read_bw_GBps": round(bandwidth, 2),
                         "frac_of_bw": round(gbs / bandwidth, 3),
                         "call_p10_GBps": round(nbytes[name] / p10 / 1e9, 2) if p10 else "",
                         "frac_call_p10_of_bw": round(nbytes[name] / p10 / 1e9 / bandwidth, 3) if p10 else "",
                         "bytes": nbytes[name],
                         "dram": nbytes[name] > L3_BYTES // 4, "config": labels.get(name, ""),
                         "load_avg_1m": round(load, 1), "tvm_threads": tvm_threads})
            print(f"{n:>6}x{k:<6} {name:>9}: {sec * 1e6:9.1f} us {gbs:6.1f} GB/s ({gbs / bandwidth:.0%} of {bandwidth:.1f})"
                  + (f", call p10 {nbytes[name] / p10 / 1e9:6.1f} GB/s" if p10 else ""))
    out = Path(args.out)
    write_csv(out.with_suffix(".csv"), rows)
    _plot(rows, bandwidth, out.with_suffix(".png"), args.format)
    print(f"wrote {out.with_suffix('.csv')} and {out.with_suffix('.png')}")
    return 0


def decode_main(args: argparse.Namespace) -> int:
    import tempfile

    from perfx_compiler.bench.machine import cpu_model
    from perfx_compiler.runtime.engine import Engine

    if args.artifacts:
        arts = {"f32": Path(args.artifacts[0]), "int8": Path(args.artifacts[1])}
    else:
        from perfx_compiler.pipeline import compile_model

        tmp = Path(tempfile.mkdtemp(prefix="perfx-act-"))
        arts = {a: Path(compile_model("smollm2-135m", "host", tmp / a, progress=False, activations=a))
                for a in ("f32", "int8")}
    import json

    for a, path in arts.items():
        got = json.loads((path / "perfx-config.json").read_text()).get("activations", "f32")
        if got != a:
            raise SystemExit(f"{path} was compiled with activations {got}, not {a}")
    engines = {a: Engine(p) for a, p in arts.items()}
    tps: dict[str, list[float]] = {a: [] for a in arts}
    pre: dict[str, list[float]] = {a: [] for a in arts}
    bw: list[float] = []
    for r in range(args.rounds):
        bw.append(read_bandwidth(args.threads, 1 << 28, reps=3))
        for a in (list(arts) if r % 2 == 0 else list(reversed(list(arts)))):
            eng = engines[a]
            eng.reset()
            tok = int(np.argmax(eng.prefill([1, 2, 3, 4, 5, 6, 7, 8])[0]))
            t0 = time.perf_counter()
            for _ in range(64):
                tok = int(np.argmax(eng.decode(tok)))
            tps[a].append(64 / (time.perf_counter() - t0))
            eng.reset()  # prefill reads the same weights through the dequantize kernels (layouts differ)
            t0 = time.perf_counter()
            eng.prefill(list(range(1, 129)))
            pre[a].append(128 / (time.perf_counter() - t0))
        print(f"round {r + 1}: " + ", ".join(f"{a} {tps[a][-1]:.1f} tok/s" for a in arts), flush=True)
    out = Path(args.out).with_name(Path(args.out).name + "_decode.csv")
    rows = [{"activations": a, "decode_tok_s_median": round(statistics.median(v), 1),
             "rounds": " ".join(f"{x:.1f}" for x in v), "read_bw_GBps_median": round(statistics.median(bw), 1),
             "speedup_vs_f32": round(statistics.median(v) / statistics.median(tps["f32"]), 3),
             "prefill128_tok_s_median": round(statistics.median(pre[a]), 1), "cpu": cpu_model(),
             "load_avg_1m": round(os.getloadavg()[0], 1)}
            for a, v in tps.items()]
    write_csv(out, rows)
    for row in rows:
        print(row)
    print(f"wrote {out}")
    return 0


def _plot(rows: list[dict[str, Any]], bandwidth: float, path: Path, fmt: str) -> None:
    shapes = list(dict.fromkeys((r["N"], r["K"]) for r in rows))
    with figure(path, figsize=(12, 4.5)) as (_, ax):
        _draw(ax, rows, bandwidth, shapes, fmt)


def _draw(ax: Any, rows: list[dict[str, Any]], bandwidth: float, shapes: list[tuple[int, int]], fmt: str) -> None:
    present = [v for v in VARIANTS if any(r["variant"] == v for r in rows)]
    width = 0.8 / len(present)
    for i, name in enumerate(present):
        vals = [next((r["GBps"] for r in rows if (r["N"], r["K"]) == s and r["variant"] == name), 0) for s in shapes]
        ax.bar(np.arange(len(shapes)) + (i - (len(present) - 1) / 2) * width, vals, width, label=name)
    ax.axhline(bandwidth, color="k", ls="--", lw=1, label=f"read bandwidth {bandwidth:.1f} GB/s")
    ax.axhline(0.7 * bandwidth, color="gray", ls=":", lw=1, label="70%")
    ax.set_xticks(np.arange(len(shapes)))
    ax.set_xticklabels([f"{n}x{k}" + ("\n(DRAM)" if s in BIG or s == (49152, 576) else "")
                        for s in shapes for n, k in [s]], fontsize=8)
    ax.set_ylabel("GB/s of packed weights")
    ax.set_title(f"int4 ({fmt}) GEMV, 1 row, all cores: VNNI int8 activations vs fp32 kernel vs numpy")
    ax.legend(fontsize=8, ncol=3)


if __name__ == "__main__":
    raise SystemExit(main())
