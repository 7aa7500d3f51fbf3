"""CPU kernel benchmarks: PerfX's templates against numpy/OpenBLAS (and TVM dlight), one kernel at a time.

``gemm``: the prefill GEMMs of SmolLM2-135M as the compiler builds them (weights pre-packed into
[N / nb, K, nb] panels by the weight_layout pass, symbolic M), at M = 16, 64, 128, 512 rows, for qkv
(576 -> 960), o_proj (576 -> 576), gate_up (576 -> 3072), down_proj (1536 -> 576) and the
full-sequence lm_head (576 -> 49152):
  ours_tuned    PerfX gemm_cpu, best of a small search per case (records in
                tuning_logs/<target>/kernels_cpu.jsonl; a rerun reuses them)
  ours_default  gemm_cpu's default configuration
  numpy         x @ W.T, OpenBLAS with 2 threads (OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE are dropped for
                this process so that OpenBLAS picks its kernel for this CPU; the CSV names it), and
                pinned to 1 thread; ratios use the faster of the two
  dlight        TVM dlight's CPU rules on the unpacked NT matmul (no CPU GEMM rule exists:
                "unscheduled"; cases above 2 GFLOP are not timed)
Every variant is timed in alternated rounds (one burst of each per round, the burst's median); the
reported time is the median over rounds. Writes benchmarks/results/kernels_cpu_prefill.csv and .png.

``gemv``: the int4 decode GEMV (one row of x), GB/s of the weight stream against the machine's read
bandwidth, variants alternated per round (medians of each round's best; the probe runs every round):
  vnni      schedules/gemv_qvnni_cpu.py: int8 activations, vpdpbusd (default config)
  vnni_alt  the same template with the other split/hinib pair
  vnni_cold (``--cold-tuned``) the fastest of split x hinib x sprefetch timed as the tuner times
            decode GEMVs (tune/measure.py time_module cold=True)
  fp32      schedules/gemv_int4_cpu.py: fp32 activations, unpack + convert + FMA (default config)
  numpy     dequantize the int4 codes, then matvec (OpenBLAS)
  numpy_f32 numpy matvec on the already dequantized float32 W (4x the bytes; GB/s on its own bytes)
GB/s = packed weight bytes (codes + scales + mins) / seconds; each call takes the next of several
weight copies (>= 3x the L3 in all), so weights come from DRAM. Writes benchmarks/results/gemv_int4.csv
and .png.

``ggml``: PerfX's VNNI kernels against llama.cpp's own ggml kernels on the same GGUF blocks (issue #25:
kernels >= 1.0x ggml), for every GGUF type PerfX runs as blocks (``GGML_QTYPES``) at TinyLlama-1.1B's shapes (attn 2048x2048, kv
256x2048, gate_up 5632x2048, down 2048x5632, lm_head 32000x2048; N x K), 1 activation row (decode:
gemv_qvnni_cpu) and 512 (prefill: gemm_qvnni_cpu, symbolic M), both sides quantizing the f32 activations
to int8 inside the timed call. ggml: ``ggml_mul_mat`` through ctypes on llama-cpp-python's libggml
(perfx_compiler/bench/ggml_mul_mat.py), 2 threads; for Q4_0, Q4_K, IQ4_NL (and Q2_K on AVX-512) the weights sit
in ggml's CPU_REPACK buffer as llama.cpp loads them on x86 (``ggml_kernel`` = repack; the plain vec_dot time is ``ggml_plain_ms``).
Random blocks; both outputs are checked against float64 (gguf-py's dequantize @ x) before timing. Decode
calls rotate over weight copies (>= 2x the L3 Linux reports, per variant) so weights come from DRAM;
variants alternate per round; ratio = median over rounds of ggml time / PerfX time (> 1: PerfX faster). Writes
benchmarks/results/<machine>/kernels_vs_ggml.csv and .png (``intel-xeon``, ``amd-epyc``). Needs an idle
machine: with more runnable threads than cores, ggml's OpenMP calls stall for milliseconds.

    python benchmarks/kernels.py gemm [--trials 8] [--rounds 5] [--ms 16,64,128,512] [--kernels qkv,o_proj]
    python benchmarks/kernels.py gemv [--format Q4_1|Q4_0] [--rounds 5] [--shapes 4096x4096] [--quick]
    python benchmarks/kernels.py ggml [--types Q4_K,Q8_0] [--shapes kv,down] [--rows 1,512] [--rounds 5] [--quick]

Decode speed of whole models per activation type is an A/B of two builds:
``benchmarks/ab.py --compile smollm2-135m "--activations f32" "--activations int8" --labels f32,int8``.

``quantize``: float weights to Q4_K / Q5_K / Q6_K (``--quantization q4_k`` / ``q5_k`` / ``q6_k``), PerfX's quantizers (the compiled
searches, and the numpy references on ``--numpy-shapes``) against llama.cpp's ``ggml_quantize_chunk`` on the same
random weights at TinyLlama-1.1B's shapes, the rows on as many threads each; the blocks are compared byte for
byte. Writes benchmarks/results/<machine>/kernels_quantize.csv and .png (benchmarks/_kernels_quantize.py).

    python benchmarks/kernels.py quantize [--types Q4_K,Q6_K] [--shapes attn,gate_up,lm_head] [--rounds 3]

``bytes``: artifact bytes against GGUF file bytes per block type and weight layout (issue #25: <= 1.03x),
no timing (the bytes depend only on the layouts). Each type's random blocks (``random_blocks``) at
TinyLlama-1.1B's down projection (2048 x 5632) go through the GGUF passthrough's own packing
(``passes/gguf_passthrough._pack``) into each layout a compile can choose: int8_act (x86 with AVX-512
VNNI), float_act (CPUs without it: ARM, RISC-V, older x86), gpu (buffers), and adreno_images (Adreno's
texture path, ``passes/texture_weights.py``: the types it keeps as images; the others stay buffers, the gpu
layout). Writes benchmarks/results/format_bytes.csv and .png.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# Before numpy loads OpenBLAS: 2 threads on both sides, and OpenBLAS's own kernel choice.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "2")
os.environ.setdefault("TVM_NUM_THREADS", "2")
if "--keep-openblas-env" not in sys.argv:
    os.environ.pop("OPENBLAS_CORETYPE", None)
    os.environ.pop("OPENBLAS_L2_SIZE", None)

import numpy as np  # noqa: E402
from _common import L3_BYTES, RESULTS, figure, write_csv  # noqa: E402
from _kernels_bytes import bytes_main  # noqa: E402
from _kernels_ggml import GGML_QTYPES, TINYLLAMA, ggml_main  # noqa: E402
from _kernels_quantize import add_parser as add_quantize_parser  # noqa: E402
from _kernels_quantize import quantize_main  # noqa: E402

from perfx_compiler.bench.machine import read_bandwidth  # noqa: E402
from perfx_compiler.formats.gguf_blocks import Q4_0, Q4_1  # noqa: E402
from perfx_compiler.formats.int4 import int4_packed  # noqa: E402
from perfx_compiler.schedule_template import find_template  # noqa: E402
from perfx_compiler.targets import load_target  # noqa: E402
from perfx_compiler.tune.measure import _to_arg, build_func, configure_threads, random_inputs  # noqa: E402
from perfx_compiler.tune.workloads import linear_module, matmul_func, packed_linear_func  # noqa: E402

# -- gemm: prefill linears -------------------------------------------------------------------------

PREFILL_LINEARS = {  # name -> (K, N) after merge_projections (q|k|v and gate|up merged)
    "qkv": (576, 960),
    "o_proj": (576, 576),
    "gate_up": (576, 3072),
    "down_proj": (1536, 576),
    "lm_head": (576, 49152),  # prefill_all: logits for every position
}
DLIGHT_FLOP_LIMIT = 2e9  # unscheduled (dlight has no CPU GEMM rule): larger cases take minutes
BURST_S = 0.15  # one variant's burst per round: calls until this long (3..50 calls)


def _tvm_burst(rt: Any, func: Any, m: int, max_calls: int = 50) -> Any:
    import tvm

    dev = tvm.cpu()
    args = [_to_arg(a, dev) for a in random_inputs(func, m, seed=1)]
    one = min(rt.time_evaluator("main", dev, number=1, repeat=2)(*args).results)
    calls = int(min(max_calls, max(3, BURST_S / max(one, 1e-7))))
    if one > 1.0:
        calls = 1
    return lambda: statistics.median(rt.time_evaluator("main", dev, number=1, repeat=calls)(*args).results)


def _numpy_burst(fn: Any) -> Any:
    import time

    fn()

    def burst() -> float:
        times: list[float] = []
        deadline = time.perf_counter() + BURST_S
        while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 50):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return burst


def _numpy_one_thread(fn: Any) -> Any:
    """OpenBLAS pinned to one thread: on a shared 2-core host its 2 threads can lose badly to
    preemption (a sleeping worker stalls the whole call), so the baseline is the faster of both."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return _numpy_burst(fn)
    burst = _numpy_burst(fn)

    def one() -> float:
        with threadpool_limits(limits=1, user_api="blas"):
            return burst()

    return one


