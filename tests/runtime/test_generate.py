"""The generation loop on a FakeEngine, and incremental detokenization."""

from __future__ import annotations

import numpy as np
import pytest

from perfx_compiler.errors import ContextLengthError, PerfXError
from perfx_compiler.runtime.generate import (
    IncrementalDetokenizer,
    StopChecker,
    generate_n,
    generate_sequence,
    prepare_prompt,
)
from perfx_compiler.runtime.sampling import InvalidRequestError, SamplingParams

SCRIPT = "hello world 😀 café, bye"


def run(engine, tokenizer, prompt="hi", **kw):
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    return generate_sequence(engine, ids, SamplingParams(**kw), tokenizer=tokenizer)


# -- incremental detokenization ------------------------------------------------------------------


def test_emoji_split_over_byte_tokens_never_emits_replacement_char(tokenizer) -> None:
    text = "a😀b🎉é中文"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) > len(text)  # multi-byte characters really are split over tokens
    assert "\ufffd" in tokenizer.decode(ids[1:2])  # a lone byte token decodes to U+FFFD
    d = IncrementalDetokenizer(tokenizer, [])
    deltas = [d.add(t) for t in ids]
    assert all("\ufffd" not in s for s in deltas)
    assert "".join(deltas) == text == d.text
    assert "" in deltas  # the partial steps emitted nothing


def test_detokenizer_uses_prompt_as_left_context(tokenizer) -> None:
    prompt = tokenizer.encode("say", add_special_tokens=False).ids
    ids = tokenizer.encode(" hello world", add_special_tokens=False).ids
    d = IncrementalDetokenizer(tokenizer, prompt)
    assert d.add_many(ids) == " hello world"


def test_detokenizer_skips_special_tokens(tokenizer) -> None:
    eos = tokenizer.token_to_id("</s>")
    d = IncrementalDetokenizer(tokenizer, [])
    d.add_many([*tokenizer.encode("ab", add_special_tokens=False).ids, eos])
    assert d.text == "ab"


def test_stop_checker_finds_earliest_stop_across_deltas() -> None:
    sc = StopChecker(["cd", "b"])
    assert sc.check("ab", 1) == ("a", "b")
    sc = StopChecker(["lo w"], include_stop_str_in_output=True)
    assert sc.check("hello", 2) is None
    assert sc.check("hello wo", 3) == ("hello w", "lo w")


# -- the loop ------------------------------------------------------------------------------------


def test_greedy_follows_argmax_chain(make_engine, tokenizer) -> None:
    eng = make_engine(add_bos_token=False)
    g = run(eng, tokenizer, "hi", temperature=0.0, max_tokens=8)
    prev = tokenizer.encode("hi", add_special_tokens=False).ids[-1]
    expected = []
    for _ in range(8):
        prev = int(np.argmax(eng.table[prev]))
        expected.append(prev)
    assert g.token_ids == expected
    assert g.finish_reason == "length" and g.stop_reason is None
    assert g.num_decode_steps == 7 and eng.decode_calls == expected[:-1]


def test_script_text_then_eos_stops(make_engine, tokenizer) -> None:
    eng = make_engine(SCRIPT)
    g = run(eng, tokenizer, temperature=0.0, max_tokens=200)
    assert g.text == SCRIPT and "\ufffd" not in g.text
    assert g.finish_reason == "stop" and g.stop_reason is None
    assert g.token_ids[-1] == eng.eos  # EOS kept in token_ids (vLLM), not in text


def test_ignore_eos_runs_to_max_tokens(make_engine, tokenizer) -> None:
    eng = make_engine("ab")
    g = run(eng, tokenizer, temperature=0.0, max_tokens=10, ignore_eos=True)
    assert len(g.token_ids) == 10 and g.finish_reason == "length"
    assert g.token_ids[2] == eng.eos  # it was generated but did not stop the sequence


def test_max_tokens_limits_length(make_engine, tokenizer) -> None:
    g = run(make_engine(SCRIPT), tokenizer, temperature=0.0, max_tokens=3)
    assert len(g.token_ids) == 3 and g.finish_reason == "length" and g.text == "hello"


def test_stop_string_is_trimmed(make_engine, tokenizer) -> None:
    g = run(make_engine(SCRIPT), tokenizer, temperature=0.0, max_tokens=100, stop=["o w", "zz"])
    assert g.text == "hell" and g.finish_reason == "stop" and g.stop_reason == "o w"
    g = run(make_engine(SCRIPT), tokenizer, temperature=0.0, max_tokens=100, stop="o w",
            include_stop_str_in_output=True)
    assert g.text == "hello w"


