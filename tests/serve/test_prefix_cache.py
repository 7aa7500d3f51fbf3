"""Prefix caching's bookkeeping (``PagePool``) and its use by the scheduler and the server, on the fake engine.

The bit-for-bit equality of cached and cold logits is tested on the real model in
tests/runtime/test_prefix_cache_smollm2.py; here: keys, refcounts, LRU eviction, no page lost, admission
counting shared pages, the hit counters in /metrics, and pages given back when a client disconnects.
"""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from perfx_compiler.errors import KVCacheFullError
from perfx_compiler.runtime.prefix_cache import PagePool, page_key
from perfx_compiler.runtime.sampling import SamplingParams
from perfx_compiler.serve.scheduler import Scheduler
from tests.serve.test_app import metric, wait_for


def run(pool: PagePool, prompt: list[int], decode: int = 0) -> tuple[int, int]:
    """A whole sequence: (tokens found cached, its first page); prefill the rest in one chunk, decode, end."""
    sid = pool.add_sequence(prompt)
    hit = pool.length(sid)
    pool.reserve(sid, len(prompt) - hit)
    pool.commit(sid, prompt[hit:], prefill=True)
    for t in range(decode):
        pool.reserve(sid, 1)
        pool.commit(sid, [t], prefill=False)
    first = pool.pages(sid)[0]
    pool.remove_sequence(sid)
    pool.check()
    return hit, first


def test_key_names_the_whole_prefix() -> None:
    a, b = list(range(4)), list(range(4, 8))
    assert page_key(b"", a) != page_key(b"", b)
    assert page_key(page_key(b"", a), b) != page_key(page_key(b"", b), b)  # same tokens, other prefix
    pool = PagePool(16, 4, 64)
    run(pool, a + b + [9, 9])
    assert pool.match(a + b + [1, 1]).tokens == 8
    assert pool.match(b + a + [1, 1]).tokens == 0  # the second page's tokens alone do not match
    assert pool.match([0, 1, 2, 5] + b + [1, 1]).tokens == 0  # first miss ends the match


def test_only_full_prefill_pages_are_cached_and_two_tokens_stay_to_prefill() -> None:
    pool = PagePool(16, 4, 64)
    assert run(pool, list(range(10)), decode=6)[0] == 0  # pages 0, 1 full by prefill; 2 partial, then decoded
    assert pool.cached_pages() == 2
    assert pool.match(list(range(16)) + [0, 0]).tokens == 8  # the decoded tokens' page is not cached
    assert pool.match(list(range(10))).tokens == 8
    assert pool.match(list(range(9))).tokens == 4  # 8 cached would leave 1 token: the last page is recomputed
    assert pool.match(list(range(8))).tokens == 4
    # a 1-token chunk's KV comes from other kernels: nothing from there on is cached
    sid = pool.add_sequence()
    for t in range(12):
        pool.reserve(sid, 1)
        pool.commit(sid, [100 + t], prefill=True)
    pool.remove_sequence(sid)
    assert pool.cached_pages() == 2
    pool.check()


def test_refcounts_lru_eviction_and_clear() -> None:
    pool = PagePool(6, 4, 64)
    p, q = list(range(10)), list(range(50, 60))  # 3 pages each, 2 of them cached afterwards
    run(pool, p)
    run(pool, q)
    assert (pool.cached_pages(), pool.free_pages(), pool.pages_in_use()) == (4, 6, 0)
    a, b = pool.add_sequence(p), pool.add_sequence(p)  # both hold p's 2 cached pages
    assert pool.length(a) == pool.length(b) == 8 and pool.pages(a) == pool.pages(b)
    assert (pool.cached_pages(), pool.pages_in_use()) == (2, 2)
    pool.reserve(a, 2 + 8)  # 3 new pages: the 2 free ones, then q's least recently used (its tail) is evicted
    assert pool.cached_pages() == 1
    assert pool.match(q).tokens == 4
    with pytest.raises(KVCacheFullError):
        pool.reserve(b, 2 + 8)  # 3 more: 1 cached page left
    pool.remove_sequence(a)
    assert pool.pages_in_use() == 2  # b still holds the shared pages
    pool.remove_sequence(b)
    pool.check()
    assert pool.pages_in_use() == 0 and pool.free_pages() == 6
    cached = pool.cached_pages()
    assert pool.clear() == cached > 0 and pool.cached_pages() == 0
    assert pool.match(p).tokens == 0
    pool.check()


