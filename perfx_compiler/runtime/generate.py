"""The generation loop for one sequence on one engine, and incremental detokenization.

``generate_sequence(engine, prompt_ids, params, tokenizer=...)`` is deliberately
scheduler-free: it only needs an object with the ``Engine`` interface
(``manifest``, ``max_context``, ``position``, ``reset``, ``prefill``, ``decode``),
so a batching scheduler can later drive the same pieces (``prepare_prompt``,
``sampling.sample``, ``StopChecker``, ``IncrementalDetokenizer``) step by step.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from perfx_compiler.errors import ContextLengthError
from perfx_compiler.runtime.sampling import (
    InvalidRequestError,
    Logprob,
    SamplingParams,
    TokenHistory,
    make_generator,
    sample,
    token_logprobs,
)

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as left context when detokenizing, so tokenizers that strip
# a leading space ("▁word" -> "word") decode the first generated token correctly.
_DETOK_CONTEXT = 5


class EngineLike(Protocol):
    manifest: dict
    max_context: int
    position: int

    def reset(self) -> None: ...
    def prefill(self, token_ids: Sequence[int]) -> np.ndarray: ...
    def decode(self, token_id: int) -> np.ndarray: ...


class TokenizerLike(Protocol):
    """The part of ``tokenizers.Tokenizer`` the loop uses."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, one delta per token.

    Byte-level BPE splits a multi-byte character (e.g. an emoji) over several
    tokens; decoding those one by one yields U+FFFD. Like vLLM, we decode a short
    window ``ids[prefix:]`` and compare it with ``ids[prefix:read]``: new text is
    emitted only once it no longer ends in U+FFFD, i.e. the character is complete.
    """

    def __init__(
        self, tokenizer: TokenizerLike, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids)[-_DETOK_CONTEXT:]
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes ('' while a character is still partial)."""
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def add_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.add(t) for t in token_ids)