def test_stop_string_after_multibyte_character(make_engine, tokenizer) -> None:
    g = run(make_engine(SCRIPT), tokenizer, temperature=0.0, max_tokens=100, stop=["é,"])
    assert g.text == "hello world 😀 caf"


def test_stop_token_ids(make_engine, tokenizer) -> None:
    w = tokenizer.encode(" w", add_special_tokens=False).ids[0]
    g = run(make_engine(SCRIPT), tokenizer, temperature=0.0, max_tokens=100, stop_token_ids=[w])
    assert g.finish_reason == "stop" and g.stop_reason == w
    assert g.token_ids[-1] == w and g.text == "hello"


def test_min_tokens_bans_eos(make_engine, tokenizer) -> None:
    g = run(make_engine("ab"), tokenizer, temperature=0.0, max_tokens=6, min_tokens=5)
    assert len(g.token_ids) >= 5
    assert tokenizer.token_to_id("</s>") not in g.token_ids[:5]


def test_bos_added_once(make_engine, tokenizer) -> None:
    eng = make_engine(SCRIPT)
    bos = eng.manifest["model"]["bos_token_id"]
    ids = tokenizer.encode("hi", add_special_tokens=False).ids
    assert prepare_prompt(eng, ids) == [bos, *ids]
    assert prepare_prompt(eng, [bos, *ids]) == [bos, *ids]
    run(eng, tokenizer, "hi", max_tokens=1)
    assert eng.prefill_calls[-1] == [bos, *ids]
    no_bos = make_engine(add_bos_token=False)
    assert prepare_prompt(no_bos, ids) == ids


def test_prompt_too_long_is_one_line_context_error(make_engine, tokenizer) -> None:
    eng = make_engine(max_context=16)
    with pytest.raises(ContextLengthError) as ei:
        generate_sequence(eng, list(range(15)), SamplingParams(), tokenizer=tokenizer)
    msg = str(ei.value)
    assert "\n" not in msg and "16 tokens" in msg and "max context of 16" in msg
    assert eng.prefill_calls == []  # rejected before touching the engine
    prepare_prompt(eng, list(range(14)))  # 15 with BOS, +1 fits exactly


def test_context_full_ends_with_length(make_engine, tokenizer) -> None:
    eng = make_engine(max_context=12, add_bos_token=False)
    g = generate_sequence(eng, [104, 105], SamplingParams(temperature=0, max_tokens=100), tokenizer=tokenizer)
    assert g.finish_reason == "length"
    assert len(g.token_ids) == 12 - 2  # prompt + output never exceed the context
    assert eng.position == 11  # the last token is sampled but never decoded
    g = generate_sequence(eng, [104] * 11, SamplingParams(temperature=0, max_tokens=None), tokenizer=tokenizer)
    assert len(g.token_ids) == 1 and g.finish_reason == "length"


GREEDY_CASES = [  # (engine kw, sampling kw): every way a greedy generation ends
    ({"script_text": SCRIPT}, {"max_tokens": 200}),  # EOS
    ({"script_text": SCRIPT}, {"max_tokens": 3}),  # max_tokens
    ({"script_text": "ab"}, {"max_tokens": 10, "ignore_eos": True}),  # past an EOS
    ({"script_text": SCRIPT}, {"max_tokens": 100, "stop_token_ids": "w"}),  # a stop token
    ({"script_text": SCRIPT}, {"max_tokens": 100, "stop_token_ids": "w", "include_stop_str_in_output": True}),
    ({"max_context": 12, "add_bos_token": False}, {"max_tokens": 100}),  # the context fills
    ({"script_text": SCRIPT}, {"max_tokens": 1}),  # no decode step at all
]