def test_clear_while_sequences_hold_pages() -> None:
    pool = PagePool(8, 4, 64)
    sid = pool.add_sequence(list(range(10)))
    pool.reserve(sid, 10)
    pool.commit(sid, list(range(10)), prefill=True)
    assert pool.clear() == 0
    assert pool.match(list(range(10))).tokens == 0  # no longer shared...
    pool.remove_sequence(sid)
    assert pool.cached_pages() == 0 and pool.free_pages() == 8  # ...and freed, not cached, when it ends
    pool.check()


def test_prefix_cache_off() -> None:
    pool = PagePool(8, 4, 64, prefix_cache=False)
    run(pool, list(range(10)))
    assert pool.cached_pages() == 0 and run(pool, list(range(10)))[0] == 0


# -- scheduler --------------------------------------------------------------------------------------


class Counts:
    def __init__(self) -> None:
        self.queried = self.hit = 0

    def on_prefix_cache(self, queried: int, hit: int) -> None:
        self.queried += queried
        self.hit += hit

    def __getattr__(self, name: str) -> Any:  # the Observer's other hooks
        return lambda *a: None


@pytest.fixture
def sched(sched_factory: Any) -> Any:
    """``sched_factory`` with a Counts observer on every scheduler."""
    return lambda engine_kw=None, **kw: sched_factory(engine_kw, observer=Counts(), **kw)


def ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def test_second_request_prefills_only_its_uncached_part(sched: Any, tokenizer: Any) -> None:
    s = sched(engine_kw={"page_size": 4})
    eng, obs = s.engine, s.observer
    params = SamplingParams(temperature=0.0, max_tokens=6)
    system = ids(tokenizer, "You are terse. " * 3)  # 45 tokens + BOS: 11 full pages
    first = s.submit(system + ids(tokenizer, "Hi?"), params).result(timeout=10)[0]
    assert obs.hit == 0 and eng.cached_pages() == 12  # BOS + 48 prompt tokens: 12 full pages
    eng.prefill_chunks.clear()
    again = s.submit(system + ids(tokenizer, "Hi?"), params).result(timeout=10)[0]
    s.submit(system + ids(tokenizer, "Yo!"), params).result(timeout=10)
    assert again.token_ids == first.token_ids
    assert eng.prefill_chunks == [49 - 44, 49 - 44]  # 11 pages cached for "Hi?", 11 shared by "Yo!"
    assert (obs.queried, obs.hit) == (3 * 49, 2 * 44)
    cached = eng.cached_pages()
    assert s.clear_prefix_cache() == cached > 0 and eng.cached_pages() == 0
    s.submit(system + ids(tokenizer, "Hi?"), params).result(timeout=10)
    assert obs.hit == 2 * 44  # cold again
    eng.page_pool.check()


def test_admission_counts_shared_pages(sched: Any, tokenizer: Any) -> None:
    # 10 pages of 4: BOS + 20 prompt tokens + 3 generated need 6 pages, so two copies of one prompt fit only
    # if they share their 4 cached prompt pages (4 + 2 + 2). Decode is held until both are admitted.
    prompt = ids(tokenizer, "abcdefghijklmnopqrst")
    params = SamplingParams(temperature=0.0, max_tokens=3)
    for cache, together in ((True, 2), (False, 1)):
        gate = threading.Event()
        s = sched(engine_kw={"num_pages": 10, "decode_gate": gate, "prefix_cache": cache})
        if cache:
            gate.set()
            s.submit(prompt, params).result(timeout=10)  # warms the cache
            gate.clear()
        with s._cv:  # the worker's admission waits for this lock: both requests meet it in the queue
            hs = [s.submit(prompt, params) for _ in range(2)]
        assert wait_for(lambda s=s, k=together: s.stats().running == k and s.stats().queue_depth == 2 - k, 10)
        gate.set()
        assert len({tuple(h.result(timeout=10)[0].token_ids) for h in hs}) == 1
        assert max(s.engine.decode_batch_sizes) == together
        s.engine.page_pool.check()
        assert s.engine.pages_in_use() == 0 and s.engine.free_pages() == 10