def _tuned(func: Any, target: Any, m: int, trials: int, db: Any, measurer: Any) -> dict | None:
    from perfx_compiler.tune.cost_model import CostModel
    from perfx_compiler.tune.search import tune_task
    from perfx_compiler.tune.workloads import TuningTask

    template, wl = find_template(func, target)
    task = TuningTask("bench", func, template, wl, m)
    have = len(db.for_workload(wl.key, wl.target_key, task.bucket))
    if trials > have and measurer is not None:
        model = CostModel()
        model.add_records(db.records(), {wl.key: wl})
        model.fit()
        tune_task(task, target, db, measurer, model, trials=trials - have, batch=4)
    best = db.best(wl.key, wl.target_key, bucket=m)
    return None if best is None else best.config


def _dlight(func: Any, target: Any) -> tuple[Any, str]:
    import tvm
    from tvm.s_tir import dlight as dl

    with target.tvm():
        out = dl.ApplyDefaultSchedule(dl.cpu.GEMV(), dl.cpu.Reduction())(tvm.IRModule({"main": func}))["main"]
    return out, ("dlight" if out.attrs is not None and "tirx.is_scheduled" in out.attrs else "unscheduled")


def _blas_kernel() -> str:
    try:
        from threadpoolctl import threadpool_info

        info = [i for i in threadpool_info() if i.get("internal_api") == "openblas"]
        return f"{info[0].get('architecture')}x{info[0].get('num_threads')}" if info else "?"
    except ImportError:
        return "?"


