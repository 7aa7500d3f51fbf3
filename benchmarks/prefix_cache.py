"""Prefix caching: time to first token of users sharing a long system prompt, cache on vs cold.

Workload: a ``--system-tokens`` system prompt (the KJV evaluation text under an instruction, cut to that
many tokens) followed by each of ``--users`` different short questions, greedy, ``--max-tokens`` tokens,
through the continuous-batching ``Scheduler`` over one ``BatchEngine`` (in-process: no HTTP, so the
prefill is what the TTFT measures). The users come one after the other, so a TTFT is never queueing:

  on    the prefix cache as served: the first user prefills the system prompt, the others start on its
        cached pages and prefill only their question (plus the system prompt's partial last page);
  cold  the same, with ``Scheduler.clear_prefix_cache()`` (the API behind ``POST /reset_prefix_cache``)
        before every request: each user prefills the whole prompt.

Modes alternate per round (``--rounds``). Per request: TTFT, prompt and cached tokens, and whether its
greedy tokens equal the cold run's (they must: the cache does not change a request's logits).
Summary rows (``user`` = "hits"): median and p90 TTFT of users 2..N and the cold/on ratio.
Writes ``--out`` (default benchmarks/results/prefix_cache.csv).

    python benchmarks/prefix_cache.py [--artifact DIR] [--system-tokens 1024] [--users 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _common import RESULTS, alternated, write_csv

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ARTIFACT = REPO / "build" / "bench-prefix-cache" / "smollm2-135m-host"
TEXT = REPO / "benchmarks" / "data" / "kjv_eval_mark_ruth.txt"
QUESTIONS = [
    "Who is the text about?", "Summarize it in one line.", "Where does it take place?", "What happens first?",
    "Name one person in it.", "What is the tone?", "Is there a journey?", "What is the last event?",
    "Who speaks the most?", "What does the title mean?", "Give one quote.", "What is a theme?",
    "Who is Ruth?", "Who is Naomi?", "Where is Bethlehem?", "What is a parable?",
    "Who are the disciples?", "What is the sea of Galilee?", "What is a miracle here?", "Who is John?",
    "What is the harvest?", "Who is Boaz?", "What does Moab mean?", "How does it end?",
    "What is the sabbath?", "Who are the scribes?", "What is bread here?", "Who is Peter?",
    "What is the kingdom?", "What is a field?", "Who is the mother?", "What is the law?",
]  # fmt: skip
COLUMNS = ["round", "mode", "user", "ttft_ms", "prompt_tokens", "cached_tokens", "same_as_cold", "ttft_p90_ms",
           "speedup_vs_cold", "system_tokens", "max_tokens"]  # fmt: skip


class _HitCounter:
    """The scheduler's Observer, keeping only each admission's cached tokens."""

    def __init__(self) -> None:
        self.cached: list[int] = []

    def on_prefix_cache(self, queried: int, hit: int) -> None:
        self.cached.append(hit)

    def __getattr__(self, name: str) -> Any:  # the Observer's other hooks: nothing to record
        return lambda *args: None


def ensure_artifact(path: Path | None, max_context: int) -> Path:
    if path is not None:
        return path
    if not (DEFAULT_ARTIFACT / "perfx-config.json").is_file():
        from perfx_compiler.pipeline import compile_model

        print(f"compiling smollm2-135m (host, batching, max_context {max_context}) ...", file=sys.stderr)
        compile_model("smollm2-135m", "host", DEFAULT_ARTIFACT, progress=False, batching=True,
                      max_context=max_context)  # fmt: skip
    return DEFAULT_ARTIFACT


def prompts(tok: Any, system_tokens: int, users: int) -> list[list[int]]:
    head = tok.encode("You are a helpful assistant. Answer questions about this text.\n\n")
    body = tok.encode(TEXT.read_text())
    system = (head + body)[:system_tokens]
    if len(system) < system_tokens:
        raise SystemExit(f"the text has only {len(system)} tokens")
    return [system + tok.encode(f"\n\nQuestion: {q}\nAnswer:") for q in (QUESTIONS * users)[:users]]


def run_mode(sched: Any, obs: _HitCounter, mode: str, ids: list[list[int]], max_tokens: int) -> list[dict]:
    from perfx_compiler.runtime.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    sched.clear_prefix_cache()  # every mode starts cold: the first user pays the system prompt
    out = []
    for user, prompt in enumerate(ids):
        if mode == "cold":
            sched.clear_prefix_cache()
        h = sched.submit(prompt, params)
        r = h.result(timeout=1800)[0]
        out.append({"user": user + 1, "ttft_ms": (h.first_token_time - h.arrival_time) * 1e3,
                    "prompt_tokens": len(h.prompt_token_ids), "cached_tokens": obs.cached[-1],
                    "tokens": r.token_ids})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifact", type=Path, default=None, help="artifact compiled with batching (default: compile)")
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prefill-chunk", type=int, default=2048, help="the scheduler's (default: a whole prompt)")
    ap.add_argument("--out", type=Path, default=RESULTS / "prefix_cache.csv")
    args = ap.parse_args(argv)

    import perfx_compiler.pipeline  # noqa: F401  (before the runtime: TVM's import order)
    from perfx_compiler.runtime.api import Tokenizer
    from perfx_compiler.runtime.batch_engine import BatchEngine
    from perfx_compiler.runtime.engine import read_manifest
    from perfx_compiler.runtime.generate import model_info
    from perfx_compiler.serve.scheduler import Scheduler

    art = ensure_artifact(args.artifact, max_context=2048)
    page_size = int(read_manifest(art, verify=False)["paged_kv"]["page_size"])
    # Room for the running request and the cached system prompt (and a question's pages) at once.
    pages = 3 * -(-(args.system_tokens + 64 + args.max_tokens) // page_size)
    eng = BatchEngine(art, verify=False, max_batch=1, num_pages=pages)
    tok = Tokenizer.from_file(eng.tokenizer_path, model_info(eng))
    ids = prompts(tok, args.system_tokens, args.users)
    longest = max(len(p) for p in ids) + 1 + args.max_tokens  # + BOS
    if longest > eng.max_context:
        raise SystemExit(f"{longest} tokens do not fit the artifact's context of {eng.max_context}")
    obs = _HitCounter()
    sched = Scheduler(eng, tok, max_batch=1, prefill_chunk=args.prefill_chunk, observer=obs)
    sched.start()
    rows: list[dict[str, Any]] = []
    try:
        for rnd in range(args.rounds):
            got = {m: run_mode(sched, obs, m, ids, args.max_tokens) for m in alternated(["on", "cold"], rnd)}
            for m in ("on", "cold"):
                for r, c in zip(got[m], got["cold"], strict=True):
                    rows.append({"round": rnd, "mode": m, **{k: v for k, v in r.items() if k != "tokens"},
                                 "same_as_cold": r["tokens"] == c["tokens"]})  # fmt: skip
    finally:
        sched.shutdown()
    summary = []
    med: dict[str, float] = {}
    for m in ("on", "cold"):
        hits = sorted(r["ttft_ms"] for r in rows if r["mode"] == m and r["user"] > 1)
        med[m] = statistics.median(hits) if hits else float("nan")
        p90 = hits[min(len(hits) - 1, int(0.9 * len(hits)))] if hits else float("nan")
        summary.append({"round": "all", "mode": m, "user": "hits", "ttft_ms": med[m], "ttft_p90_ms": p90})
    for s in summary:
        s["speedup_vs_cold"] = med["cold"] / s["ttft_ms"]
    for r in rows + summary:
        r.update(system_tokens=args.system_tokens, max_tokens=args.max_tokens)
    write_csv(args.out, rows + summary, COLUMNS, floats=".2f")
    same = all(r["same_as_cold"] for r in rows)
    print(f"TTFT median (users 2..{args.users}): on {med['on']:.1f} ms, cold {med['cold']:.1f} ms "
          f"({med['cold'] / med['on']:.1f}x); greedy tokens equal to cold: {same}; wrote {args.out}")  # fmt: skip
    return 0 if same else 1


if __name__ == "__main__":
    t0 = time.perf_counter()
    code = main()
    print(f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    sys.exit(code)
