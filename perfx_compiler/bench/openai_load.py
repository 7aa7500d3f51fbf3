"""Load through the OpenAI client: concurrent streaming completions against any OpenAI-compatible server
(PerfX's, llama.cpp's ``llama-server``), each stream's chunk arrival times, text and token count, and the
run's aggregate tok/s with p50 / p99 time to first token and inter-token latency."""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

SUBJECTS = ["the ocean", "a small town", "mountains", "a robot", "the moon", "coffee", "trains", "a library",
            "winter", "a garden", "music", "the desert", "a city at night", "rivers", "a lighthouse", "bread"]


def story_prompt(i: int) -> str:
    """Client ``i``'s prompt: distinct per client, about 20 tokens."""
    return f"Write a short story about {SUBJECTS[i % len(SUBJECTS)]} (number {i}). Once upon a time,"


def one_stream(url: str, i: int, max_tokens: int, start: threading.Barrier | None = None) -> dict[str, Any]:
    """One greedy streaming completion of ``story_prompt(i)`` (``ignore_eos``): its text, chunk arrival
    times and token count (the usage chunk's when the server sends one, else the chunks)."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=900)
    model = client.models.list().data[0].id
    if start is not None:
        start.wait()
    t0 = time.perf_counter()
    times: list[float] = []
    text: list[str] = []
    tokens, error = 0, ""
    try:
        stream = client.completions.create(model=model, prompt=story_prompt(i), max_tokens=max_tokens, temperature=0,
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


def concurrent_streams(url: str, clients: int, max_tokens: int) -> tuple[list[dict[str, Any]], float]:
    """``clients`` streams started together (a barrier); (streams, wall seconds from the first start)."""
    barrier = threading.Barrier(clients)
    with ThreadPoolExecutor(clients) as pool:
        streams = list(pool.map(lambda i: one_stream(url, i, max_tokens, barrier), range(clients)))
    return streams, time.perf_counter() - min(s["t0"] for s in streams)


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def summarize_streams(runs: list[tuple[list[dict[str, Any]], float]], alone: dict[int, str]) -> dict[str, Any]:
    """Median aggregate tok/s over runs; TTFT and inter-token gaps pooled over every stream of every run;
    ``same_as_alone``: streams whose text equals ``alone[i]`` (client i's text when it ran alone)."""
    agg: list[float] = []
    ttft: list[float] = []
    itl: list[float] = []
    same = errors = tokens = 0
    first_error = ""
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
    return {"agg_tok_s": statistics.median(agg), "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
            "itl_p50_ms": _pct(itl, 50), "itl_p99_ms": _pct(itl, 99), "completion_tokens": tokens, "errors": errors,
            "first_error": first_error, "same_as_alone": same, "streams": sum(len(r[0]) for r in runs),
            "rounds": len(runs)}
