"""Peak memory and time of compiling a GGUF (one fresh process per model), appended to a CSV.

    python benchmarks/compile_memory.py /tmp/perfx-bench/models/llama2-7b-random.Q4_0-pure.gguf \
        --name llama2-7b-q4_0

Compiles exactly as ``perfx-bench`` does (same work folder and stamp, so the bench reuses the
artifact) and records: peak RSS of the process (ru_maxrss; memory-mapped file pages that were
read count in it), the GGUF size, whether the weights were loaded lazily, per-phase seconds, the
1-minute load average before and after (the machine is shared), into
benchmarks/results/compile_memory.csv.
"""

from __future__ import annotations

import argparse
import csv
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf")
    p.add_argument("--name", default=None)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "perfx-bench"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compile_memory.csv"))
    args = p.parse_args(argv)

    from perfx_compiler.bench.models import build_stamp, model_key
    from perfx_compiler.model.lazy import is_lazy
    from perfx_compiler.model.loader import load_model
    from perfx_compiler.pipeline import CompileState, compile_model

    path = Path(args.gguf).resolve()
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    desc = load_model(str(path), max_context=args.max_context)
    lazy = any(is_lazy(w) for w in desc.weights.values())
    t_load = time.perf_counter() - t0
    rss_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    q = "gguf"
    out = Path(args.work) / f"perfx-{model_key(path)}-{q}-ctx{args.max_context}"
    timings: dict[str, float] = {}
    orig_init = CompileState.__init__

    def keep(self: CompileState, *a: object, **k: object) -> None:  # read the phase timings back
        orig_init(self, *a, **k)
        timings_ref.append(self.timings)

    timings_ref: list[dict[str, float]] = []
    CompileState.__init__ = keep  # type: ignore[method-assign]
    t1 = time.perf_counter()
    compile_model(desc, "host", out, progress=True, quantization=q, max_context=args.max_context)
    total = time.perf_counter() - t1
    (out / ".bench-stamp").write_text(build_stamp(path, q, args.max_context))  # the stamp perfx-bench checks
    timings = timings_ref[-1] if timings_ref else {}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    weights_mb = (out / "weights.bin").stat().st_size / 2**20
    row = {
        "model": args.name or model_key(path),
        "gguf_mb": f"{path.stat().st_size / 2**20:.0f}",
        "lazy": lazy,
        "params_m": f"{desc.parameter_count() / 1e6:.0f}",
        "fp32_weights_mb": f"{sum(w.nbytes for w in desc.weights.values()) / 2**20:.0f}",
        "weights_bin_mb": f"{weights_mb:.0f}",
        "peak_rss_after_load_mb": f"{rss_load:.0f}",
        "peak_rss_mb": f"{peak:.0f}",
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
    print(" ".join(f"{k}={v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
