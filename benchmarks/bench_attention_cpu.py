"""Fused CPU attention, old kernel vs the attention_cpu template, on SmolLM2-135M's attention shape.

9 query heads, 3 kv heads, head_dim 64, a 1024-position cache: prefill of 128 and 512 tokens from
position 0, decode (one token) over a 128- and a 1024-token context. "old" is the kernel as it was
before the template (read from git history, commit OLD_COMMIT); "new" is the template's built-in
default for the kind (prefill / decode), or ``--config`` JSON per kind. Rounds alternate old and new
(the machine is shared: each round times both back to back); the CSV keeps every round's median
and the load average, the summary row per case is the median over rounds.

Two measures, both in the CSV: wall-clock per call with 2 threads, and process CPU time per call
with 1 thread. On a loaded 2-core host (load average > 2) a call longer than a scheduler time slice
is preempted and its wall time multiplies by the load, whichever the kernel; the 1-thread CPU time
is the work the kernel does, and the ratio of those is the speedup to trust there.

    python benchmarks/bench_attention_cpu.py [--rounds 7] [--quick]
writes benchmarks/results/attention_cpu.csv and attention_cpu.png (one subprocess per thread count).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import figure, write_csv

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OLD_COMMIT = "eb3f10b"  # last commit with the per-(head, query) kernel
H, KVH, D, MAXC = 9, 3, 64, 1024
CASES = [("prefill", 128, 0), ("prefill", 512, 0), ("decode", 1, 127), ("decode", 1, 1023)]  # kind, seq, past


def old_kernel() -> object:
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{OLD_COMMIT}:perfx_compiler/kernels/attention.py"],
                         check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "old_attention.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("old_attention", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.cached_attention_kernel(H, KVH, D, MAXC)


def new_kernel(kind: str, target, config: dict | None) -> tuple[object, dict]:
    from perfx_compiler.kernels.attention import untuned_attention_kernel
    from perfx_compiler.schedule_template import template_by_name

    func = untuned_attention_kernel(kind, H, KVH, D, MAXC)
    tmpl = template_by_name("attention_cpu")
    wl = tmpl.match(func, target)
    cfg = config or tmpl.builtin_default(wl, target)
    return tmpl.apply(func, wl, cfg, target), cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="3 rounds")
    ap.add_argument("--config", type=json.loads, default={}, help='{"prefill": {...}, "decode": {...}}')
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/attention_cpu"))
    ap.add_argument("--threads", type=int, default=0, help="internal: run one thread count, print JSON rows")
    args = ap.parse_args()
    rounds = 3 if args.quick else args.rounds
    if not args.threads:
        rows = []
        for threads in (2, 1):
            cmd = [sys.executable, __file__, "--threads", str(threads), "--rounds", str(rounds),
                   "--config", json.dumps(args.config)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                                 env={**os.environ, "TVM_NUM_THREADS": str(threads)}).stdout
            rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        write(rows, Path(args.out))
        return

    import tvm

    from perfx_compiler.stack_alloca import compile_kernel
    from perfx_compiler.targets import load_target

    target = load_target("x86-avx512")
    build = lambda f: compile_kernel(f, target).jit()  # noqa: E731
    libs = {"old": build(old_kernel())}
    configs = {}
    for kind in ("prefill", "decode"):
        func, configs[kind] = new_kernel(kind, target, args.config.get(kind))
        libs[f"new_{kind}"] = build(func)
    dev = tvm.cpu()
    rng = np.random.default_rng(0)
    ang = np.arange(MAXC)[:, None] / 10000.0 ** (np.arange(0, D, 2) / D)[None]
    tables = [np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)]
    rows = []
    for kind, seq, past in CASES:
        arrays = [rng.standard_normal(s).astype(np.float32) for s in
                  ((1, seq, H * D), (1, seq, KVH * D), (1, seq, KVH * D), (1, KVH, MAXC, D), (1, KVH, MAXC, D))]
        arrays += [np.array([past], np.int64), *tables, np.zeros((1, seq, H * D), np.float32)]
        tensors = [tvm.runtime.tensor(a, dev) for a in arrays]
        calls = 5 if seq > 1 else 200
        for r in range(rounds):
            for variant in ("old", "new"):
                lib = libs["old" if variant == "old" else f"new_{kind}"]
                lib["main"](*tensors)  # warm
                cpu0 = time.process_time()
                res = lib.time_evaluator("main", dev, number=1, repeat=calls)(*tensors).results
                cpu = (time.process_time() - cpu0) / calls
                rows.append({"case": f"{kind}{seq if kind == 'prefill' else past + 1}", "kind": kind, "seq": seq,
                             "context": past + seq, "threads": args.threads, "variant": variant, "round": r,
                             "median_ms": round(float(np.median(res)) * 1e3, 4),
                             "min_ms": round(float(np.min(res)) * 1e3, 4), "cpu_ms": round(cpu * 1e3, 4),
                             "config": json.dumps(configs[kind]) if variant == "new" else "per-(head,query) (old)",
                             "loadavg1": round(os.getloadavg()[0], 2), "time": time.strftime("%H:%M:%S")})
            time.sleep(0.2)
    for row in rows:
        print(json.dumps(row), flush=True)


def write(rows: list[dict], out: Path) -> None:
    summary = []
    for case in dict.fromkeys(r["case"] for r in rows):
        s = {"case": case}
        for threads, key in ((2, "median_ms"), (1, "cpu_ms")):
            for v in ("old", "new"):
                vals = [r[key] for r in rows if r["case"] == case and r["variant"] == v and r["threads"] == threads]
                s[f"{v}_{key}_{threads}t"] = round(float(np.median(vals)), 4)
            s[f"speedup_{threads}t"] = round(s[f"old_{key}_{threads}t"] / s[f"new_{key}_{threads}t"], 2)
        summary.append(s)
        print(s)
    out.parent.mkdir(parents=True, exist_ok=True)
    fields = list(rows[0]) + [k for k in summary[0] if k != "case"]
    # summary rows (variant "summary"): medians over rounds
    write_csv(out.with_suffix(".csv"), rows + [{**s, "variant": "summary"} for s in summary], columns=fields)
    plot(summary, out.with_suffix(".png"))


def plot(summary: list[dict], path: Path) -> None:
    with figure(path, 1, 2, figsize=(11, 3.8), dpi=120) as (fig, axes):
        x = np.arange(len(summary))
        for ax, (threads, key, what) in zip(axes, ((2, "median_ms", "wall ms/call, 2 threads"),
                                                  (1, "cpu_ms", "CPU ms/call, 1 thread")), strict=True):
            old = [s[f"old_{key}_{threads}t"] for s in summary]
            new = [s[f"new_{key}_{threads}t"] for s in summary]
            ax.bar(x - 0.2, old, 0.4, label="old kernel")
            ax.bar(x + 0.2, new, 0.4, label="attention_cpu (default config)")
            for i, s in enumerate(summary):
                ax.text(i + 0.2, new[i], f"{s[f'speedup_{threads}t']}x", ha="center", va="bottom", fontsize=8)
            ax.set_xticks(x, [s["case"] for s in summary])
            ax.set_yscale("log")
            ax.set_ylabel(what)
            ax.legend(fontsize=8)
        fig.suptitle("SmolLM2 attention (9 q / 3 kv heads, d 64, cache 1024), shared 2-core host; medians of rounds")


if __name__ == "__main__":
    main()