def gemm_main(args: Any) -> None:
    from perfx_compiler.tune.measure import LocalMeasurer
    from perfx_compiler.tune.records import TuningDatabase
    from schedules._matmul import panel_width

    target = load_target(args.target)
    print(f"TVM threads: {configure_threads(target.cores)}, OpenBLAS: {_blas_kernel()}", flush=True)
    nb = panel_width(target)
    ms = [int(v) for v in args.ms.split(",") if v.strip()]
    names = args.kernels.split(",") if args.kernels else list(PREFILL_LINEARS)
    db = TuningDatabase.for_target(target.name, name="kernels_cpu")
    measurer = LocalMeasurer(target, repeat=3, min_repeat_ms=10) if args.trials else None
    rng = np.random.default_rng(0)
    rows = []
    for name in names:
        K, N = PREFILL_LINEARS[name]
        func = packed_linear_func(None, K, N, nb)
        nt_func = matmul_func(linear_module(None, K, N, None, True))
        template, wl = find_template(func, target)
        default = template.default_config(wl, target)
        rt_default = build_func(template.apply(func, wl, default, target), target)
        dl_func, dl_kind = _dlight(nt_func, target)
        rt_dlight = build_func(dl_func, target)
        w = rng.standard_normal((N, K)).astype(np.float32)
        for m in ms:
            flops = 2.0 * m * N * K
            x = rng.standard_normal((m, K)).astype(np.float32)
            cfg = _tuned(func, target, m, args.trials, db, measurer) if args.trials else None
            timers: dict[str, Any] = {"ours_default_us": _tvm_burst(rt_default, func, m)}
            if cfg is not None and cfg != default:
                timers["ours_tuned_us"] = _tvm_burst(build_func(template.apply(func, wl, cfg, target), target), func, m)
            timers["numpy_us"] = _numpy_burst(lambda x=x, w=w: x @ w.T)
            timers["numpy_1t_us"] = _numpy_one_thread(lambda x=x, w=w: x @ w.T)
            if dl_kind == "dlight" or flops <= DLIGHT_FLOP_LIMIT:
                timers["dlight_us"] = _tvm_burst(rt_dlight, nt_func, m, max_calls=5)
            samples: dict[str, list[float]] = {k: [] for k in timers}
            for r in range(args.rounds):  # alternated: every variant once per round
                for key, timer in timers.items():
                    if key == "dlight_us" and dl_kind == "unscheduled" and r >= 2:
                        continue  # seconds per call: two rounds are enough
                    samples[key].append(timer())
            med = {k: statistics.median(v) for k, v in samples.items()}
            tuned = med.get("ours_tuned_us", med["ours_default_us"])  # the default won the search
            blas = min(med["numpy_us"], med["numpy_1t_us"])
            row = {
                "kernel": name, "K": K, "N": N, "M": m, "nb": nb,
                "ours_tuned_us": tuned * 1e6,
                "ours_default_us": med["ours_default_us"] * 1e6,
                "numpy_us": med["numpy_us"] * 1e6,
                "numpy_1t_us": med["numpy_1t_us"] * 1e6,
                "dlight_us": med.get("dlight_us", math.nan) * 1e6,
                "dlight_kind": dl_kind if "dlight_us" in med else f"{dl_kind} (not timed: > {DLIGHT_FLOP_LIMIT:.0e} flop)",
                "ours_gflops": flops / tuned / 1e9,
                "numpy_gflops": flops / blas / 1e9,
                "tuned_vs_numpy": blas / tuned,
                "tuned_vs_dlight": med.get("dlight_us", math.nan) / tuned,
                "tuned_config": cfg or default,
                "rounds": args.rounds,
                "openblas": _blas_kernel(),
                "load_avg_1m": os.getloadavg()[0],
            }
            rows.append(row)
            print(f"{name:>9} M={m:<4} tuned {row['ours_tuned_us']:9.1f} us ({row['ours_gflops']:5.0f} GF/s)  "
                  f"default {row['ours_default_us']:9.1f}  numpy {row['numpy_us']:9.1f} / 1t {row['numpy_1t_us']:9.1f} "
                  f"({row['numpy_gflops']:5.0f} GF/s)  "
                  f"{dl_kind} {row['dlight_us']:11.1f}  -> {row['tuned_vs_numpy']:.2f}x numpy, "
                  f"{row['tuned_vs_dlight']:.1f}x dlight  (load {row['load_avg_1m']:.1f})", flush=True)
    if measurer is not None:
        measurer.close()
    out = write_csv(args.out or RESULTS / "kernels_cpu_prefill.csv", rows, floats=".2f")
    vs_np = [r["tuned_vs_numpy"] for r in rows]
    vs_dl = [r["tuned_vs_dlight"] for r in rows if not math.isnan(r["tuned_vs_dlight"])]
    print(f"median tuned vs numpy: {statistics.median(vs_np):.2f}x over {len(vs_np)} cases "
          f"(min {min(vs_np):.2f}x); median tuned vs dlight: "
          f"{statistics.median(vs_dl) if vs_dl else math.nan:.1f}x over {len(vs_dl)} timed cases")
    plot_prefill(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot_prefill(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    labels = [f"{r['kernel']}\nM={r['M']}" for r in rows]
    x = np.arange(len(rows))
    with figure(path, 2, 1, figsize=(max(10, len(rows) * 0.6), 8)) as (_fig, (ax1, ax2)):
        ax1.bar(x - 0.2, [r["ours_gflops"] for r in rows], 0.4, label="PerfX gemm_cpu (tuned, packed weights)")
        ax1.bar(x + 0.2, [r["numpy_gflops"] for r in rows], 0.4,
                label=f"numpy / OpenBLAS ({rows[0]['openblas']}; faster of 2 threads and 1)")
        ax1.set_ylabel("GFLOP/s (median of alternated rounds)")
        ax1.set_xticks(x)
        ax1.set_xticklabels(labels, fontsize=7)
        ax1.legend(fontsize=8)
        ax1.set_title("SmolLM2-135M prefill GEMMs on this CPU (2 threads each)")
        ax2.bar(x - 0.2, [r["tuned_vs_numpy"] for r in rows], 0.4, label="tuned / numpy")
        ax2.bar(x + 0.2, [0 if math.isnan(r["tuned_vs_dlight"]) else r["tuned_vs_dlight"] for r in rows], 0.4,
                label="tuned / TVM dlight default (0: not timed)")
        ax2.axhline(1.0, color="k", lw=0.8)
        ax2.set_yscale("log")
        ax2.set_ylabel("speed-up (x)")
        ax2.set_xticks(x)
        ax2.set_xticklabels(labels, fontsize=7)
        ax2.legend(fontsize=8)

# -- gemv: int4 decode GEMVs ------------------------------------------------------------------------

BIG = [(11008, 4096), (4096, 11008), (4096, 4096)]
SMOL = [(3072, 576), (576, 1536), (960, 576), (576, 576), (49152, 576)]
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


def gemv_main(args: argparse.Namespace) -> int:
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

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="kind", required=True)
    g = sub.add_parser("gemm", help="prefill GEMMs (float32, packed panels)")
    g.add_argument("--target", default="host")
    g.add_argument("--trials", type=int, default=8, help="search trials per kernel (0: no tuning)")
    g.add_argument("--rounds", type=int, default=5, help="alternated timing rounds")
    g.add_argument("--ms", default="16,64,128,512", help="prefill rows (M) to time")
    g.add_argument("--kernels", default=None, help="comma-separated subset of qkv,o_proj,gate_up,down_proj,lm_head")
    g.add_argument("--keep-openblas-env", action="store_true", help="keep OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE")
    g.add_argument("--out", default=None)
    v = sub.add_parser("gemv", help="int4 decode GEMVs (one activation row)")
    v.add_argument("--format", default="Q4_1", choices=["Q4_1", "Q4_0"])
    v.add_argument("--rounds", type=int, default=5)
    v.add_argument("--threads", type=int, default=2, help="threads of the bandwidth probe (the kernels use all cores)")
    v.add_argument("--quick", action="store_true", help="3 rounds, no numpy dequant on the big shapes")
    v.add_argument("--out", default=str(RESULTS / "gemv_int4"))
    v.add_argument("--cold-tuned", action="store_true", help="add vnni_cold (a cold-timed split/hinib/sprefetch grid)")
    v.add_argument("--shapes", default=None, help="comma-separated NxK (default: all)")
    q = sub.add_parser("ggml", help="PerfX's VNNI GEMV/GEMM vs ggml's mul_mat on the same GGUF blocks")
    q.add_argument("--types", default=",".join(GGML_QTYPES))
    q.add_argument("--shapes", default=",".join(TINYLLAMA), help="subset of " + ",".join(TINYLLAMA))
    q.add_argument("--rows", default="1,512", help="activation rows: 1 = decode GEMV, more = prefill GEMM")
    q.add_argument("--rounds", type=int, default=5)
    q.add_argument("--threads", type=int, default=2, help="threads of the bandwidth probe")
    q.add_argument("--quick", action="store_true", help="2 rounds of short bursts (a development run)")
    q.add_argument("--default-configs", action="store_true", help="ignore tuning_logs records")
    q.add_argument("--out", default=None, help="default: results/<machine>/kernels_vs_ggml.csv")
    q.add_argument("--merge", action="store_true",
                   help="replace only the rerun cases (type, shape, rows) in an existing CSV (after one format's kernels changed)")
    by = sub.add_parser("bytes", help="artifact / GGUF file bytes per block type and weight layout (no timing)")
    by.add_argument("--out", default=None, help="default: results/format_bytes.csv")
    add_quantize_parser(sub)
    args = ap.parse_args(argv)
    if args.kind == "quantize":
        return quantize_main(args)
    if args.kind == "bytes":
        return bytes_main(args)
    if args.kind == "ggml":
        return ggml_main(args)
    if args.kind == "gemm":
        gemm_main(args)
        return 0
    return gemv_main(args)



if __name__ == "__main__":
    raise SystemExit(main())
