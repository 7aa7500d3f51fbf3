"""Registers and spills of every CUDA kernel of a model, for sm_80 and sm_90a (nvcc ``-Xptxas -v``).

    python benchmarks/ptxas_table.py [--model smollm2-135m] [--targets cuda-sm80 cuda-sm90]
        [--csv benchmarks/results/ptxas_sm80_sm90a.csv] [--work DIR]

Builds the model for each CUDA target with ``perfx-compile``'s pipeline (the bundle keeps
``kernels.<arch>.ptxas.txt``; needs nvcc, no GPU), parses the ptxas log and writes one CSV row per
(target, kernel): registers, spill stores/loads, stack frame, shared memory, and whether the kernel is
a hot one (GEMM/GEMV/attention: names with matmul, gemv or attention) or a CPU kernel run as-is on the
device (``device_code.adapted_cpu_kernels`` in the manifest). Exits 1 when a hot kernel spills.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HOT = ("matmul", "attention", "gemv")
FIELDS = ["model", "quantization", "target", "arch", "kernel", "hot", "adapted_cpu_kernel", "registers",
          "spill_stores", "spill_loads", "stack_bytes", "shared_bytes"]  # fmt: skip


def kernel_rows(model: str, target: str, out: Path) -> list[dict[str, object]]:
    from perfx_compiler.pipeline import compile_model
    from perfx_compiler.targets_exec.toolchains import parse_ptxas

    if not (out / "perfx-config.json").exists():
        start = time.perf_counter()
        compile_model(model, target, out, progress=False)
        print(f"{target}: built {model} in {time.perf_counter() - start:.0f} s -> {out}", flush=True)
    manifest = json.loads((out / "perfx-config.json").read_text())
    facts = manifest["device_code"]["cubin"]
    if "error" in facts:
        raise SystemExit(f"{target}: no cubin: {facts['error']}")
    adapted = manifest["device_code"].get("adapted_cpu_kernels", [])
    stats = parse_ptxas((out / f"kernels.{facts['arch']}.ptxas.txt").read_text())
    rows = []
    for name, st in sorted(stats.items()):
        rows.append({
            "model": model, "quantization": manifest.get("quantization", ""), "target": target,
            "arch": facts["arch"], "kernel": name, "hot": any(h in name for h in HOT),
            "adapted_cpu_kernel": any(name.startswith(a) for a in adapted), **st,
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--targets", nargs="+", default=["cuda-sm80", "cuda-sm90"])
    ap.add_argument("--csv", type=Path, default=Path(__file__).parent / "results" / "ptxas_sm80_sm90a.csv")
    ap.add_argument("--work", type=Path, default=Path("/tmp/perfx-ptxas"))
    args = ap.parse_args(argv)
    rows: list[dict[str, object]] = []
    for target in args.targets:
        rows += kernel_rows(args.model, target, args.work / target)
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with args.csv.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r[k] for k in FIELDS})
    bad = [r for r in rows if r["hot"] and (r["spill_stores"] or r["spill_loads"])]
    for target in args.targets:
        mine = [r for r in rows if r["target"] == target]
        spills = [r["kernel"] for r in mine if r["spill_stores"] or r["spill_loads"]]
        hot = [r for r in mine if r["hot"]]
        print(f"{target}: {len(mine)} kernels, {len(hot)} hot (max {max(int(r['registers']) for r in hot)} registers), "
              f"spilling: {spills or 'none'}")  # fmt: skip
    print(f"wrote {args.csv}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
