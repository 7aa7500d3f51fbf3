"""Prefix caching on the real default model (SmolLM2-135M, the session's ``smol_artifact``): a request's
logits, and so its greedy text, are bit for bit those of the same request on a cold cache.

Each case runs a prompt cold (after ``clear_prefix_cache()``, the real API) and hot (the cache warmed by an
earlier prompt), and asserts that the hot run really started on cached pages (``length`` after
``add_sequence`` and the tokens prefilled): with caching silently off these tests fail. Page accounting is
checked after each case (``PagePool.check``: refcounts equal holders, no page lost or in two places).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

import perfx_compiler.pipeline  # noqa: F401  (before runtime.engine: it sets up TVM's import order)
from perfx_compiler.runtime.batch_engine import BatchEngine
from perfx_compiler.serve.scheduler import Scheduler

pytestmark = pytest.mark.slow
PS = 16  # the artifact's page size (checked below)
STEPS = 6  # greedy decode steps after the prompt


@pytest.fixture(scope="module")
def eng(smol_artifact: Path) -> BatchEngine:
    e = BatchEngine(smol_artifact, verify=False, max_batch=4)
    assert e.page_size == PS
    return e


def prompt_ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(50, 40000, n).tolist()


def greedy(e: BatchEngine, prompt: Sequence[int]) -> tuple[int, int, np.ndarray, list[int]]:
    """(tokens found cached, tokens prefilled, the logits of every step, the greedy tokens)."""
    before = e.prefilled_tokens
    sid = e.add_sequence(prompt)
    hit = e.length(sid)
    logits = [np.array(e.prefill(sid, prompt[hit:]))]
    toks = [int(np.argmax(logits[-1]))]
    for _ in range(STEPS):
        logits.append(np.array(e.decode([sid], [toks[-1]])[0]))
        toks.append(int(np.argmax(logits[-1])))
    e.remove_sequence(sid)
    return hit, e.prefilled_tokens - before, np.stack(logits), toks


def cold(e: BatchEngine, prompt: Sequence[int]) -> tuple[np.ndarray, list[int]]:
    e.clear_prefix_cache()
    hit, ran, logits, toks = greedy(e, prompt)
    assert hit == 0 and ran == len(prompt)
    return logits, toks


def assert_same(hot: tuple[int, int, np.ndarray, list[int]], ref: tuple[np.ndarray, list[int]]) -> None:
    _, _, logits, toks = hot
    assert toks == ref[1]
    assert np.array_equal(logits, ref[0]), f"max |diff| {np.abs(logits - ref[0]).max()}"


def assert_no_leak(e: BatchEngine) -> None:
    e.page_pool.check()
    assert e.pages_in_use() == 0
    assert e.free_pages() == e.num_pages  # cached pages count as free (evicted on demand)
    e.clear_prefix_cache()
    assert e.cached_pages() == 0 and e.page_pool.free_pages() == e.num_pages
    e.page_pool.check()


def test_same_prompt_twice(eng: BatchEngine) -> None:
    p = prompt_ids(57, 1)  # 3 full pages + 9
    ref = cold(eng, p)  # also warms the cache
    hot = greedy(eng, p)
    assert hot[:2] == (3 * PS, 57 - 3 * PS)
    assert_same(hot, ref)
    assert_no_leak(eng)


def test_shared_prefix_different_suffixes(eng: BatchEngine) -> None:
    system = prompt_ids(70, 2)  # 4 full pages + 6 tokens that the suffixes' pages start with
    a, b = system + prompt_ids(12, 3), system + prompt_ids(25, 4)
    ref_b = cold(eng, b)
    cold(eng, a)  # the cache now holds a's 5 full pages; b shares the first 4
    hot = greedy(eng, b)
    assert hot[:2] == (4 * PS, len(b) - 4 * PS)
    assert_same(hot, ref_b)
    assert_no_leak(eng)


def test_prompt_on_a_page_boundary_whole_prompt_cached(eng: BatchEngine) -> None:
    p = prompt_ids(3 * PS, 5)
    ref = cold(eng, p)
    assert eng.cached_pages() == 3  # all of it is cached...
    hot = greedy(eng, p)
    assert hot[:2] == (2 * PS, PS)  # ...but its last page is recomputed, into a page of its own
    assert_same(hot, ref)
    assert eng.cached_pages() == 3  # the recomputed copy was not registered twice
    p1 = p + prompt_ids(1, 6)  # one token past the boundary: the last full page is recomputed too
    ref1 = cold(eng, p1)
    hot1 = greedy(eng, p1)
    assert hot1[:2] == (2 * PS, PS + 1)
    assert_same(hot1, ref1)
    assert_no_leak(eng)


def test_concurrent_sequences_share_pages(eng: BatchEngine) -> None:
    p = prompt_ids(40, 7)
    ref = cold(eng, p)
    eng.clear_prefix_cache()
    a = eng.add_sequence(p)
    eng.prefill(a, p)  # registers pages 0 and 1 while a holds them
    b = eng.add_sequence(p)
    assert eng.length(b) == 2 * PS
    assert eng.page_pool.pages(b)[:2] == eng.page_pool.pages(a)[:2]
    assert eng.pages_in_use() == 3  # a's 3 pages; b shares 2 and has not allocated its own yet
    logits = eng.prefill(b, p[2 * PS :])
    assert np.array_equal(logits, ref[0][0])
    eng.remove_sequence(a)  # b still holds the shared pages: they stay in use, not cached
    assert eng.cached_pages() == 0 and eng.pages_in_use() == 3
    eng.remove_sequence(b)
    assert eng.cached_pages() == 2
    assert_no_leak(eng)


def test_eviction_under_a_tiny_pool_then_reuse(smol_artifact: Path) -> None:
    e = BatchEngine(smol_artifact, verify=False, max_batch=1, num_pages=6)
    p, q = prompt_ids(50, 8), prompt_ids(50, 9)  # 4 pages each (with the decoded tokens), 3 of them full
    ref_p, ref_q = greedy(e, p), greedy(e, q)  # cold: nothing cached yet
    assert ref_p[0] == ref_q[0] == 0
    # q took the 3 free pages and evicted one of p's: the last (a sequence's pages are released tail first)
    assert e.cached_pages() == 5
    hot_p = greedy(e, p)
    assert hot_p[:2] == (2 * PS, 50 - 2 * PS)
    assert_same(hot_p, ref_p[2:])
    hot_q = greedy(e, q)  # p's run evicted q's last cached page (the least recently used one)
    assert hot_q[:2] == (2 * PS, 50 - 2 * PS)
    assert_same(hot_q, ref_q[2:])
    assert_no_leak(e)


def test_scheduler_text_hot_equals_cold(eng: BatchEngine) -> None:
    from perfx_compiler.runtime.api import SamplingParams, Tokenizer
    from perfx_compiler.runtime.generate import model_info

    tok = Tokenizer.from_file(eng.tokenizer_path, model_info(eng))
    system = "You are a helpful assistant. Answer briefly and truthfully, in one sentence. " * 3
    questions = ["What is the capital of France?", "Why is the sky blue?", "Name a prime number."]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    sched = Scheduler(eng, tok, prefill_chunk=32)  # chunks of 32 from the cached boundary on
    sched.start()
    try:
        ids = [sched.prepare(tok.encode(system + q), params) for q in questions]
        common = next(k for k in range(len(ids[0])) if len({tuple(i[: k + 1]) for i in ids}) > 1)
        coldrun = []
        for i in ids:
            sched.clear_prefix_cache()
            coldrun.append(sched.submit(i, params, prepared=True).result(timeout=300)[0].token_ids)
        before = eng.page_pool.hit_tokens
        hot = [h.result(timeout=300)[0].token_ids for h in [sched.submit(i, params, prepared=True) for i in ids]]
    finally:
        sched.shutdown()
    assert hot == coldrun
    assert common >= 3 * PS
    assert eng.page_pool.hit_tokens - before >= 3 * (common // PS * PS)  # all 3 started on the system prompt
    assert_no_leak(eng)


@pytest.fixture(scope="module")
def int8_artifact(smol_desc: object, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from perfx_compiler.pipeline import compile_model
    from tests._cpu import has_vnni

    if not has_vnni():
        pytest.skip("int8 activations need AVX-512 VNNI")
    out = tmp_path_factory.mktemp("smol-int8-batch") / "artifact"
    return Path(compile_model(smol_desc, "host", out, progress=False, activations="int8", batching=True))


def test_int8_activations_hot_equals_cold(int8_artifact: Path) -> None:
    # The default activations on VNNI CPUs: chunks of >= 2 tokens still give each row the same bits whatever
    # the chunk (a 1-token chunk's logits differ by up to ~0.5 here, which is why those never make a hit).
    e = BatchEngine(int8_artifact, verify=False, max_batch=2)
    for n in (57, 48, 49):
        p = prompt_ids(n, 20 + n)
        ref = cold(e, p)
        hot = greedy(e, p)
        assert hot[0] == (n - 2) // PS * PS > 0
        assert_same(hot, ref)
    assert_no_leak(e)
