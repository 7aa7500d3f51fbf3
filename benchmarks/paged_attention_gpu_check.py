"""GPU paged attention (kernels/paged_attention_gpu.py) before/after the query-tiled prefill: registers
and spills on CUDA sm_80 / sm_90a (nvcc ``-Xptxas -v``) and ROCm gfx942 (assembly metadata), and run
time on lavapipe (vulkan: WGSL via wgpu) and PoCL (mali: OpenCL C), decode and prefill chunks.

    python benchmarks/paged_attention_gpu_check.py [--old REV] [--rounds 5] [--skip-time]

"before" is the kernel file at ``--old`` (``git show``; default the commit before the query-tiled
kernel), "after" the working tree's. Both get the same fresh random inputs; "after" is checked against
a float64 numpy reference (tests/targets/test_paged_attention_gpu.py's) on every timed case, "before"
against "after". Rounds alternate before/after; medians. lavapipe and PoCL run on the host's CPU
cores, so the timings say how much work each kernel does there, not how fast a GPU runs it; the load
average is recorded with every row. Writes benchmarks/results/paged_attention_gpu_regs.csv,
paged_attention_gpu_time.csv and .png.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "targets"))
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
OLD = "fb9f401"
FILE = "perfx_compiler/kernels/paged_attention_gpu.py"
RESULTS = ROOT / "benchmarks" / "results"
# (name, heads, kv heads, head_dim, page size): SmolLM2-135M's attention and a Llama-style 128-dim one
SHAPES = [("smollm2-135m", 9, 3, 64, 16), ("llama-d128", 32, 8, 128, 16)]
MAXC = 1024
# (case, batch, chunk, first position): decode of 4 sequences at ~300 cached tokens; 64- and
# 256-token prefill chunks from position 0 and from mid-sequence
CASES = [("decode", 4, 1, 300), ("prefill", 1, 64, 0), ("prefill", 1, 64, 200), ("prefill", 1, 256, 0)]


def load_old(rev: str) -> Any:
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{FILE}"], check=True, capture_output=True).stdout
    path = Path(tempfile.mkdtemp()) / "paged_attention_gpu_old.py"
    path.write_bytes(src)
    spec = importlib.util.spec_from_file_location("paged_attention_gpu_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def builders(rev: str) -> dict[str, Any]:
    from perfx_compiler.kernels import paged_attention_gpu

    return {"before": load_old(rev).paged_attention_kernel_gpu, "after": paged_attention_gpu.paged_attention_kernel_gpu}


def register_rows(build: dict[str, Any]) -> list[dict[str, Any]]:
    from perfx_compiler.device_export import nvcc_cubin, prepare_build_env
    from perfx_compiler.targets import load_target
    from perfx_compiler.targets_exec.kernels import compile_primfunc
    from perfx_compiler.targets_exec.toolchains import parse_amdgpu_asm

    rows = []
    for shape, h, kvh, d, ps in SHAPES:
        for version, builder in build.items():
            func = builder(h, kvh, d, MAXC, ps)
            for target, arch in (("cuda-sm80", "sm_80"), ("cuda-sm90", "sm_90a"), ("rocm-gfx942", "gfx942")):
                t = load_target(target)
                prepare_build_env(t)
                if target.startswith("rocm") and not os.environ.get("ROCM_PATH"):
                    print(f"{target}: no ROCm toolchain (tests/setup.sh), skipped")
                    continue
                cf = compile_primfunc("paged_attention_gpu", func, t.tvm())
                if target.startswith("cuda"):
                    out = Path(tempfile.mkdtemp())
                    facts = nvcc_cubin(cf.source, arch, out)
                    if "error" in facts:
                        raise SystemExit(f"{target} {version}: {facts['error'][:500]}")
                    stats = {k: (v["registers"], v["spill_stores"] + v["spill_loads"], v["shared_bytes"])
                             for k, v in facts["kernels"].items()}  # fmt: skip
                else:
                    stats = {k: (v["vgpr"], v["scratch_bytes"], v["lds_bytes"])
                             for k, v in parse_amdgpu_asm(cf.runtime_module.inspect_source("asm")).items()}  # fmt: skip
                for kernel, (regs, spill, shared) in sorted(stats.items()):
                    rows.append({"shape": shape, "version": version, "target": target, "arch": arch,
                                 "kernel": kernel, "registers": regs, "spill_or_scratch_bytes": spill,
                                 "shared_bytes": shared})  # fmt: skip
                    print(rows[-1], flush=True)
    return rows


def inputs(rng: np.random.Generator, h: int, kvh: int, d: int, ps: int, batch: int, seq: int, start: int,
           index_dtype: str) -> list[np.ndarray]:  # fmt: skip
    npp = -(-MAXC // ps)
    pages = batch * npp + 3
    table = rng.permutation(pages)[: batch * npp].reshape(batch, npp)
    pos = np.full(batch, start) + rng.integers(0, 8, size=batch) * (seq == 1)
    ang = np.arange(MAXC)[:, None] / 10000.0 ** (np.arange(0, d, 2) / d)[None]
    f32 = np.float32
    return [rng.standard_normal((batch, seq, h * d)).astype(f32), rng.standard_normal((batch, seq, kvh * d)).astype(f32),
            rng.standard_normal((batch, seq, kvh * d)).astype(f32), rng.standard_normal((pages, ps, kvh, d)).astype(f32),
            rng.standard_normal((pages, ps, kvh, d)).astype(f32), pos.astype(index_dtype), table.astype(index_dtype),
            np.cos(ang).astype(f32), np.sin(ang).astype(f32), np.zeros((batch, seq, h * d), f32)]  # fmt: skip


def time_rows(build: dict[str, Any], rounds: int, targets: list[str]) -> list[dict[str, Any]]:
    import tvm
    from test_paged_attention_gpu import paged_reference

    from perfx_compiler.narrow_index import narrow_to_int32
    from perfx_compiler.targets import load_target
    from perfx_compiler.targets_exec.kernels import compile_primfunc
    from perfx_compiler.targets_exec.opencl import OpenCLLauncher
    from perfx_compiler.targets_exec.webgpu import WebGPULauncher

    rows = []
    for target in targets:
        launcher = WebGPULauncher() if target == "vulkan" else OpenCLLauncher()
        index_dtype = "int32" if target == "vulkan" else "int64"
        for shape, h, kvh, d, ps in SHAPES[:1]:  # SmolLM2's shape: the CPU devices are slow
            cfs = {}
            for version, builder in build.items():
                mod = tvm.IRModule({"main": builder(h, kvh, d, MAXC, ps, "float32", index_dtype).with_attr("global_symbol", "main")})
                if index_dtype == "int32":
                    mod = narrow_to_int32(mod)
                cfs[version] = compile_primfunc("paged_attention_gpu", mod["main"], load_target(target).tvm())
            for case, batch, seq, start in CASES:
                rng = np.random.default_rng(0)
                args = inputs(rng, h, kvh, d, ps, batch, seq, start, index_dtype)
                dev = {v: [launcher.to_device(a) for a in args] for v in cfs}
                outs = {}
                for v, cf in cfs.items():  # warm-up (pipeline / program build) and results
                    launcher.run(cf, dev[v])
                    outs[v] = launcher.to_host(dev[v][-1])
                ref = paged_reference(*args[:5], args[5].astype(np.int64), args[6].astype(np.int64), args[7], args[8],
                                      (h, kvh, d, ps))[0]  # fmt: skip
                err = float(np.abs(outs["after"] - ref).max() / max(1.0, np.abs(ref).max()))
                diff = float(np.abs(outs["after"] - outs["before"]).max())
                if err > 2e-5:
                    raise SystemExit(f"{target} {case} seq={seq}: after differs from float64 numpy by {err:.2e}")
                times: dict[str, list[float]] = {v: [] for v in cfs}
                for _ in range(rounds):
                    for v, cf in cfs.items():
                        # the append rewrites the same slots each round: same work every round
                        t0 = time.perf_counter()
                        launcher.run(cf, dev[v])
                        launcher.to_host(dev[v][-1])  # waits for the queue (wgpu submits asynchronously)
                        times[v].append(time.perf_counter() - t0)
                med = {v: float(np.median(t)) * 1e3 for v, t in times.items()}
                row = {"target": target, "shape": shape, "case": case, "batch": batch, "chunk": seq, "start": start,
                       "before_ms": round(med["before"], 3), "after_ms": round(med["after"], 3),
                       "speedup": round(med["before"] / med["after"], 2), "after_err_vs_f64": f"{err:.1e}",
                       "before_after_maxdiff": f"{diff:.1e}", "rounds": rounds,
                       "loadavg_1m": round(os.getloadavg()[0], 2)}  # fmt: skip
                rows.append(row)
                print(row, flush=True)
    return rows


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path}")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['target']}\n{r['case']} {r['batch']}x{r['chunk']}@{r['start']}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4))
    ax.bar(x - 0.2, [r["before_ms"] for r in rows], 0.4, label="before (query loop in a block)")
    ax.bar(x + 0.2, [r["after_ms"] for r in rows], 0.4, label="after (query tiles)")
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("ms (median; CPU-emulated device, host under load)")
    ax.set_title("GPU paged attention, SmolLM2-135M shape")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default=OLD)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--targets", nargs="+", default=["vulkan", "mali"])
    ap.add_argument("--skip-regs", action="store_true")
    ap.add_argument("--skip-time", action="store_true")
    args = ap.parse_args(argv)
    build = builders(args.old)
    RESULTS.mkdir(parents=True, exist_ok=True)
    rc = 0
    if not args.skip_regs:
        regs = register_rows(build)
        write_csv(RESULTS / "paged_attention_gpu_regs.csv", regs)
        spilling = [r for r in regs if r["version"] == "after" and r["spill_or_scratch_bytes"]]
        if spilling:
            print(f"SPILLS: {spilling}")
            rc = 1
    if not args.skip_time:
        rows = time_rows(build, args.rounds, args.targets)
        write_csv(RESULTS / "paged_attention_gpu_time.csv", rows)
        plot(rows, RESULTS / "paged_attention_gpu_time.png")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