class StopChecker:
    """Finds the earliest stop string in incrementally produced text."""

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.max_len = max((len(s) for s in self.stops), default=0)
        self.include = include_stop_str_in_output

    def check(self, text: str, delta_len: int) -> tuple[str, str] | None:
        """After ``delta_len`` new characters were appended to ``text``: (trimmed text, stop) or None."""
        if not self.stops or delta_len == 0:
            return None
        # Only a window reaching max_len-1 characters back can hold a new match.
        start = max(0, len(text) - delta_len - self.max_len + 1)
        best: tuple[int, str] | None = None
        for s in self.stops:
            pos = text.find(s, start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is None:
            return None
        pos, s = best
        return (text[: pos + len(s)] if self.include else text[:pos]), s


@dataclass
class Generation:
    """One finished sequence plus timings (seconds, from ``time.perf_counter``)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    prefill_time: float = 0.0  # engine.prefill only
    decode_time: float = 0.0  # engine.decode calls only
    sample_time: float = 0.0  # sampling + detokenization + stop checks
    time_to_first_token: float = 0.0  # start of the call -> first token sampled
    num_decode_steps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return len(self.prompt_token_ids) / self.prefill_time if self.prefill_time > 0 else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        return self.num_decode_steps / self.decode_time if self.decode_time > 0 else None


def model_info(engine: EngineLike) -> dict[str, Any]:
    """``manifest["model"]`` with defaults for the keys the loop reads."""
    info = dict(engine.manifest.get("model", {}))
    eos = info.get("eos_token_ids") or []
    info["eos_token_ids"] = [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]
    info.setdefault("bos_token_id", None)
    info.setdefault("add_bos_token", False)
    return info


def prepare_prompt(engine: EngineLike, token_ids: Sequence[int], *, extra_tokens: int = 1) -> list[int]:
    """Prompt ids as the engine will see them: BOS prepended when the model wants it.

    Raises ``ContextLengthError`` unless the prompt plus ``extra_tokens`` fits the context,
    and ``InvalidRequestError`` for an empty prompt or ids outside the vocabulary.
    """
    info = model_info(engine)
    ids = [int(t) for t in token_ids]
    bos = info["bos_token_id"]
    if info["add_bos_token"] and bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, int(bos))
    if not ids:
        raise InvalidRequestError("the prompt is empty; give at least one token of text")
    vocab = info.get("vocab_size")
    if vocab is not None:
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab}); check the token ids"
            )
    max_ctx = int(engine.max_context)
    if len(ids) + extra_tokens > max_ctx:
        raise ContextLengthError(
            f"prompt has {len(ids)} tokens, which with {extra_tokens} generated token(s) exceeds the "
            f"model's max context of {max_ctx}; shorten the prompt to at most {max_ctx - extra_tokens} tokens"
        )
    return ids


def generate_sequence(
    engine: EngineLike,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    tokenizer: TokenizerLike,
    rng: np.random.Generator | None = None,
    prepared: bool = False,
) -> Generation:
    """Generate one completion of ``prompt_ids`` on ``engine`` (resets its KV cache first).

    Stops at ``max_tokens`` / a full context ("length"), or at EOS (unless
    ``ignore_eos``), a ``stop_token_ids`` token or a stop string ("stop"). The
    stopping token stays in ``token_ids`` but its text is left out unless
    ``include_stop_str_in_output``; stop strings are trimmed the same way.
    ``prepared=True`` means ``prompt_ids`` already went through ``prepare_prompt``.
    A character still incomplete when generation ends (e.g. max_tokens cut an emoji
    after 2 of its 4 bytes) is left out of ``text`` rather than shown as U+FFFD.
    """
    t_start = time.perf_counter()
    ids = list(prompt_ids) if prepared else prepare_prompt(engine, prompt_ids)
    info = model_info(engine)
    vocab = info.get("vocab_size")
    eos_ids = set() if params.ignore_eos else set(info["eos_token_ids"])
    stop_ids = set(params.stop_token_ids or [])
    end_ids = eos_ids | stop_ids
    max_ctx = int(engine.max_context)
    budget = params.max_tokens if params.max_tokens is not None else max_ctx - len(ids)
    rng = rng if rng is not None else make_generator(params.seed)
    want_lp = params.logprobs is not None

    history = TokenHistory(vocab, ids) if (params.has_penalties and vocab) else None
    # Greedy with nothing to look at between steps but the token itself: after the first token the
    # engine decodes the rest in one call (Engine.decode_greedy: a C++ loop once its replay runs).
    greedy_rest = getattr(engine, "decode_greedy", None) if (
        params.greedy and not want_lp and history is None and params.min_tokens <= 1 and not params.stop_list) else None
    queued: deque[int] = deque()
    detok = IncrementalDetokenizer(tokenizer, ids, skip_special_tokens=params.skip_special_tokens)
    stopper = StopChecker(params.stop_list, params.include_stop_str_in_output)

    out_ids: list[int] = []
    lp_list: list[dict[int, Logprob]] | None = [] if want_lp else None
    cum_lp = 0.0 if want_lp else None
    finish, stop_reason = "length", None
    text_override: str | None = None
    decode_time = sample_time = 0.0
    steps = 0
    ttft = 0.0

    engine.reset()
    t0 = time.perf_counter()
    out = np.asarray(engine.prefill(ids))
    logits = out.reshape(-1, out.shape[-1])[-1]  # engines may return [len, vocab] or just [1, vocab]
    prefill_time = time.perf_counter() - t0

    while True:
        t0 = time.perf_counter()
        banned = [sorted(end_ids)] if len(out_ids) < params.min_tokens and end_ids else None
        if queued:  # decoded greedily by the engine: nothing to sample (see greedy_rest)
            tok = queued.popleft()
        else:
            tok = int(sample(logits, [params], [rng], [history] if history else None, banned=banned)[0])
        if history is not None:
            history.append(tok)
        if want_lp:
            lp, top = token_logprobs(logits, tok, params.logprobs or 0)
            for t, entry in top.items():
                entry.decoded_token = tokenizer.decode([t], skip_special_tokens=False)
            cum_lp += lp
            lp_list.append(top)
        out_ids.append(tok)
        if len(out_ids) == 1:
            ttft = time.perf_counter() - t_start

        if tok in end_ids:
            finish = "stop"
            stop_reason = tok if tok in stop_ids else None
            if params.include_stop_str_in_output:
                detok.add(tok)
            sample_time += time.perf_counter() - t0
            break
        delta = detok.add(tok)
        hit = stopper.check(detok.text, len(delta))
        sample_time += time.perf_counter() - t0
        if hit is not None:
            text_override, stop_reason = hit
            finish = "stop"
            break
        if len(out_ids) >= budget or len(ids) + len(out_ids) >= max_ctx:
            break  # "length": max_tokens reached, or prompt + output fill the context (vLLM's rule)

        t0 = time.perf_counter()
        if greedy_rest is not None:  # every remaining token at once; the loop above takes them in turn
            queued.extend(greedy_rest(tok, min(budget, max_ctx - len(ids)) - len(out_ids), end_ids))
            steps += len(queued)
            greedy_rest = None
        elif not queued:
            logits = np.asarray(engine.decode(tok)).reshape(-1)
            steps += 1
        decode_time += time.perf_counter() - t0

    return Generation(
        prompt_token_ids=ids,
        token_ids=out_ids,
        text=detok.text if text_override is None else text_override,
        finish_reason=finish,
        stop_reason=stop_reason,
        cumulative_logprob=cum_lp,
        logprobs=lp_list,
        prefill_time=prefill_time,
        decode_time=decode_time,
        sample_time=sample_time,
        time_to_first_token=ttft,
        num_decode_steps=steps,
    )


def generate_n(
    engine: EngineLike,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    tokenizer: TokenizerLike,
    rng: np.random.Generator | None = None,
) -> list[Generation]:
    """``params.n`` completions of one prompt, one after another, sharing the request's generator."""
    ids = prepare_prompt(engine, prompt_ids)
    rng = rng if rng is not None else make_generator(params.seed)
    return [
        generate_sequence(engine, ids, params, tokenizer=tokenizer, rng=rng, prepared=True)
        for _ in range(params.n)
    ]
