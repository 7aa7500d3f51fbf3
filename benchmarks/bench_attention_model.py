"""Whole-model prefill before/after the attention_cpu template: SmolLM2-135M (the shipped GGUF,
default quantization), 512-token prefill (and 128), tokens/s.

"after" is the tree at NEW (default HEAD), "before" the same tree with the attention kernels and
their import converter as they were at OLD_COMMIT (the per-(head, query) kernel), so only the
attention differs; each is exported with ``git archive`` and compiled by its own code in a
subprocess (``perfx-compile smollm2-135m --target host``). Both artifacts are then loaded here (the
runtime imports no compiler code) and timed alternately: every round runs a fresh prefill of the
same random prompt on each, medians over rounds. Wall time and process CPU time are recorded (on
a loaded shared host the wall time of a long call grows with the load; see bench_attention_cpu.py).

    python benchmarks/bench_attention_model.py [--rounds 7] [--new REV]
writes benchmarks/results/attention_model_prefill.csv and .png. With TVM_NUM_THREADS=1 and
``--out benchmarks/results/attention_model_prefill_1t`` the process CPU time is the work done (no
spinning worker threads), the figure to compare on a loaded host.
"""

from __future__ import annotations

import argparse
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
os.environ.setdefault("TVM_NUM_THREADS", "2")
OLD_COMMIT = "eb3f10b"


OLD_FILES = ("perfx_compiler/kernels/attention.py", "perfx_compiler/kernels/paged_attention.py",
             "perfx_compiler/frontend/perfx_ops.py")


def compile_at(rev: str, work: Path, max_context: int, old_attention: bool) -> Path:
    tag = f"{rev}-{'old' if old_attention else 'new'}-attention"
    src = work / f"src-{tag}"
    art = work / f"art-{tag}"
    if (art / "model.so").exists():
        return art
    src.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    if old_attention:
        for f in OLD_FILES:
            old = subprocess.run(["git", "-C", str(ROOT), "show", f"{OLD_COMMIT}:{f}"], check=True,
                                 capture_output=True).stdout
            (src / f).write_bytes(old)
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, "-c", "from perfx_compiler.cli.compile import main; main()", "smollm2-135m",
           "--target", "host", "-o", str(art), "--max-context", str(max_context)]
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=src, env=env)
    print(f"compiled {tag} in {time.time() - t0:.0f} s", flush=True)
    return art


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--new", default="HEAD")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "perfx-attn-model"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/attention_model_prefill"))
    args = ap.parse_args()
    work = Path(args.work)
    new_rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.new], check=True,
                             capture_output=True, text=True).stdout.strip()
    arts = {"before": compile_at(new_rev, work, 1024, True), "after": compile_at(new_rev, work, 1024, False)}

    from perfx_compiler.runtime.engine import Engine

    engines = {k: Engine(v) for k, v in arts.items()}
    rng = np.random.default_rng(0)
    rows = []
    for n in (128, 512):
        ids = rng.integers(100, 40000, size=n).tolist()
        for eng in engines.values():  # warm, and the two agree on the next token
            eng.reset()
            eng.prefill(ids)
        for r in range(args.rounds):
            for name, eng in engines.items():
                eng.reset()
                c0, t0 = time.process_time(), time.perf_counter()
                logits = eng.prefill(ids)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                rows.append({"variant": name, "rev": new_rev, "attention": "old" if name == "before" else "new",
                             "threads": int(os.environ["TVM_NUM_THREADS"]), "tokens": n,
                             "round": r, "wall_s": round(wall, 4), "cpu_s": round(cpu, 4),
                             "tok_s": round(n / wall, 1), "argmax": int(np.argmax(logits)),
                             "loadavg1": round(os.getloadavg()[0], 2), "time": time.strftime("%H:%M:%S")})
                time.sleep(0.3)
            print(rows[-2], rows[-1], flush=True)
    summary = []
    for n in (128, 512):
        s = {"tokens": n}
        for name in engines:
            sel = [r for r in rows if r["tokens"] == n and r["variant"] == name]
            s[f"{name}_tok_s"] = round(float(np.median([r["tok_s"] for r in sel])), 1)
            s[f"{name}_cpu_s"] = round(float(np.median([r["cpu_s"] for r in sel])), 4)
        s["speedup_wall"] = round(s["after_tok_s"] / s["before_tok_s"], 2)
        summary.append(s)
        print(s, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(out.with_suffix(".csv"), rows + [{**s, "variant": "summary"} for s in summary],
              columns=list(rows[0]) + [k for k in summary[0] if k != "tokens"])
    plot(summary, out.with_suffix(".png"))


def plot(summary: list[dict], path: Path) -> None:
    with figure(path, figsize=(6, 3.5), dpi=120) as (fig, ax):
        x = np.arange(len(summary))
        ax.bar(x - 0.2, [s["before_tok_s"] for s in summary], 0.4, label=f"old attention kernel ({OLD_COMMIT})")
        ax.bar(x + 0.2, [s["after_tok_s"] for s in summary], 0.4, label="after (attention_cpu)")
        for i, s in enumerate(summary):
            ax.text(i + 0.2, s["after_tok_s"], f"{s['speedup_wall']}x", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, [f"prefill {s['tokens']}" for s in summary])
        ax.set_ylabel("tokens/s (median of rounds)")
        ax.set_title(f"SmolLM2-135M prefill, {os.environ['TVM_NUM_THREADS']} thread(s), shared host")
        ax.legend(fontsize=8)


if __name__ == "__main__":
    main()
