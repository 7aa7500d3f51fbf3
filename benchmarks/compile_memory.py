"""Peak memory and time of compiling a GGUF (one fresh process per model), appended to a CSV.

    python benchmarks/compile_memory.py /tmp/perfx-bench/models/llama2-7b-random.Q4_0-pure.gguf \
        --name llama2-7b-q4_0
    python benchmarks/compile_memory.py /tmp/perfx-bench/models/tinyllama-1.1b-random.F16.gguf \
        --name tinyllama-f16-q4_k --quantization q4_k

Compiles exactly as ``perfx-bench`` does (same work folder and stamp, so the bench reuses the
artifact) and records: peak RSS of the process (ru_maxrss; memory-mapped file pages that were
read count in it), the GGUF size, whether the weights were loaded lazily, per-phase seconds, the
1-minute load average before and after (the machine is shared), into
benchmarks/results/compile_memory.csv. A thread samples /proc/self/status every 5 ms, so each step
(``import_tvm``: the process with TVM and PerfX imported; ``load``: reading the GGUF and its tokenizer;
then each compile phase) gets its own peak RSS, and the overall peak is split into anonymous memory
(heap, packed arrays) and file pages (the mapped GGUF and weights file).
"""

from __future__ import annotations

import argparse
import csv
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class RssSampler(threading.Thread):
    """The largest VmRSS seen while each step ran (with its RssAnon / RssFile split at that moment)."""

    def __init__(self, period_s: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.period_s = period_s
        self.step = "start"
        self.peaks: dict[str, tuple[int, int, int]] = {}  # step -> (rss, anon, file) in kB
        self._halt = threading.Event()

    @staticmethod
    def sample() -> tuple[int, int, int]:
        fields = {}
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "RssAnon:", "RssFile:", "RssShmem:")):
                    key, value = line.split(":")
                    fields[key] = int(value.split()[0])
        return fields.get("VmRSS", 0), fields.get("RssAnon", 0), fields.get("RssFile", 0) + fields.get("RssShmem", 0)

    def enter(self, step: str) -> None:
        self.record()
        self.step = step

    def record(self) -> None:
        now = self.sample()
        if now[0] > self.peaks.get(self.step, (0, 0, 0))[0]:
            self.peaks[self.step] = now

    def run(self) -> None:
        while not self._halt.wait(self.period_s):
            self.record()

    def stop(self) -> None:
        self._halt.set()
        self.join()
        self.record()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf")
    p.add_argument("--name", default=None)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--quantization", default="gguf", help="gguf (the file's blocks), or a PerfX scheme for float "
                   "files: q4_k, q8, q4_g128, ...")
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "perfx-bench"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compile_memory.csv"))
    args = p.parse_args(argv)
    sampler = RssSampler()
    if Path("/proc/self/status").is_file():
        sampler.start()
    sampler.enter("import_tvm")
    import perfx_compiler.tvm_compiler  # noqa: F401  (TVM as the compiler imports it: the floor of every compile)
    from perfx_compiler import pipeline
    from perfx_compiler.bench.models import build_stamp, model_key
    from perfx_compiler.model.lazy import is_lazy
    from perfx_compiler.model.loader import load_model
    from perfx_compiler.pipeline import CompileState, compile_model

    path = Path(args.gguf).resolve()
    load0 = os.getloadavg()[0]
    sampler.enter("load")
    t0 = time.perf_counter()
    desc = load_model(str(path), max_context=args.max_context)
    lazy = any(is_lazy(w) for w in desc.weights.values())
    t_load = time.perf_counter() - t0
    rss_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    q = args.quantization
    out = Path(args.work) / f"perfx-{model_key(path)}-{q}-ctx{args.max_context}"
    timings: dict[str, float] = {}
    orig_init = CompileState.__init__

    def keep(self: CompileState, *a: object, **k: object) -> None:  # read the phase timings back
        orig_init(self, *a, **k)
        timings_ref.append(self.timings)

    timings_ref: list[dict[str, float]] = []
    CompileState.__init__ = keep  # type: ignore[method-assign]

    def entering(name: str, fn: object) -> object:
        def phase(state: CompileState) -> None:
            sampler.enter(name)
            fn(state)  # type: ignore[operator]

        return phase

    pipeline.PHASES[:] = [(name, entering(name, fn)) for name, fn in pipeline.PHASES]
    t1 = time.perf_counter()
    compile_model(desc, "host", out, progress=True, quantization=q, max_context=args.max_context)
    total = time.perf_counter() - t1
    if sampler.is_alive():
        sampler.stop()
    top = max(sampler.peaks, key=lambda k: sampler.peaks[k][0]) if sampler.peaks else ""
    (out / ".bench-stamp").write_text(build_stamp(path, q, args.max_context))  # the stamp perfx-bench checks
    timings = timings_ref[-1] if timings_ref else {}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    weights_mb = (out / "weights.bin").stat().st_size / 2**20
    row = {
        "model": args.name or model_key(path),
        "quantization": q,
        "gguf_mb": f"{path.stat().st_size / 2**20:.0f}",
        "lazy": lazy,
        "params_m": f"{desc.parameter_count() / 1e6:.0f}",
        "fp32_weights_mb": f"{sum(w.nbytes for w in desc.weights.values()) / 2**20:.0f}",
        "weights_bin_mb": f"{weights_mb:.0f}",
        "peak_rss_after_load_mb": f"{rss_load:.0f}",
        "peak_rss_mb": f"{peak:.0f}",
        **{f"peak_rss_{k}_mb": f"{v[0] / 1024:.0f}" for k, v in sampler.peaks.items() if k != "start"},
        "peak_step": top,
        "peak_anon_mb": f"{sampler.peaks[top][1] / 1024:.0f}" if top else "",
        "peak_file_mb": f"{sampler.peaks[top][2] / 1024:.0f}" if top else "",
        "load_s": f"{t_load:.1f}",
        "compile_s": f"{total:.1f}",
        **{f"{k}_s": f"{v:.1f}" for k, v in timings.items()},
        "load_avg_before": f"{load0:.2f}",
        "load_avg_after": f"{os.getloadavg()[0]:.2f}",
        "machine_mem_gb": f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.1f}",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    dst = Path(args.out)
    dst.parent.mkdir(parents=True, exist_ok=True)
    rows = list(csv.DictReader(dst.open())) if dst.is_file() else []
    rows = [r for r in rows if r.get("model") != row["model"]] + [{k: str(v) for k, v in row.items()}]
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with dst.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    plot(rows, dst.with_suffix(".png"))
    print(" ".join(f"{k}={v}" for k, v in row.items()))
    return 0


