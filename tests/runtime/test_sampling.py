"""Sampling: greedy, top-k, top-p, min-p, temperature, penalties, seeds, logprobs."""

from __future__ import annotations

import numpy as np
import pytest

from perfx_compiler.errors import PerfXError
from perfx_compiler.runtime.sampling import (
    InvalidRequestError,
    SamplingParams,
    TokenHistory,
    _truncate,
    apply_penalties,
    log_softmax,
    make_generator,
    sample,
    token_logprobs,
)


def draw(logits: np.ndarray, params: SamplingParams, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.array([sample(logits, [params], [rng])[0] for _ in range(n)])


def probs_logits(p: list[float]) -> np.ndarray:
    return np.log(np.asarray(p, dtype=np.float64)).astype(np.float32)


def test_greedy_picks_argmax_per_row() -> None:
    logits = np.random.default_rng(1).normal(size=(4, 50)).astype(np.float32)
    params = [SamplingParams(temperature=0.0)] * 4
    rngs = [np.random.default_rng(i) for i in range(4)]
    assert np.array_equal(sample(logits, params, rngs), logits.argmax(axis=1))


def test_top_k_1_equals_greedy_at_any_temperature() -> None:
    logits = np.random.default_rng(2).normal(size=(100,)).astype(np.float32)
    got = draw(logits, SamplingParams(temperature=1.5, top_k=1), 200)
    assert np.all(got == logits.argmax())


def test_top_k_restricts_support_to_k_best() -> None:
    logits = np.random.default_rng(3).normal(scale=0.3, size=(40,)).astype(np.float32)
    best3 = set(np.argsort(-logits)[:3].tolist())
    got = set(draw(logits, SamplingParams(temperature=1.0, top_k=3), 600).tolist())
    assert got == best3


def test_top_p_excludes_the_tail() -> None:
    logits = probs_logits([0.5, 0.3, 0.15, 0.05])
    n = 4000
    full = draw(logits, SamplingParams(temperature=1.0), n)
    # Control: without top-p the tail shows up (~20%), so the check below can fail.
    assert np.mean(full >= 2) > 0.15
    got = draw(logits, SamplingParams(temperature=1.0, top_p=0.7), n)
    assert set(got.tolist()) == {0, 1}
    # Renormalized nucleus: P(0) = 0.5 / 0.8 = 0.625; sd ~ 0.0077 at n=4000.
    assert abs(np.mean(got == 0) - 0.625) < 0.04


def test_top_p_with_nucleus_larger_than_first_guess() -> None:
    # 1000 almost-flat tokens: a 0.9 nucleus needs ~900 candidates (more than the first 256 sorted).
    logits = np.linspace(0.0, -0.01, 1000).astype(np.float32)
    got = draw(logits, SamplingParams(temperature=1.0, top_p=0.9), 3000)
    assert got.max() < 905  # the tail (ranks ~900-999) is never drawn
    assert got.max() > 600  # but the nucleus is far bigger than 256


def test_top_p_always_keeps_the_best_token() -> None:
    logits = probs_logits([0.9, 0.05, 0.05])
    assert set(draw(logits, SamplingParams(temperature=1.0, top_p=0.01), 200).tolist()) == {0}


def test_min_p_drops_tokens_below_fraction_of_best() -> None:
    logits = probs_logits([0.4, 0.3, 0.2, 0.06, 0.04])
    got = draw(logits, SamplingParams(temperature=1.0, min_p=0.2), 3000)  # threshold 0.08
    assert set(got.tolist()) == {0, 1, 2}


def test_temperature_matches_softmax_frequencies() -> None:
    logits = np.array([2.0, 1.0, 0.0, -1.0], dtype=np.float32)
    t = 0.7
    expected = np.exp(log_softmax(logits / t))
    got = draw(logits, SamplingParams(temperature=t), 6000)
    freq = np.bincount(got, minlength=4) / got.size
    assert np.max(np.abs(freq - expected)) < 0.03


def test_seeded_generators_are_reproducible() -> None:
    logits = np.random.default_rng(4).normal(size=(64,)).astype(np.float32)
    p = SamplingParams(temperature=1.0, top_p=0.95, top_k=20, seed=123)
    a = [sample(logits, [p], [g])[0] for g in [make_generator(123)] for _ in range(50)]
    g2 = make_generator(123)
    b = [sample(logits, [p], [g2])[0] for _ in range(50)]
    g3 = make_generator(124)
    c = [sample(logits, [p], [g3])[0] for _ in range(50)]
    assert a == b
    assert a != c


def test_unseeded_generator_derives_from_fallback() -> None:
    a = make_generator(None, np.random.default_rng(7)).random(3)
    b = make_generator(None, np.random.default_rng(7)).random(3)
    assert np.array_equal(a, b)


def test_batch_rows_are_independent() -> None:
    logits = np.random.default_rng(5).normal(size=(3, 30)).astype(np.float32)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=5), SamplingParams(top_p=0.8, temperature=0.5)]
    batched = sample(logits, params, [np.random.default_rng(i) for i in range(3)])
    single = [sample(logits[i], [params[i]], [np.random.default_rng(i)])[0] for i in range(3)]
    assert batched.tolist() == single


