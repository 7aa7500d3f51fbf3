"""Serving benchmark: aggregate decode tok/s of 1, 4, 16 concurrent greedy streams on the default model.

The artifact needs the batched functions: it is compiled once (SmolLM2-135M, host target,
``batching=True``) into build/bench-serving/ unless ``--artifact DIR`` is given
(pass it e.g. an artifact from ``compile_model(..., batching=True)``). When the
default graph passes do not yet produce a working batched decode, it falls back to the
``weight_layout`` pass only and says so in the CSV's ``passes`` column.

Modes (both by default):
  http       perfx-serve's app under uvicorn on 127.0.0.1, clients streaming /v1/completions (SSE)
  scheduler  the same scheduler driven in-process (no HTTP), to show the server's overhead
Each run: c clients start together, each with its own prompt, ``--max-tokens`` tokens with
``ignore_eos``. Per stream: TTFT, and decode rate (tokens - 1) / (last - first token time);
``agg_decode_tok_s`` sums the streams' decode rates, ``agg_wall_tok_s`` is all tokens / wall time.
Writes benchmarks/results/serving.csv.

``--soak MINUTES``: instead, perfx-serve (its CLI, in a subprocess) under steady load from ``--clients``
loopback clients for that long; server RSS and KV pages in use are sampled every 10 s into
benchmarks/results/soak_serving.csv (+ .png). Passes when the RSS at the end is within 5% (+20 MB) of
the RSS after the first minute, no request failed and 0 pages are in use once idle.

``--vs-llama-server``: instead, perfx-serve and llama.cpp's own ``llama-server`` (built with CMake from the
sdist's llama.cpp on first use, ``perfx_compiler/bench/llama_server.py``) as processes side by side on the
same GGUF, 2 threads each, ``--slots`` sequences decoded together (PerfX's ``--max-batch``, llama-server's
parallel slots with continuous batching; more clients queue in the server), driven through the OpenAI client
(``perfx_compiler/bench/openai_load.py``), servers alternated per round. Per concurrency: aggregate tok/s,
p50/p99 TTFT and inter-token latency, errors, and ``same_as_alone``: streams whose greedy text equals the
prompt's text sent alone. Writes benchmarks/results/<machine>/serving_peers.csv (+ .png).

``--prefix-cache``: instead, time to first token of ``--users`` users sharing a ``--system-tokens`` system
prompt, prefix cache on vs cold, alternated per round, in-process (``perfx_compiler/bench/prefix_load.py``);
every user's greedy tokens must equal the cold run's. Writes benchmarks/results/<machine>/prefix_cache.csv.

    python benchmarks/serving.py [--artifact DIR] [--concurrency 1 4 16] [--max-tokens 64]
    python benchmarks/serving.py --soak 10 [--artifact DIR] [--clients 4]
    python benchmarks/serving.py --vs-llama-server [--concurrency 1 4 16 64] [--slots 16] [--rounds 2]
    python benchmarks/serving.py --prefix-cache [--system-tokens 1024] [--users 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from _common import RESULTS as RESULTS_DIR
from _common import alternated, figure, write_csv

from perfx_compiler.bench.ggml_mul_mat import machine_name
from perfx_compiler.bench.llama_server import free_port, llama_server, server_process
from perfx_compiler.bench.openai_load import concurrent_streams, one_stream, story_prompt, summarize_streams

REPO = Path(__file__).resolve().parents[1]

DEFAULT_ARTIFACT = REPO / "build" / "bench-serving" / "smollm2-135m-host"
RESULTS = REPO / "benchmarks" / "results" / "serving.csv"
SOAK_RESULTS = RESULTS.with_name("soak_serving.csv")
MACHINE_RESULTS = RESULTS_DIR / machine_name()  # this machine's folder (intel-xeon, amd-epyc, ...)
PEERS_RESULTS = MACHINE_RESULTS / "serving_peers.csv"
PREFIX_RESULTS = MACHINE_RESULTS / "prefix_cache.csv"
PEERS_COLUMNS = ["server", "concurrency", "slots", "agg_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
                 "itl_p99_ms", "completion_tokens", "errors", "first_error", "same_as_alone", "streams", "rounds",
                 "vs_llama_server"]


def _batched_decode_works(artifact: Path) -> bool:
    from perfx_compiler.runtime.batch_engine import BatchEngine

    try:
        eng = BatchEngine(artifact, max_batch=2, num_pages=4, verify=False)
        a, b = eng.add_sequence(), eng.add_sequence()
        eng.prefill(a, [1, 2, 3])
        eng.prefill(b, [4, 5])
        eng.decode([a, b], [6, 7])
        return True
    except Exception as e:  # a compiled kernel rejecting batch > 1
        print(f"batched decode fails on {artifact}: {' '.join(str(e).split())[:200]}", file=sys.stderr)
        return False


def ensure_artifact(path: Path | None, model: str) -> tuple[Path, str]:
    """(artifact dir, passes used); compiles the default model with batching when needed.

    Each pass choice gets its own directory: a process cannot load two different model.so
    files from one path (the second dlopen returns the first library)."""
    if path is not None:
        return path, "given"
    from perfx_compiler.pipeline import compile_model

    for passes in (None, ["weight_layout"]):
        used = "default" if passes is None else "+".join(passes)
        out = DEFAULT_ARTIFACT.with_name(f"{DEFAULT_ARTIFACT.name}-{used}")
        status = out.parent / f"{out.name}.status"
        if not (out / "perfx-config.json").is_file() or not status.is_file():
            t0 = time.perf_counter()
            print(f"compiling {model} (host, batching, passes={used}) ...", file=sys.stderr, flush=True)
            compile_model(model, "host", out, progress=False, batching=True, passes=passes)
            print(f"  compiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            status.write_text("ok" if _batched_decode_works(out) else "fails")
        if status.read_text() == "ok":
            return out, used
        print(f"{out}: batched decode does not work with passes={used}", file=sys.stderr)
    raise SystemExit("no compiled artifact can decode a batch; see the errors above")


def summarize(mode: str, c: int, streams: list[dict[str, float]], wall: float) -> dict[str, Any]:
    tokens = sum(int(s["n"]) for s in streams)
    rates = [(s["n"] - 1) / (s["last"] - s["first"]) for s in streams if s["n"] > 1 and s["last"] > s["first"]]
    itls = [(s["last"] - s["first"]) / (s["n"] - 1) * 1e3 for s in streams if s["n"] > 1]
    return {
        "mode": mode,
        "concurrency": c,
        "total_tokens": tokens,
        "wall_s": round(wall, 3),
        "agg_decode_tok_s": round(sum(rates), 2),
        "agg_wall_tok_s": round(tokens / wall, 2),
        "per_stream_decode_tok_s": round(statistics.mean(rates), 2) if rates else 0.0,
        "mean_ttft_s": round(statistics.mean(s["ttft"] for s in streams), 4),
        "mean_itl_ms": round(statistics.mean(itls), 2) if itls else 0.0,
    }


def run_scheduler(sched: Any, tokenizer: Any, c: int, max_tokens: int) -> dict[str, Any]:
    from perfx_compiler.runtime.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    streams = [{"n": 0, "first": 0.0, "last": 0.0, "ttft": 0.0} for _ in range(c)]

    def recorder(i: int) -> Any:
        def on_event(ev: Any) -> None:
            now = time.perf_counter()
            s = streams[i]
            if ev.token_ids:
                if s["n"] == 0:
                    s["first"] = now
                s["n"] += len(ev.token_ids)
                s["last"] = now

        return on_event

    t0 = time.perf_counter()
    handles = [sched.submit(tokenizer.encode(story_prompt(i)), params, on_event=recorder(i)) for i in range(c)]
    for h in handles:
        h.result(timeout=600)
    wall = time.perf_counter() - t0
    for s in streams:
        s["ttft"] = s["first"] - t0
    return summarize("scheduler", c, streams, wall)


def run_http(url: str, model: str, c: int, max_tokens: int) -> dict[str, Any]:
    import httpx

    barrier = threading.Barrier(c)

    def one(i: int) -> dict[str, float]:
        body = {
            "model": model,
            "prompt": story_prompt(i),
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        s = {"n": 0, "first": 0.0, "last": 0.0, "ttft": 0.0}
        with httpx.Client(timeout=600) as client:
            barrier.wait()
            t0 = time.perf_counter()
            with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    doc = json.loads(line[6:])
                    now = time.perf_counter()
                    if doc.get("usage"):
                        s["n"] = doc["usage"]["completion_tokens"]
                    elif doc["choices"] and doc["choices"][0]["text"]:
                        if not s["first"]:
                            s["first"] = now
                            s["ttft"] = now - t0
                        s["last"] = now
        return s

    t0 = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        streams = list(pool.map(one, range(c)))
    return summarize("http", c, streams, time.perf_counter() - t0)


def metric(base: str, name: str) -> float:
    import httpx

    text = httpx.get(f"{base}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def soak(artifact: Path, args: argparse.Namespace) -> int:
    """The soak run (see the module doc); 0 when it passed."""
    import httpx
    import psutil

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "perfx_compiler.cli.serve", str(artifact), "--port", str(port), "--max-batch", "8"],
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
        while time.monotonic() - start < args.soak * 60:
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
    out = write_csv(args.out or SOAK_RESULTS, rows)
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


def perfx_server(artifact: Path, slots: int, queue: int, prefill_chunk: int, log: Path) -> Any:
    """perfx-serve (its CLI) in a subprocess on loopback: a context manager yielding its URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "perfx_compiler.cli.serve", str(artifact), "--port", str(port), "--max-batch",
           str(slots), "--queue-size", str(queue), "--prefill-chunk", str(prefill_chunk), "--no-verify",
           "--log-level", "warning"]
    return server_process(cmd, f"http://127.0.0.1:{port}", "perfx-serve", log)