STEPS = ["import_tvm", "load", "import", "passes", "lower", "schedule", "build", "package"]


def plot(rows: list[dict[str, str]], path: Path) -> None:
    """Each model's peak RSS per step (import TVM, load, then each compile phase) as a multiple of its GGUF's
    size, the issue's 2x line drawn across: where each compile's memory goes, and which step sets its peak."""
    from _common import figure

    rows = [r for r in rows if r.get("peak_rss_passes_mb")]  # (rows written before the per-step columns: none)
    if not rows:
        return
    with figure(path, figsize=(11, 4.5)) as (_, ax):
        for r in rows:
            gguf = float(r["gguf_mb"])
            ys = [float(r[f"peak_rss_{s}_mb"]) / gguf if r.get(f"peak_rss_{s}_mb") else float("nan") for s in STEPS]
            ax.plot(STEPS, ys, marker="o", label=f"{r['model']} ({gguf:.0f} MB file, peak {float(r['peak_rss_mb']):.0f} MB)")
        ax.axhline(2.0, color="grey", linestyle="--", linewidth=1, label="2x the file")
        ax.set_yscale("log")
        ax.set_ylabel("peak RSS in the step / GGUF size")
        ax.set_title("perfx-compile memory per step (benchmarks/compile_memory.py)")
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))


if __name__ == "__main__":
    sys.exit(main())
