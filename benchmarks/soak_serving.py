"""Soak: perfx-serve under steady load for N minutes; RSS and KV pages in use must not grow.

    python benchmarks/soak_serving.py ARTIFACT_DIR [--minutes 10] [--clients 4]

Loopback only, bounded in time and count. Writes benchmarks/results/soak_serving.csv (one row per
sample: elapsed s, server RSS MB, KV pages in use, requests done, errors) and a PNG, then checks:
RSS at the end within 5% (+20 MB) of the RSS after the first minute, and 0 pages in use once idle.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
from _common import write_csv

RESULTS = Path(__file__).resolve().parent / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(RESULTS / "soak_serving.csv"))
    args = ap.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "perfx_compiler.cli.serve", args.artifact, "--port", str(port), "--max-batch", "8"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        proc = psutil.Process(server.pid)
        stop = threading.Event()
        done, errors = [0], [0]
        prompts = ["Once upon a time", "The history of the city", "def quicksort(xs):", "Dear diary, today"]

        def client(i: int) -> None:
            with httpx.Client(timeout=120) as c:
                n = 0
                while not stop.is_set():
                    body = {"prompt": prompts[(i + n) % len(prompts)], "max_tokens": args.max_tokens,
                            "temperature": 0.8, "seed": n, "stream": n % 2 == 0}
                    try:
                        r = c.post(f"{base}/v1/completions", json=body)
                        done[0] += r.status_code == 200
                        errors[0] += r.status_code != 200
                    except httpx.HTTPError:
                        errors[0] += 1
                    n += 1

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
        for t in threads:
            t.start()
        rows, start = [], time.monotonic()
        while time.monotonic() - start < args.minutes * 60:
            time.sleep(10)
            rows.append({"elapsed_s": round(time.monotonic() - start, 1), "rss_mb": round(proc.memory_info().rss / 2**20, 1),
                         "kv_pages_used": metric(base, "perfx_kv_pages_used"), "requests_done": done[0], "errors": errors[0]})
            print(rows[-1], flush=True)
        stop.set()
        for t in threads:
            t.join(timeout=180)
        time.sleep(2)
        idle_pages = metric(base, "perfx_kv_pages_used")
    finally:
        server.terminate()
        server.wait(timeout=30)
    out = write_csv(args.out, rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([r["elapsed_s"] for r in rows], [r["rss_mb"] for r in rows], label="server RSS (MB)")
    ax2 = ax.twinx()
    ax2.plot([r["elapsed_s"] for r in rows], [r["kv_pages_used"] for r in rows], color="tab:orange", label="KV pages in use")
    ax.set_xlabel("seconds")
    ax.set_ylabel("RSS MB")
    ax2.set_ylabel("pages")
    fig.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    base_rss = next((r["rss_mb"] for r in rows if r["elapsed_s"] >= 60), rows[0]["rss_mb"])
    grew = rows[-1]["rss_mb"] - base_rss
    ok = grew <= 0.05 * base_rss + 20 and idle_pages == 0 and errors[0] == 0
    print(f"requests {done[0]}, errors {errors[0]}, RSS {base_rss} -> {rows[-1]['rss_mb']} MB, idle pages {idle_pages}: "
          + ("OK" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