def plot_peers(rows: list[dict[str, Any]], path: Path) -> None:
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


def vs_llama_server(args: argparse.Namespace) -> int:
    """The ``--vs-llama-server`` run (see the module doc)."""
    from perfx_compiler.bench import models
    from perfx_compiler.pipeline import compile_model

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    gguf = models.resolve_model(args.model)
    artifact = work / f"perfx-serve-{models.model_key(gguf)}-ctx{args.max_context}"
    if not (artifact / "perfx-config.json").is_file():
        print(f"compiling {gguf.name} with batching ...", flush=True)
        compile_model(str(gguf), "host", artifact, progress=False, batching=True, max_context=args.max_context)
    clients = max(args.concurrency)
    runs: dict[tuple[str, int], list[Any]] = {}
    with ExitStack() as stack:
        urls = {"perfx": stack.enter_context(perfx_server(artifact, args.slots, clients, args.prefill_chunk,
                                                          work / "serve-perfx.log")),
                "llama-server": stack.enter_context(llama_server(gguf, slots=args.slots,
                                                                 context_per_slot=args.max_context,
                                                                 threads=args.threads, log=work / "serve-llama.log"))}
        alone = {server: {i: one_stream(url, i, args.max_tokens)["text"] for i in range(clients)}
                 for server, url in urls.items()}  # also the warm-up
        for r in range(args.rounds):
            for c in args.concurrency:
                for server in alternated(list(urls), r):
                    runs.setdefault((server, c), []).append(concurrent_streams(urls[server], c, args.max_tokens))
                    s = summarize_streams(runs[(server, c)][-1:], alone[server])
                    print(f"round {r} {server:12s} c={c:3d}: {s['agg_tok_s']:7.1f} tok/s, TTFT p50 {s['ttft_p50_ms']:6.0f} ms, "
                          f"ITL p50/p99 {s['itl_p50_ms']:4.0f}/{s['itl_p99_ms']:4.0f} ms, errors {s['errors']} "
                          f"{s['first_error'][:60]}, same as alone {s['same_as_alone']}/{c}", flush=True)
    rows = [{"server": server, "concurrency": c, "slots": args.slots, **summarize_streams(rs, alone[server])}
            for (server, c), rs in sorted(runs.items(), key=lambda kv: kv[0][1])]
    for row in rows:
        peer = next(x for x in rows if x["server"] == "llama-server" and x["concurrency"] == row["concurrency"])
        row["vs_llama_server"] = row["agg_tok_s"] / peer["agg_tok_s"]
    out = Path(args.out or PEERS_RESULTS)
    write_csv(out, rows, PEERS_COLUMNS, floats=".4g")
    plot_peers(rows, out.with_suffix(".png"))
    print(f"wrote {out}")
    return 0


