"""A/B of two compiled artifacts' prefill and decode speed (e.g. before / after a layout change).

Runs ``perfx-run DIR --json`` alternately on A and B for ``--rounds`` rounds (greedy, fixed
prompt and length) and writes each run plus the medians to a CSV, so that a shared machine's
load hits both sides alike. Also checks that both produce the same tokens.

    python benchmarks/decode_ab.py ART_A ART_B [--labels before,after] [--rounds 6] [--out CSV]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = ("Once upon a time, there was a little girl named Lily. She lived in a small house near the forest "
          "with her mother, her father and a very old cat. Every morning she walked to the river to look at "
          "the fish, and every evening she told her cat what she had seen. One day,")


def run_once(art: str, max_tokens: int) -> dict:
    cmd = [sys.executable, "-m", "perfx_compiler.cli.run", art, "--prompt", PROMPT, "--max-tokens", str(max_tokens),
           "--temperature", "0", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--labels", default="A,B")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--out", default=str(RESULTS / "decode_ab.csv"))
    args = p.parse_args()
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
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*rows[0], "same_tokens"])
        w.writeheader()
        for row in rows:
            w.writerow({**row, "same_tokens": same})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