@pytest.mark.parametrize("engine_kw,params", GREEDY_CASES)
def test_greedy_rest_in_one_engine_call_equals_the_token_loop(make_engine, tokenizer, engine_kw, params) -> None:
    """An engine with ``decode_greedy`` (the real Engine: one C++ loop) gets the tokens after the first
    in one call; the generation is the per-token loop's in every field that is not a timing."""
    if params.get("stop_token_ids") == "w":
        params = {**params, "stop_token_ids": [tokenizer.encode(" w", add_special_tokens=False).ids[0]]}
    slow_eng, fast_eng = make_engine(**engine_kw), make_engine(greedy_loop=True, **engine_kw)
    slow, fast = (run(e, tokenizer, "hi", temperature=0.0, **params) for e in (slow_eng, fast_eng))
    for field in ("prompt_token_ids", "token_ids", "text", "finish_reason", "stop_reason", "num_decode_steps"):
        assert getattr(fast, field) == getattr(slow, field), field
    assert fast_eng.decode_calls == slow_eng.decode_calls and fast_eng.position == slow_eng.position
    assert fast_eng.greedy_calls == (1 if slow.num_decode_steps else 0)
    # anything to do between steps (sampling, logprobs, penalties, stop strings, min_tokens) keeps the loop
    others = [{"temperature": 0.7, "seed": 1}, {"logprobs": 1}, {"repetition_penalty": 1.2}, {"stop": ["zz"]}]
    for other in others + ([{"min_tokens": 2}] if params["max_tokens"] >= 2 else []):
        eng = make_engine(greedy_loop=True, **engine_kw)
        run(eng, tokenizer, "hi", **{"temperature": 0.0, **params, **other})
        assert eng.greedy_calls == 0, other


def test_bad_prompts_are_perfx_errors(make_engine, tokenizer) -> None:
    eng = make_engine(add_bos_token=False)
    for ids in ([], [10_000]):
        with pytest.raises(InvalidRequestError) as ei:
            prepare_prompt(eng, ids)
        assert isinstance(ei.value, PerfXError) and "\n" not in str(ei.value)


def test_seeded_sampling_is_reproducible(make_engine, tokenizer) -> None:
    def once(seed):
        return run(make_engine(), tokenizer, temperature=1.0, top_p=0.9, max_tokens=12, seed=seed).token_ids

    assert once(5) == once(5)
    assert once(5) != once(6)


def test_n_completions_share_one_generator(make_engine, tokenizer) -> None:
    eng = make_engine()
    ids = tokenizer.encode("hi", add_special_tokens=False).ids
    gens = generate_n(eng, ids, SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=1), tokenizer=tokenizer)
    assert len(gens) == 3 and len({tuple(g.token_ids) for g in gens}) > 1
    again = generate_n(eng, ids, SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=1), tokenizer=tokenizer)
    assert [g.token_ids for g in gens] == [g.token_ids for g in again]


def test_logprobs_and_cumulative(make_engine, tokenizer) -> None:
    g = run(make_engine(SCRIPT), tokenizer, temperature=0.0, max_tokens=4, logprobs=2)
    assert len(g.logprobs) == 4
    chosen = [step[t].logprob for step, t in zip(g.logprobs, g.token_ids, strict=True)]
    assert g.cumulative_logprob == pytest.approx(sum(chosen))
    assert all(step[t].rank == 1 for step, t in zip(g.logprobs, g.token_ids, strict=True))
    assert g.logprobs[0][g.token_ids[0]].decoded_token == "he"
    assert run(make_engine(), tokenizer, max_tokens=2).cumulative_logprob is None


def test_timings_are_recorded(make_engine, tokenizer) -> None:
    g = run(make_engine(), tokenizer, temperature=0.0, max_tokens=5)
    assert g.prefill_time > 0 and g.decode_time > 0 and g.time_to_first_token > 0
    assert g.prefill_tokens_per_s > 0 and g.decode_tokens_per_s > 0
    one = run(make_engine(), tokenizer, max_tokens=1)
    assert one.num_decode_steps == 0 and one.decode_tokens_per_s is None


def test_penalties_in_the_loop(make_engine, tokenizer) -> None:
    # A table whose greedy chain cycles h -> a -> h; a strong repetition penalty breaks the cycle.
    def cyclic():
        eng = make_engine(add_bos_token=False)
        eng.table[104, 97] = eng.table[97, 104] = 8.0
        return eng

    plain = run(cyclic(), tokenizer, "h", temperature=0.0, max_tokens=12)
    assert set(plain.token_ids) == {97, 104}
    pen = run(cyclic(), tokenizer, "h", temperature=0.0, max_tokens=12, repetition_penalty=5.0)
    assert len(set(pen.token_ids)) > 2
    freq = run(cyclic(), tokenizer, "h", temperature=0.0, max_tokens=12, frequency_penalty=2.0)
    assert len(set(freq.token_ids)) > 2


def test_max_tokens_cutting_an_emoji_leaves_no_replacement_char(make_engine, tokenizer) -> None:
    g = run(make_engine("a😀b"), tokenizer, temperature=0.0, max_tokens=3)  # "a" + 2 of the emoji's 4 bytes
    assert g.text == "a" and len(g.token_ids) == 3
    g = run(make_engine("a😀b"), tokenizer, temperature=0.0, max_tokens=5)
    assert g.text == "a😀"
