"""Continuous batching: same text as one-at-a-time generation, batching, chunked prefill, pages, queue."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from perfx_compiler.runtime.generate import generate_sequence
from perfx_compiler.runtime.sampling import SamplingParams
from perfx_compiler.serve.scheduler import QueueFull, SchedulerClosed, StreamEvent


class SingleView:
    """The single-sequence ``Engine`` interface over a FakeBatchEngine (for generate_sequence)."""

    def __init__(self, engine: Any) -> None:
        self.e = engine
        self.manifest = engine.manifest
        self.max_context = engine.max_context
        self.sid: int | None = None
        self.position = 0

    def reset(self) -> None:
        if self.sid is not None:
            self.e.remove_sequence(self.sid)
        self.sid = self.e.add_sequence()
        self.position = 0

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        self.position += len(ids)
        return self.e.prefill(self.sid, ids)[None]

    def decode(self, tok: int) -> np.ndarray:
        self.position += 1
        return self.e.decode([self.sid], [tok])[0]


def reference(make_engine: Any, tokenizer: Any, prompt: str, params: SamplingParams, **kw: Any) -> Any:
    view = SingleView(make_engine(**kw))
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    return generate_sequence(view, ids, params, tokenizer=tokenizer)


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


PROMPTS = ["Hello world", "The quick brown fox", "a", "Lorem ipsum dolor sit amet, consectetur", "xyz " * 6]


def test_single_request_matches_generate_sequence(sched_factory: Any, make_engine: Any, tokenizer: Any) -> None:
    sched = sched_factory()
    for prompt in PROMPTS:
        params = SamplingParams(temperature=0.0, max_tokens=20)
        got = sched.submit(encode(tokenizer, prompt), params).result(timeout=10)[0]
        ref = reference(make_engine, tokenizer, prompt, params)
        assert got.token_ids == ref.token_ids and got.text == ref.text
        assert got.finish_reason == ref.finish_reason == "length"


def test_seeded_sampling_matches_generate_sequence(sched_factory: Any, make_engine: Any, tokenizer: Any) -> None:
    sched = sched_factory()
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=7, max_tokens=24)
    got = sched.submit(encode(tokenizer, "Hello"), params).result(timeout=10)[0]
    ref = reference(make_engine, tokenizer, "Hello", params)
    assert got.token_ids == ref.token_ids


def test_concurrent_requests_batch_and_match_alone(sched_factory: Any, make_engine: Any, tokenizer: Any) -> None:
    sched = sched_factory(engine_kw={"max_batch": 8}, prefill_chunk=16)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    handles = [sched.submit(encode(tokenizer, p * 2), params) for p in PROMPTS * 3]
    results = [h.result(timeout=20)[0] for h in handles]
    for p, r in zip(PROMPTS * 3, results, strict=True):
        ref = reference(make_engine, tokenizer, p * 2, params)
        assert r.token_ids == ref.token_ids
    sizes = sched.engine.decode_batch_sizes
    assert max(sizes) > 1 and max(sizes) <= 8  # batched, never over max_batch
    assert max(sched.engine.prefill_chunks) <= 16 + 1  # chunked prefill (a chunk may take one token over: no 1-token rest)


def test_chunked_prefill_does_not_stall_running_sequences(sched_factory: Any, tokenizer: Any) -> None:
    sched = sched_factory(engine_kw={"max_context": 512, "step_delay": 0.001}, prefill_chunk=8)
    eng = sched.engine
    short = sched.submit(encode(tokenizer, "hi"), SamplingParams(temperature=0.0, max_tokens=60))
    deadline = time.monotonic() + 5
    while not eng.decode_batch_sizes and time.monotonic() < deadline:
        time.sleep(0.001)
    n_before = len(eng.decode_batch_sizes)
    long_prompt = encode(tokenizer, "z" * 200)
    long = sched.submit(long_prompt, SamplingParams(temperature=0.0, max_tokens=2))
    long.result(timeout=10)
    # ~25 chunks of 8 prompt tokens, each followed by a decode step of the short request
    assert len(eng.decode_batch_sizes) - n_before >= 20
    assert short.result(timeout=10)[0].finish_reason == "length"


def test_one_prefill_call_per_step(sched_factory: Any, tokenizer: Any) -> None:
    """Short prompts arriving together are prefilled one per step, each step followed by the decode of the
    sequences already running: a prefill call costs a pass over the weights whatever its length, so
    prefilling all of them in one step held the first stream's second token for every other prompt's call."""
    sched = sched_factory(prefill_chunk=256)
    eng = sched.engine
    calls: list[str] = []
    prefill, decode = eng.prefill, eng.decode
    eng.prefill = lambda sid, ids: calls.append("p") or prefill(sid, ids)
    eng.decode = lambda sids, toks: calls.append(f"d{len(sids)}") or decode(sids, toks)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with sched._cv:  # the worker's admission waits for this lock: all four are admitted in one step
        handles = [sched.submit(encode(tokenizer, p), params) for p in PROMPTS[:4]]
    for h in handles:
        h.result(timeout=10)
    assert calls[:7] == ["p", "p", "d1", "p", "d2", "p", "d3"], calls


def test_streamed_deltas_equal_final_text_with_stop_strings(sched_factory: Any, tokenizer: Any) -> None:
    sched = sched_factory()
    ids = encode(tokenizer, "Hello world")
    full = sched.submit(ids, SamplingParams(temperature=0.0, max_tokens=30)).result(timeout=10)[0].text
    stop = full[11:14]
    events: list[StreamEvent] = []
    params = SamplingParams(temperature=0.0, max_tokens=30, stop=["@@never", stop])
    r = sched.submit(ids, params, on_event=events.append).result(timeout=10)[0]
    assert r.text == full[: full.index(stop)] and r.finish_reason == "stop" and r.stop_reason == stop
    assert "".join(e.text for e in events) == r.text
    assert events[-1].finish_reason == "stop" and events[-1].request_finished
    assert sum(len(e.token_ids) for e in events) == len(r.token_ids)


def test_eos_stop_token_ids_ignore_eos_and_min_tokens(sched_factory: Any, tokenizer: Any) -> None:
    sched = sched_factory(engine_kw={"eos_after": 5})
    ids = encode(tokenizer, "Hello")
    r = sched.submit(ids, SamplingParams(temperature=0.0, max_tokens=30)).result(timeout=10)[0]
    assert r.finish_reason == "stop" and r.stop_reason is None and len(r.token_ids) == 6
    r = sched.submit(ids, SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)).result(timeout=10)[0]
    assert r.finish_reason == "length" and len(r.token_ids) == 9
    first = r.token_ids[1]
    r = sched.submit(ids, SamplingParams(temperature=0.0, max_tokens=9, stop_token_ids=[first])).result(timeout=10)[0]
    assert r.finish_reason == "stop" and r.stop_reason == first and len(r.token_ids) == 2
    r = sched.submit(ids, SamplingParams(temperature=0.0, max_tokens=12, min_tokens=8)).result(timeout=10)[0]
    assert len(r.token_ids) >= 8


def test_n_sequences_seeded_are_reproducible(sched_factory: Any, tokenizer: Any) -> None:
    sched = sched_factory()
    ids = encode(tokenizer, "Once")
    params = SamplingParams(temperature=1.0, n=3, seed=11, max_tokens=10)
    a = sched.submit(ids, params).result(timeout=10)
    b = sched.submit(ids, params).result(timeout=10)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert len({tuple(r.token_ids) for r in a}) > 1  # each of the n draws its own tokens


def test_context_full_finishes_with_length(sched_factory: Any, tokenizer: Any) -> None:
    sched = sched_factory(engine_kw={"max_context": 24})
    ids = encode(tokenizer, "0123456789")
    r = sched.submit(ids, SamplingParams(temperature=0.0, max_tokens=None)).result(timeout=10)[0]
    assert r.finish_reason == "length" and len(r.token_ids) == 24 - 11  # BOS + 10 prompt tokens


def test_pool_exhausted_requests_wait_then_run(sched_factory: Any, make_engine: Any, tokenizer: Any) -> None:
    # 12 pages of 4 tokens: one request (BOS + 19 prompt + 20 generated) needs 10, so they run one by one.
    sched = sched_factory(engine_kw={"num_pages": 12, "page_size": 4})
    params = SamplingParams(temperature=0.0, max_tokens=20)
    prompts = ["abcdefghijklmnopqrs", "ABCDEFGHIJKLMNOPQRS", "0123456789012345678"]
    handles = [sched.submit(encode(tokenizer, p), params) for p in prompts]
    for p, h in zip(prompts, handles, strict=True):
        assert h.result(timeout=20)[0].token_ids == reference(make_engine, tokenizer, p, params).token_ids
    assert sched.engine.free_pages() == 12
    assert sched.stats().preemptions > 0  # growth past the pool was handled by preempt + recompute


def test_cancel_frees_pages_at_once(sched_factory: Any, tokenizer: Any) -> None:
    sched = sched_factory(engine_kw={"step_delay": 0.002, "max_context": 4096})
    got = threading.Event()
    h = sched.submit(encode(tokenizer, "Hello"), SamplingParams(max_tokens=4000), on_event=lambda e: got.set())
    assert got.wait(5)
    assert sched.engine.free_pages() < sched.engine.num_pages
    h.cancel()
    assert h.wait(5)
    assert h.results[0].finish_reason == "abort"
    assert sched.engine.free_pages() == sched.engine.num_pages
    assert sched.stats().kv_pages_used == 0


def test_queue_full_and_shutdown(sched_factory: Any, tokenizer: Any) -> None:
    # max_batch 1 and a slow engine: one runs, two wait, the fourth is refused.
    sched = sched_factory(engine_kw={"step_delay": 0.01}, max_batch=1, max_queue=2)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    ids = encode(tokenizer, "Hi")
    running = sched.submit(ids, params)
    deadline = time.monotonic() + 5
    while sched.stats().running == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    queued = [sched.submit(ids, params) for _ in range(2)]
    with pytest.raises(QueueFull) as info:
        sched.submit(ids, params)
    assert info.value.retry_after > 0
    assert sched.stats().queue_depth == 2
    sched.shutdown()
    assert all(h.done for h in [running, *queued])
    assert {h.results[0].finish_reason for h in [running, *queued]} == {"abort"}
    with pytest.raises(SchedulerClosed):
        sched.submit(ids, params)


def test_engine_error_fails_running_requests_only(sched_factory: Any, tokenizer: Any) -> None:
    sched = sched_factory()
    eng = sched.engine
    real = eng.decode
    calls = {"n": 0}

    def flaky(seq_ids: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real(seq_ids, token_ids)

    eng.decode = flaky
    r = sched.submit(encode(tokenizer, "Hi"), SamplingParams(max_tokens=10)).result(timeout=10)[0]
    assert r.finish_reason == "error" and "boom" in (r.error or "")
    assert eng.free_pages() == eng.num_pages
    r = sched.submit(encode(tokenizer, "Hi"), SamplingParams(max_tokens=10)).result(timeout=10)[0]
    assert r.finish_reason == "length"  # the worker survived
