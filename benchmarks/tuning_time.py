"""Tuning and rebuild wall time for the default model (issue #3: tune <= 20 min, rebuild <= 2 min).

Runs, as a user would, ``perfx-tune MODEL --target T [extra tune args]`` (the default budget
unless told otherwise), then ``perfx-compile MODEL --target T --tuning-log LOGS`` (zero new
trials: the schedule phase reads the best records), and writes one CSV row per run with both
wall times, the records written and the machine's load. ``--skip-tune`` times the rebuild only
(from the committed records).

    python benchmarks/tuning_time.py [--model smollm2-135m] [--target x86-avx512] [--skip-tune]
                                     [--log-dir tuning_logs] [-- EXTRA perfx-tune ARGS]
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
TUNE_LIMIT_S = 20 * 60
REBUILD_LIMIT_S = 2 * 60


def _lines(path: Path) -> int:
    return sum(1 for _ in path.open()) if path.exists() else 0


def _run(cmd: list[str]) -> tuple[float, int, str]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    return time.perf_counter() - start, proc.returncode, tail[0][:200]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--target", default="x86-avx512")
    parser.add_argument("--quantization", default="f32")
    parser.add_argument("--log-dir", default=str(REPO / "tuning_logs"))
    parser.add_argument("--skip-tune", action="store_true", help="time the rebuild from the existing records only")
    parser.add_argument("--out", default=str(RESULTS / "tuning_time.csv"))
    parser.add_argument("tune_args", nargs="*", help="extra perfx-tune arguments (after --)")
    args = parser.parse_args()

    from perfx_compiler.tune.session import log_name

    log = Path(args.log_dir) / args.target / f"{log_name(args.model)}.jsonl"
    row: dict[str, object] = {
        "model": args.model,
        "target": args.target,
        "quantization": args.quantization,
        "tune_args": " ".join(args.tune_args) or "(defaults)",
        "records_before": _lines(log),
        "load_avg_1m_start": round(os.getloadavg()[0], 2),
    }
    if args.skip_tune:
        row.update(tune_s=float("nan"), tune_rc="skipped", tune_tail="")
    else:
        tune = [sys.executable, "-m", "perfx_compiler.cli.tune", args.model, "--target", args.target,
                "--quantization", args.quantization, "--log-dir", args.log_dir, "--quiet", *args.tune_args]
        print("+", " ".join(tune), flush=True)
        secs, rc, tail = _run(tune)
        row.update(tune_s=round(secs, 1), tune_rc=rc, tune_tail=tail)
        print(f"tune: {secs:.0f} s (rc {rc}) {tail}", flush=True)
    row["records_after"] = _lines(log)
    with tempfile.TemporaryDirectory(prefix="perfx-rebuild-") as tmp:
        build = [sys.executable, "-m", "perfx_compiler.cli.compile", args.model, "--target", args.target,
                 "--quantization", args.quantization, "--tuning-log", str(Path(args.log_dir) / args.target),
                 "-o", str(Path(tmp) / "art"), "--quiet"]
        print("+", " ".join(build), flush=True)
        secs, rc, tail = _run(build)
    row.update(rebuild_s=round(secs, 1), rebuild_rc=rc, rebuild_tail=tail)
    print(f"rebuild: {secs:.0f} s (rc {rc}) {tail}", flush=True)
    row["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    tune_s = row["tune_s"]
    row["tune_within_20min"] = "" if args.skip_tune else bool(isinstance(tune_s, float) and tune_s <= TUNE_LIMIT_S)
    row["rebuild_within_2min"] = bool(secs <= REBUILD_LIMIT_S and rc == 0)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    new = not out.exists()
    with out.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row))
        if new:
            writer.writeheader()
        writer.writerow(row)
    print(f"appended to {out}: tune {row['tune_s']} s, rebuild {row['rebuild_s']} s")


if __name__ == "__main__":
    main()