def test_no_one_token_prefill_chunks(sched: Any, tokenizer: Any) -> None:
    # Prompts (+ BOS) of 7, 16 and 9 tokens, all admitted in one step, budget 8 per step. Step 1: 7, and the
    # 1 token left of the budget is not spent on the next prompt; then 8 + 8; then 9 (not 8 + 1).
    s = sched(prefill_chunk=8)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with s._cv:  # the worker's admission waits for this lock: all three are admitted together
        hs = [s.submit(ids(tokenizer, c * n), params) for c, n in (("z", 6), ("y", 15), ("x", 8))]
    for h in hs:
        h.result(timeout=10)
    assert s.engine.prefill_chunks == [7, 8, 8, 9]


def test_preemption_with_cached_pages_loses_nothing(sched: Any, make_engine: Any, tokenizer: Any) -> None:
    from tests.serve.test_scheduler import reference

    s = sched(engine_kw={"num_pages": 14, "page_size": 4}, prefill_chunk=8)
    params = SamplingParams(temperature=0.0, max_tokens=20)
    prompts = ["shared prefix! " + x for x in ("one", "two", "three", "four", "five", "six")]
    hs = [s.submit(ids(tokenizer, p), params) for p in prompts]
    for p, h in zip(prompts, hs, strict=True):
        assert h.result(timeout=30)[0].token_ids == reference(make_engine, tokenizer, p, params).token_ids
    assert s.stats().preemptions > 0 and s.observer.hit > 0
    s.engine.page_pool.check()
    assert s.engine.pages_in_use() == 0 and s.engine.free_pages() == 14


# -- server -----------------------------------------------------------------------------------------


def test_metrics_hit_rate_cached_pages_and_reset(serve: Any, tokenizer: Any) -> None:
    srv = serve(engine_kw={"page_size": 4})
    body = {"prompt": "The same long prompt, twice over", "max_tokens": 3, "temperature": 0}
    n = 1 + len(ids(tokenizer, body["prompt"]))  # with BOS
    hit = (n - 2) // 4 * 4  # the second request recomputes at least its last 2 tokens
    assert metric(srv, "perfx_prefix_cache_hit_rate") == 0
    for _ in range(2):
        assert httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30).status_code == 200
    assert metric(srv, "perfx_prefix_cache_queries_total") == 2 * n
    assert metric(srv, "perfx_prefix_cache_hits_total") == hit > 0
    assert metric(srv, "perfx_prefix_cache_hit_rate") == pytest.approx(hit / (2 * n))
    assert wait_for(lambda: metric(srv, "perfx_kv_pages_cached") == n // 4, 10)  # the prompt's full pages
    assert metric(srv, "perfx_kv_pages_used") == 0
    r = httpx.post(f"{srv.url}/reset_prefix_cache", timeout=30)
    assert r.status_code == 200 and r.json() == {"freed_pages": n // 4}
    assert srv.engine.cached_pages() == 0


def test_disconnect_mid_stream_drops_shared_page_refcounts(serve: Any) -> None:
    srv = serve(engine_kw={"step_delay": 0.005, "max_context": 4096, "page_size": 4})
    eng = srv.engine
    prompt = "A shared system prompt. "
    assert httpx.post(f"{srv.url}/v1/completions", json={"prompt": prompt + "warm", "max_tokens": 1}).is_success
    body = {"prompt": prompt + "stream", "max_tokens": 4000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=10) as r:
        lines = r.iter_lines()
        assert any(next(lines).startswith("data: ") for _ in range(4))
        assert metric(srv, "perfx_prefix_cache_hits_total") > 0  # the stream runs on shared pages
        assert metric(srv, "perfx_kv_pages_used") > 0
    assert wait_for(lambda: metric(srv, "perfx_running_sequences") == 0 and eng.pages_in_use() == 0, 30)
    eng.page_pool.check()  # every refcount back to zero, no page lost
    assert eng.free_pages() == eng.num_pages and eng.cached_pages() > 0
    assert metric(srv, "perfx_sequences_finished_total", '{reason="abort"}') == 1


def test_clear_prefix_cache_needs_a_running_scheduler(make_engine: Any, tokenizer: Any) -> None:
    from perfx_compiler.serve.scheduler import SchedulerClosed

    s = Scheduler(make_engine(), tokenizer)
    with pytest.raises(SchedulerClosed):
        s.clear_prefix_cache()
    s.start()
    assert s.clear_prefix_cache() == 0
    s.shutdown()
    with pytest.raises(SchedulerClosed):
        s.clear_prefix_cache()