def prefix_cache(args: argparse.Namespace) -> int:
    import perfx_compiler.pipeline  # noqa: F401  (before the runtime: TVM's import order)
    from perfx_compiler.bench import prefix_load as pl
    from perfx_compiler.runtime.api import Tokenizer
    from perfx_compiler.runtime.batch_engine import BatchEngine
    from perfx_compiler.runtime.engine import read_manifest
    from perfx_compiler.runtime.generate import model_info
    from perfx_compiler.serve.scheduler import Scheduler

    art = args.artifact or DEFAULT_ARTIFACT.with_name(f"{DEFAULT_ARTIFACT.name}-ctx2048")
    if not (art / "perfx-config.json").is_file():
        from perfx_compiler.pipeline import compile_model

        print(f"compiling {args.model} (host, batching, max_context 2048) ...", file=sys.stderr, flush=True)
        compile_model(args.model, "host", art, progress=False, batching=True, max_context=2048)
    page_size = int(read_manifest(art, verify=False)["paged_kv"]["page_size"])
    # room for the running request and the cached system prompt (and a question's pages) at once
    pages = 3 * -(-(args.system_tokens + 64 + args.max_tokens) // page_size)
    eng = BatchEngine(art, verify=False, max_batch=1, num_pages=pages)
    tok = Tokenizer.from_file(eng.tokenizer_path, model_info(eng))
    ids = pl.shared_prefix_prompts(tok, args.system_tokens, args.users)
    if max(len(p) for p in ids) + 1 + args.max_tokens > eng.max_context:  # + BOS
        raise SystemExit(f"a prompt and its tokens do not fit the artifact's context of {eng.max_context}")
    hits = pl.HitCounter()
    # a whole prompt in one chunk: the TTFT is one prefill
    sched = Scheduler(eng, tok, max_batch=1, prefill_chunk=args.system_tokens + 64, observer=hits)
    sched.start()
    rows: list[dict[str, Any]] = []
    try:
        for rnd in range(args.rounds):
            got = {m: pl.run_users(sched, hits, m, ids, args.max_tokens) for m in alternated(["on", "cold"], rnd)}
            for m in ("on", "cold"):
                for r, c in zip(got[m], got["cold"], strict=True):
                    rows.append({"round": rnd, "mode": m, **{k: v for k, v in r.items() if k != "tokens"},
                                 "same_as_cold": r["tokens"] == c["tokens"]})  # fmt: skip
    finally:
        sched.shutdown()
    summary, med = pl.summarize_users(rows)
    for r in rows + summary:
        r.update(system_tokens=args.system_tokens, max_tokens=args.max_tokens)
    out = args.out or PREFIX_RESULTS
    write_csv(out, rows + summary, pl.COLUMNS, floats=".2f")
    same = all(r["same_as_cold"] for r in rows)
    print(f"TTFT median (users 2..{args.users}): on {med['on']:.1f} ms, cold {med['cold']:.1f} ms "
          f"({med['cold'] / med['on']:.1f}x); greedy tokens equal to cold: {same}; wrote {out}")  # fmt: skip
    return 0 if same else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", type=Path, default=None, help="a compiled artifact with batched functions")
    p.add_argument("--model", default="smollm2-135m", help="model to compile when --artifact is not given")
    p.add_argument("--concurrency", type=int, nargs="+", default=None,
                   help="concurrent clients (default 1 4 16; --vs-llama-server: 1 4 16 64)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--modes", nargs="+", choices=["http", "scheduler"], default=["scheduler", "http"])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--soak", type=float, default=0.0, metavar="MINUTES", help="run the soak test instead")
    p.add_argument("--clients", type=int, default=4, help="--soak: concurrent clients")
    p.add_argument("--vs-llama-server", action="store_true", help="PerfX's server vs llama-server instead")
    p.add_argument("--slots", type=int, default=16, help="--vs-llama-server: sequences decoded together")
    p.add_argument("--rounds", type=int, default=2, help="--vs-llama-server: alternated rounds")
    p.add_argument("--max-context", type=int, default=512, help="--vs-llama-server: tokens per sequence")
    p.add_argument("--threads", type=int, default=2, help="--vs-llama-server: llama-server threads")
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "perfx-bench"))
    p.add_argument("--prefix-cache", action="store_true", help="shared-prefix TTFT, cache on vs cold, instead")
    p.add_argument("--system-tokens", type=int, default=1024, help="--prefix-cache: shared prompt tokens")
    p.add_argument("--users", type=int, default=32, help="--prefix-cache: users, one after the other")
    args = p.parse_args(argv)
    if args.prefix_cache:
        if args.max_tokens == 64:
            args.max_tokens = 4
        return prefix_cache(args)
    if args.vs_llama_server:
        args.concurrency = args.concurrency or [1, 4, 16, 64]
        return vs_llama_server(args)
    args.concurrency = args.concurrency or [1, 4, 16]

    artifact, passes = ensure_artifact(args.artifact, args.model)
    if args.soak:
        if args.max_tokens == 64:
            args.max_tokens = 32
        return soak(artifact, args)
    args.out = args.out or RESULTS
    import uvicorn

    from perfx_compiler.runtime.batch_engine import BatchEngine
    from perfx_compiler.serve.app import create_app

    max_batch = max(args.concurrency)
    engine = BatchEngine(artifact, max_batch=max_batch, verify=False)
    app = create_app(engine, max_batch=max_batch, prefill_chunk=args.prefill_chunk, max_queue=4 * max_batch)
    srv = app.state.server
    rows: list[dict[str, Any]] = []

    def record(row: dict[str, Any]) -> None:
        row.update(
            max_tokens=args.max_tokens,
            prefill_chunk=args.prefill_chunk,
            passes=passes,
            cpu=platform.processor() or platform.machine(),
            cores=os.cpu_count(),
        )
        rows.append(row)
        print(
            f"{row['mode']:>9} c={row['concurrency']:<3} agg decode {row['agg_decode_tok_s']:8.1f} tok/s  "
            f"wall {row['agg_wall_tok_s']:8.1f} tok/s  per-stream {row['per_stream_decode_tok_s']:6.1f} tok/s  "
            f"TTFT {row['mean_ttft_s'] * 1e3:7.1f} ms  ITL {row['mean_itl_ms']:6.1f} ms",
            flush=True,
        )

    srv.scheduler.start()  # the app's lifespan start() is then a no-op; its shutdown stops it
    if "scheduler" in args.modes:
        run_scheduler(srv.scheduler, srv.tokenizer, 1, 8)  # warm-up
        for c in args.concurrency:
            record(run_scheduler(srv.scheduler, srv.tokenizer, c, args.max_tokens))
    if "http" in args.modes:
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        try:
            run_http(url, srv.model_name, 1, 8)  # warm-up
            for c in args.concurrency:
                record(run_http(url, srv.model_name, c, args.max_tokens))
        finally:
            server.should_exit = True
            thread.join(30)

    write_csv(args.out, rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
