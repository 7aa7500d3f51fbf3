"""A shared-prefix workload for the prefix cache: users who share a long system prompt (the KJV evaluation
text under an instruction, cut to ``system_tokens``) and each ask a different short question, greedy,
one after the other through the continuous-batching ``Scheduler`` (in-process, so a time to first token
is the prefill and never queueing). ``on``: the cache as served; ``cold``: ``clear_prefix_cache()`` (what
``POST /reset_prefix_cache`` calls) before every request."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
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


class HitCounter:
    """The scheduler's Observer, keeping only each admission's cached tokens."""

    def __init__(self) -> None:
        self.cached: list[int] = []

    def on_prefix_cache(self, queried: int, hit: int) -> None:
        self.cached.append(hit)

    def __getattr__(self, name: str) -> Any:  # the Observer's other hooks: nothing to record
        return lambda *args: None


def shared_prefix_prompts(tok: Any, system_tokens: int, users: int) -> list[list[int]]:
    """Token ids of each user's prompt: the same ``system_tokens`` first, then the user's question."""
    head = tok.encode("You are a helpful assistant. Answer questions about this text.\n\n")
    system = (head + tok.encode(TEXT.read_text()))[:system_tokens]
    if len(system) < system_tokens:
        raise SystemExit(f"the text has only {len(system)} tokens")
    return [system + tok.encode(f"\n\nQuestion: {q}\nAnswer:") for q in (QUESTIONS * users)[:users]]


def run_users(sched: Any, hits: HitCounter, mode: str, ids: list[list[int]], max_tokens: int) -> list[dict]:
    """One pass of all users in ``mode`` ("on" or "cold"); per user its TTFT, cached tokens and tokens."""
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
                    "prompt_tokens": len(h.prompt_token_ids), "cached_tokens": hits.cached[-1],
                    "tokens": r.token_ids})  # fmt: skip
    return out


def summarize_users(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Rows ``user`` = "hits" per mode: median and p90 TTFT of users 2..N, and the cold/on ratio."""
    summary, med = [], {}
    for m in ("on", "cold"):
        hits = sorted(r["ttft_ms"] for r in rows if r["mode"] == m and r["user"] > 1)
        med[m] = statistics.median(hits) if hits else float("nan")
        p90 = hits[min(len(hits) - 1, int(0.9 * len(hits)))] if hits else float("nan")
        summary.append({"round": "all", "mode": m, "user": "hits", "ttft_ms": med[m], "ttft_p90_ms": p90})
    for s in summary:
        s["speedup_vs_cold"] = med["cold"] / s["ttft_ms"]
    return summary, med
