"""Serving under load: PerfX's server against llama.cpp's own (``llama-server``), same GGUF, same prompts,
through the OpenAI client (streaming ``/v1/completions``, greedy, ``ignore_eos``).

Both servers run as their own processes on loopback with 2 threads and the same number of sequences
decoded together (``--slots``: PerfX's ``--max-batch``, llama-server's parallel slots with continuous
batching); requests beyond that queue in the server. For each concurrency c (default 1, 4, 16, 64), c
clients start together, each with its own prompt; the servers alternate per round. Per run: aggregate
tok/s (completion tokens / wall time), p50 / p99 time to first token and inter-token latency (gaps
between a stream's chunks, pooled over streams). Before the runs each prompt is sent alone and its text
kept: ``same_as_alone`` counts the streams of a run whose greedy text equals that text (PerfX's batched
decode is bit-exact per sequence; llama.cpp's batched numerics are not, so its count may be lower).

    python benchmarks/serving_peers.py [--concurrency 1 4 16 64] [--slots 16] [--max-tokens 64] [--rounds 2]

Writes benchmarks/results/<out>/serving_peers.csv (+ .png). llama-server is built on first use
(``perfx_compiler/bench/llama_server.py``: CMake, several minutes).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from _common import RESULTS, alternated, figure, write_csv

from perfx_compiler.bench import models
from perfx_compiler.bench.llama_server import free_port, llama_server

SUBJECTS = ["the ocean", "a small town", "mountains", "a robot", "the moon", "coffee", "trains", "a library",
            "winter", "a garden", "music", "the desert", "a city at night", "rivers", "a lighthouse", "bread"]
COLUMNS = ["server", "concurrency", "slots", "agg_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
           "completion_tokens", "errors", "first_error", "same_as_alone", "streams", "rounds", "vs_llama_server"]


def prompt(i: int) -> str:
    return f"Write a short story about {SUBJECTS[i % len(SUBJECTS)]} (number {i}). Once upon a time,"


@contextmanager
def perfx_server(artifact: Path, slots: int, queue: int, prefill_chunk: int, log: Path) -> Iterator[str]:
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "perfx_compiler.cli.serve", str(artifact), "--port", str(port),
           "--max-batch", str(slots), "--queue-size", str(queue), "--prefill-chunk", str(prefill_chunk), "--no-verify", "--log-level", "warning"]
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"perfx-serve exited with {proc.returncode}; see {log}")
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit(f"perfx-serve did not become healthy; see {log}")
                time.sleep(0.5)
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def one_stream(url: str, i: int, max_tokens: int, start: threading.Barrier | None) -> dict[str, Any]:
    """One streaming completion: its text, chunk arrival times and token count (usage when sent)."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=900)
    model = client.models.list().data[0].id
    if start is not None:
        start.wait()
    t0 = time.perf_counter()
    times, text, tokens, error = [], [], 0, ""
    try:
        stream = client.completions.create(model=model, prompt=prompt(i), max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                times.append(time.perf_counter())
                text.append(chunk.choices[0].text)
            if getattr(chunk, "usage", None):
                tokens = int(chunk.usage.completion_tokens)
    except openai.OpenAIError as err:
        error = " ".join(str(err).split())[:200]
    return {"t0": t0, "times": times, "text": "".join(text), "tokens": tokens or len(times), "error": error}


def run(url: str, c: int, max_tokens: int) -> tuple[list[dict[str, Any]], float]:
    barrier = threading.Barrier(c)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        streams = list(pool.map(lambda i: one_stream(url, i, max_tokens, barrier), range(c)))
    return streams, time.perf_counter() - min(s["t0"] for s in streams) if streams else time.perf_counter() - t0


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def summarize(server: str, c: int, runs: list[tuple[list[dict[str, Any]], float]], alone: dict[int, str],
              slots: int) -> dict[str, Any]:
    agg, ttft, itl, same, errors, tokens, first_error = [], [], [], 0, 0, 0, ""
    for streams, wall in runs:
        agg.append(sum(s["tokens"] for s in streams) / wall)
        for i, s in enumerate(streams):
            errors += bool(s["error"])
            first_error = first_error or s["error"]
            tokens += s["tokens"]
            same += s["text"] == alone.get(i)
            if s["times"]:
                ttft.append((s["times"][0] - s["t0"]) * 1e3)
                itl += list(np.diff(s["times"]) * 1e3)
    return {"server": server, "concurrency": c, "slots": slots, "agg_tok_s": statistics.median(agg),
            "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99), "itl_p50_ms": _pct(itl, 50),
            "itl_p99_ms": _pct(itl, 99), "completion_tokens": tokens, "errors": errors, "first_error": first_error, "same_as_alone": same,
            "streams": sum(len(r[0]) for r in runs), "rounds": len(runs)}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    with figure(path, 1, 2, figsize=(11, 4)) as (fig, (ax_tok, ax_itl)):
        for server in sorted({r["server"] for r in rows}):
            rs = [r for r in rows if r["server"] == server]
            xs = [r["concurrency"] for r in rs]
            ax_tok.plot(xs, [r["agg_tok_s"] for r in rs], marker="o", label=server)
            ax_itl.plot(xs, [r["itl_p99_ms"] for r in rs], marker="o", label=f"{server} p99")
            ax_itl.plot(xs, [r["itl_p50_ms"] for r in rs], marker=".", ls="--", label=f"{server} p50")
        for ax, title in ((ax_tok, "aggregate tok/s"), (ax_itl, "inter-token latency (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent clients")
            ax.set_title(title)
            ax.grid(alpha=0.3)
            ax.legend()
        fig.suptitle("serving: PerfX vs llama-server, same GGUF, 2 threads")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a GGUF path or known model name")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-context", type=int, default=512, help="per sequence (PerfX artifact, llama-server slot)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prefill-chunk", type=int, default=256, help="perfx-serve --prefill-chunk")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "perfx-bench"))
    p.add_argument("--out", default=str(RESULTS / "intel-xeon"))
    args = p.parse_args(argv)
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    gguf = models.resolve_model(args.model)
    artifact = work / f"perfx-serve-{models.model_key(gguf)}-ctx{args.max_context}"
    if not (artifact / "perfx-config.json").is_file():
        from perfx_compiler.pipeline import compile_model

        print(f"compiling {gguf.name} with batching ...", flush=True)
        compile_model(str(gguf), "host", artifact, progress=False, batching=True, max_context=args.max_context)
    queue = max(args.concurrency)
    with ExitStack() as stack:
        urls = {"perfx": stack.enter_context(perfx_server(artifact, args.slots, queue, args.prefill_chunk,
                                                              work / "serve-perfx.log")),
                "llama-server": stack.enter_context(llama_server(gguf, slots=args.slots,
                                                                 context_per_slot=args.max_context,
                                                                 threads=args.threads, log=work / "serve-llama.log"))}
        alone = {}
        for server, url in urls.items():  # warm-up and each prompt's text alone
            alone[server] = {i: one_stream(url, i, args.max_tokens, None)["text"] for i in range(max(args.concurrency))}
        runs: dict[tuple[str, int], list[Any]] = {}
        for r in range(args.rounds):
            for c in args.concurrency:
                for server in alternated(list(urls), r):
                    runs.setdefault((server, c), []).append(run(urls[server], c, args.max_tokens))
                    s = summarize(server, c, runs[(server, c)][-1:], alone[server], args.slots)
                    print(f"round {r} {server:12s} c={c:3d}: {s['agg_tok_s']:7.1f} tok/s, TTFT p50 {s['ttft_p50_ms']:7.0f} ms, "
                          f"ITL p50/p99 {s['itl_p50_ms']:5.0f}/{s['itl_p99_ms']:5.0f} ms, errors {s['errors']} {s['first_error'][:80]}, "
                          f"same as alone {s['same_as_alone']}/{c}", flush=True)
    rows = [summarize(server, c, rs, alone[server], args.slots) for (server, c), rs in sorted(runs.items(), key=lambda kv: kv[0][1])]
    for row in rows:
        peer = next(x for x in rows if x["server"] == "llama-server" and x["concurrency"] == row["concurrency"])
        row["vs_llama_server"] = row["agg_tok_s"] / peer["agg_tok_s"]
    write_csv(out / "serving_peers.csv", rows, COLUMNS, floats=".4g")
    plot(rows, out / "serving_peers.png")
    print(f"wrote {out / 'serving_peers.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
