"""A/B of two compiled artifacts' prefill and decode speed (e.g. before / after a layout change).

Runs ``perfx-run DIR --json`` alternately on A and B for ``--rounds`` rounds (greedy, fixed
prompt and length) and writes each run plus the medians to a CSV, so that a shared machine's
load hits both sides alike. Also checks that both produce the same tokens.

    python benchmarks/decode_ab.py ART_A ART_B [--labels before,after] [--rounds 6] [--out CSV]

Tuning records vs what builds without them (how results/vnni_records_ab.csv is made): compiles MODEL
twice into a temp dir, A with the repo's tuning_logs/<target>/ (what perfx-compile uses by default)
and B with those plus every record under ``--tuning-log DIR`` (a perfx-tune --log-dir root, a target
directory or a .jsonl file), then alternates the two as above:

    python benchmarks/decode_ab.py --model smollm2-135m --tuning-log /tmp/tlog --labels defaults,records
        --out benchmarks/results/vnni_records_ab.csv   (one command line)
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
from pathlib import Path

from _common import write_csv

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PROMPT = ("Once upon a time, there was a little girl named Lily. She lived in a small house near the forest "
          "with her mother, her father and a very old cat. Every morning she walked to the river to look at "
          "the fish, and every evening she told her cat what she had seen. One day,")


def run_once(art: str, max_tokens: int) -> dict:
    cmd = [sys.executable, "-m", "perfx_compiler.cli.run", art, "--prompt", PROMPT, "--max-tokens", str(max_tokens),
           "--temperature", "0", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _records_root(log: Path, target: str, root: Path) -> Path:
    """A log root holding the repo's records for ``target`` plus those of ``log``."""
    sys.path.insert(0, str(REPO))  # this checkout's package, not an installed copy
    from perfx_compiler.targets import load_target

    name = load_target(target).name
    dest = root / name
    dest.mkdir(parents=True)
    for f in sorted((REPO / "tuning_logs" / name).glob("*.jsonl")):
        shutil.copy(f, dest / f.name)
    if log.is_file():
        files = [log]
    else:
        files = sorted((log / name if (log / name).is_dir() else log).glob("*.jsonl"))
    if not files:
        raise SystemExit(f"no *.jsonl records for {name} under {log}")
    for f in files:
        shutil.copy(f, dest / f"tuned-{f.name}")
    return root


def compile_pair(model: str, target: str, log: Path, workdir: Path) -> tuple[str, str]:
    """(artifact with the repo's records, artifact with those + ``log``'s), compiled here."""
    root = _records_root(log, target, workdir / "logs")
    arts = (workdir / "defaults", workdir / "records")
    for art, extra in zip(arts, ([], ["--tuning-log", str(root)]), strict=True):
        cmd = [sys.executable, "-m", "perfx_compiler.cli.compile", model, "--target", target, "-o", str(art),
               "--quiet", *extra]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=REPO)
    return str(arts[0]), str(arts[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", nargs="?", help="artifact A (or use --model and --tuning-log)")
    p.add_argument("b", nargs="?", help="artifact B")
    p.add_argument("--model", default=None, help="compile MODEL twice: A without, B with --tuning-log's records")
    p.add_argument("--tuning-log", default=None, metavar="DIR", help="records for B (with --model)")
    p.add_argument("--target", default="host", help="with --model (default host)")
    p.add_argument("--labels", default="A,B")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--out", default=str(RESULTS / "decode_ab.csv"))
    args = p.parse_args()
    if args.model or args.tuning_log:
        if not (args.model and args.tuning_log) or args.a or args.b:
            p.error("--model and --tuning-log go together, instead of two artifacts")
        args.a, args.b = compile_pair(args.model, args.target, Path(args.tuning_log),
                                      Path(tempfile.mkdtemp(prefix="perfx-records-ab-")))
    elif not (args.a and args.b):
        p.error("give two artifacts, or --model and --tuning-log")
    labels = args.labels.split(",")
    runs = []
    tokens = {}
    for r in range(args.rounds):
        for label, art in zip(labels, (args.a, args.b), strict=True):
            doc = run_once(art, args.max_tokens)
            tokens.setdefault(label, doc["token_ids"])
            runs.append({"round": r, "variant": label, "artifact": art,
                         "prompt_tokens": len(doc["prompt_token_ids"]),
                         "prefill_tok_s": round(doc["prefill_tokens_per_s"], 2),
                         "decode_tok_s": round(doc["decode_tokens_per_s"], 2),
                         "load_avg_1m": round(os.getloadavg()[0], 2)})
            print(runs[-1], flush=True)
    same = tokens[labels[0]] == tokens[labels[1]]
    rows = list(runs)
    for label in labels:
        mine = [x for x in runs if x["variant"] == label]
        rows.append({"round": "median", "variant": label, "artifact": mine[0]["artifact"],
                     "prompt_tokens": mine[0]["prompt_tokens"],
                     "prefill_tok_s": statistics.median(x["prefill_tok_s"] for x in mine),
                     "decode_tok_s": statistics.median(x["decode_tok_s"] for x in mine),
                     "load_avg_1m": statistics.median(x["load_avg_1m"] for x in mine)})
        print(f"{label}: median prefill {rows[-1]['prefill_tok_s']:.1f} tok/s, decode {rows[-1]['decode_tok_s']:.1f} tok/s")
    print(f"same tokens: {same}")
    out = write_csv(args.out, [{**row, "same_tokens": same} for row in rows])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