def test_repetition_penalty_changes_argmax() -> None:
    logits = np.array([3.0, 2.0, 1.0, -1.0], dtype=np.float32)
    h = TokenHistory(4, prompt_ids=[0])
    h.append(3)
    out = apply_penalties(logits[None], [h], np.zeros(1), np.zeros(1), np.array([2.0]))[0]
    assert out.tolist() == [1.5, 2.0, 1.0, -2.0]  # positive divided, negative multiplied
    rng = np.random.default_rng(0)
    assert sample(logits, [SamplingParams(temperature=0, repetition_penalty=2.0)], [rng], [h])[0] == 1


def test_presence_and_frequency_penalties_use_output_counts_only() -> None:
    logits = np.zeros(4, dtype=np.float32)
    h = TokenHistory(4, prompt_ids=[2])
    for t in (0, 0, 1):
        h.append(t)
    out = apply_penalties(logits[None], [h], np.array([0.5]), np.array([0.25]), np.ones(1))[0]
    assert out.tolist() == [-1.0, -0.75, 0.0, 0.0]


def test_banned_tokens_are_never_drawn() -> None:
    logits = np.array([5.0, 0.0, 0.0], dtype=np.float32)
    rng = np.random.default_rng(0)
    assert sample(logits, [SamplingParams(temperature=0)], [rng], banned=[[0]])[0] != 0


def test_token_logprobs_are_raw_log_softmax() -> None:
    logits = np.array([1.0, 3.0, 2.0, 0.0], dtype=np.float32)
    lp, top = token_logprobs(logits, 2, top_n=1)
    ref = log_softmax(logits)
    assert lp == pytest.approx(ref[2])
    assert set(top) == {1, 2}
    assert top[1].rank == 1 and top[2].rank == 2
    assert top[2].logprob == pytest.approx(ref[2])


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"max_tokens": 0},
        {"n": 0},
        {"min_p": 2.0},
        {"repetition_penalty": 0.0},
        {"stop": ["ok", ""]},
        {"logprobs": -1},
    ],
)
def test_invalid_params_raise_one_line_perfx_error(kw: dict) -> None:
    with pytest.raises(InvalidRequestError) as ei:
        SamplingParams(**kw)
    assert isinstance(ei.value, PerfXError) and isinstance(ei.value, ValueError)
    assert "\n" not in str(ei.value)


def test_params_normalize_stop_and_topk_off_values() -> None:
    assert SamplingParams(stop="x").stop_list == ["x"]
    assert SamplingParams(stop=None).stop_list == []
    logits = np.random.default_rng(6).normal(size=(10,)).astype(np.float32)
    for k in (0, -1):  # both mean "off"
        assert len(set(draw(logits, SamplingParams(top_k=k, temperature=3.0), 400).tolist())) > 5


def test_full_vocab_draw_matches_softmax_across_blocks() -> None:
    # 5000 tokens span several draw blocks; compare frequencies of 10 coarse bins with the softmax.
    logits = np.random.default_rng(8).normal(scale=0.5, size=5000).astype(np.float32)
    probs = np.exp(log_softmax(logits))
    got = draw(logits, SamplingParams(temperature=1.0), 6000)
    bins = np.arange(0, 5001, 500)
    freq = np.histogram(got, bins)[0] / got.size
    expected = np.add.reduceat(probs, bins[:-1])
    assert np.max(np.abs(freq - expected)) < 0.02


def test_top_k_larger_than_likely_set_is_exact() -> None:
    # Only 3 tokens clear the first candidate threshold; top_k=5 must still keep tokens 3 and 4.
    e = np.exp(np.array([20.0, 19.0, 18.0, 8.0, 7.9] + [-50.0] * 95) - 20.0).astype(np.float32)
    idx, w = _truncate(e, 5, 1.0)
    assert idx.tolist() == [0, 1, 2, 3, 4] and np.all(w > 0)
    idx, _ = _truncate(e, 100, 1.0 - 1e-7)  # top-p only: the nucleus reaches past the first threshold
    assert idx.tolist()[:5] == [0, 1, 2, 3, 4]


def test_top_p_applies_to_the_top_k_distribution() -> None:
    # vLLM order: top-k=2 renormalizes [.5, .3] to [.625, .375]; a 0.6 nucleus then keeps only token 0.
    logits = probs_logits([0.5, 0.3, 0.2])
    assert set(draw(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.6), 300).tolist()) == {0}
    # Without top-k the nucleus is measured against the whole vocabulary: 0.5 < 0.6 keeps token 1 too.
    assert set(draw(logits, SamplingParams(temperature=1.0, top_p=0.6), 300).tolist()) == {0, 1}
