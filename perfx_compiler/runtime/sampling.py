"""Token sampling from logits: greedy, temperature, top-k, top-p, min-p and penalties.

Everything works on a ``[batch, vocab]`` logits array with per-row parameters,
generator and history, so the single-sequence loop today and a batched scheduler
later share one code path. Each request owns a ``numpy.random.Generator`` (seeded
from ``SamplingParams.seed`` when given), which makes a seeded run reproducible
regardless of what else runs in the same process.

Order of operations (as in vLLM): penalties -> temperature -> top-k -> top-p ->
min-p -> draw. Returned log-probabilities are those of the *raw* model logits
(vLLM V1's default), so they do not depend on the sampling knobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from perfx_compiler.errors import PerfXError

# Temperatures below this are treated as greedy (dividing by ~0 overflows).
_GREEDY_EPS = 1e-5
# First guess of how many candidates a top-p-only row needs; grown x4 until the
# nucleus fits, so the common case sorts a few hundred entries, not the vocab.
_TOP_P_FIRST_GUESS = 256


class InvalidRequestError(PerfXError, ValueError):
    """A sampling parameter or prompt the runtime cannot honour (also a ValueError, as in vLLM)."""


@dataclass
class SamplingParams:
    """vLLM-shaped sampling parameters for one request.

    ``top_k`` of -1 or 0 disables top-k; ``max_tokens=None`` means "until the
    context is full"; ``logprobs=k`` returns the top-k log-probabilities (plus the
    sampled token's) at every step and enables ``cumulative_logprob``.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop_list = []
        elif isinstance(self.stop, str):
            self.stop_list = [self.stop]
        else:
            self.stop_list = [str(s) for s in self.stop]
        if any(s == "" for s in self.stop_list):
            raise InvalidRequestError("stop strings must be non-empty; remove the empty string from 'stop'")
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid SamplingParams: {msg}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad(f"n must be an integer >= 1, got {self.n!r}")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise bad(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad(f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}")
        if not self.repetition_penalty > 0:
            raise bad(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad(f"logprobs must be None or an integer >= 0, got {self.logprobs!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad(f"seed must be an integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


class TokenHistory:
    """What the penalties look at: which tokens the prompt used and how often each was generated."""

    def __init__(self, vocab_size: int, prompt_ids: Sequence[int] = ()) -> None:
        self.vocab_size = vocab_size
        self.prompt_mask = np.zeros(vocab_size, dtype=bool)
        ids = np.asarray(list(prompt_ids), dtype=np.int64)
        ids = ids[(ids >= 0) & (ids < vocab_size)]
        self.prompt_mask[ids] = True
        self.output_counts = np.zeros(vocab_size, dtype=np.int32)
        self.num_generated = 0

    def append(self, token_id: int) -> None:
        if 0 <= token_id < self.vocab_size:
            self.output_counts[token_id] += 1
        self.num_generated += 1


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Numerically stable log-softmax over the last axis, in float64."""
    x = np.asarray(logits, dtype=np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    shifted = x - m
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def apply_penalties(
    logits: np.ndarray,
    histories: Sequence[TokenHistory],
    presence: np.ndarray,
    frequency: np.ndarray,
    repetition: np.ndarray,
) -> np.ndarray:
    """Return penalized copies of ``logits`` [batch, vocab] (vLLM semantics).

    Presence/frequency apply to generated tokens only (OpenAI style); repetition
    divides positive / multiplies negative logits of any token seen in the prompt
    or the output (CTRL / HF style).
    """
    out = np.array(logits, dtype=np.float32, copy=True)
    counts = np.stack([h.output_counts for h in histories])
    if np.any(frequency) or np.any(presence):
        out -= frequency[:, None].astype(np.float32) * counts
        out -= presence[:, None].astype(np.float32) * (counts > 0)
    if np.any(repetition != 1.0):
        seen = np.stack([h.prompt_mask for h in histories]) | (counts > 0)
        rp = repetition[:, None].astype(np.float32)
        penalized = np.where(out > 0, out / rp, out * rp)
        out = np.where(seen, penalized, out)
    return out


def _truncate_sorted(
    probs: np.ndarray, top_k: np.ndarray, top_p: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Top-k / top-p candidates of ``probs`` [batch, vocab], sorted by descending probability.

    Returns ``(indices, weights)``, both [batch, c]: candidate token ids and their
    probabilities with excluded entries zeroed. Only the ``c`` largest entries are
    sorted (argpartition first), and ``c`` grows until every top-p row's nucleus fits.
    """
    vocab = probs.shape[1]
    k_eff = np.where(top_k > 0, np.minimum(top_k, vocab), vocab)
    needs_p = top_p < 1.0
    # Rows limited only by top-p start from a guess; rows with top-k need exactly k.
    guess = np.where(needs_p & (k_eff == vocab), _TOP_P_FIRST_GUESS, k_eff)
    c = int(min(vocab, max(1, int(guess.max()))))
    while True:
        if c < vocab:
            idx = np.argpartition(-probs, c - 1, axis=1)[:, :c]
        else:
            idx = np.broadcast_to(np.arange(vocab), probs.shape)
        part = np.take_along_axis(probs, idx, axis=1)
        order = np.argsort(-part, axis=1, kind="stable")
        idx = np.take_along_axis(idx, order, axis=1)
        sorted_p = np.take_along_axis(part, order, axis=1)
        cum = np.cumsum(sorted_p, axis=1, dtype=np.float64)
        # A top-p row whose top-c mass is still below p (and whose top-k allows more) needs more candidates.
        short = needs_p & (cum[:, -1] < top_p) & (k_eff > c)
        if c >= vocab or not np.any(short):
            break
        c = min(vocab, c * 4)
    rank = np.arange(c)[None, :]
    keep = rank < k_eff[:, None]
    # Nucleus: keep a token while the mass strictly before it is below p (so the first always stays).
    keep &= (cum - sorted_p) < top_p[:, None]
    return idx, np.where(keep, sorted_p, 0.0)


def sample(
    logits: np.ndarray,
    params: Sequence[SamplingParams],
    rngs: Sequence[np.random.Generator],
    histories: Sequence[TokenHistory] | None = None,
    *,
    banned: Sequence[Sequence[int]] | None = None,
) -> np.ndarray:
    """Draw one token per row of ``logits`` [batch, vocab]; returns int64 [batch].

    ``histories`` feed the penalties (needed only when some row has penalties);
    ``banned`` lists token ids a row may not produce this step (e.g. EOS before
    ``min_tokens``).
    """
    x = np.asarray(logits, dtype=np.float32)
    if x.ndim == 1:
        x = x[None, :]
    batch, vocab = x.shape
    if len(params) != batch or len(rngs) != batch:
        raise ValueError(f"got {batch} logits rows but {len(params)} params and {len(rngs)} generators")

    if any(p.has_penalties for p in params):
        if histories is None:
            raise ValueError("penalties need a TokenHistory per row")
        x = apply_penalties(
            x,
            histories,
            np.array([p.presence_penalty for p in params]),
            np.array([p.frequency_penalty for p in params]),
            np.array([p.repetition_penalty for p in params]),
        )
    if banned is not None and any(len(b) for b in banned):
        x = np.array(x, copy=True)
        for row, ids in enumerate(banned):
            ids = [t for t in ids if 0 <= t < vocab]
            if ids and len(ids) < vocab:
                x[row, ids] = -np.inf

    tokens = np.argmax(x, axis=1).astype(np.int64)  # greedy rows are done here
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens

    sub = x[rows]
    temp = np.array([params[i].temperature for i in rows], dtype=np.float64)
    top_k = np.array([params[i].top_k for i in rows], dtype=np.int64)
    top_p = np.array([params[i].top_p for i in rows], dtype=np.float64)
    min_p = np.array([params[i].min_p for i in rows], dtype=np.float64)

    scaled = sub.astype(np.float64) / temp[:, None]
    scaled -= np.max(scaled, axis=1, keepdims=True)
    probs = np.exp(scaled)
    probs /= probs.sum(axis=1, keepdims=True)

    if np.any(top_k > 0) or np.any(top_p < 1.0):
        idx, weights = _truncate_sorted(probs, top_k, top_p)
    else:
        idx, weights = None, probs
    if np.any(min_p > 0):
        # min-p: drop tokens below min_p x (the most likely token's probability).
        pmax = weights.max(axis=1, keepdims=True)
        weights = np.where(weights >= min_p[:, None] * pmax, weights, 0.0)

    # Inverse-CDF draw: one uniform per row from that row's own generator.
    cdf = np.cumsum(weights, axis=1)
    u = np.array([rngs[i].random() for i in rows]) * cdf[:, -1]
    pick = np.minimum(np.sum(cdf <= u[:, None], axis=1), cdf.shape[1] - 1)
    chosen = pick if idx is None else np.take_along_axis(idx, pick[:, None], axis=1)[:, 0]
    tokens[rows] = chosen
    return tokens


@dataclass
class Logprob:
    """Log-probability of one token at one step (vLLM's ``Logprob``)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def token_logprobs(logits: np.ndarray, token_id: int, top_n: int = 0) -> tuple[float, dict[int, Logprob]]:
    """Raw log-probability of ``token_id`` under ``logits`` [vocab], plus the ``top_n`` best.

    The returned dict always contains the chosen token (with its 1-based rank).
    """
    lp = log_softmax(np.asarray(logits).reshape(-1))
    chosen = float(lp[token_id])
    rank = int(np.sum(lp > lp[token_id])) + 1
    out: dict[int, Logprob] = {}
    if top_n > 0:
        n = min(top_n, lp.shape[0])
        top = np.argpartition(-lp, n - 1)[:n]
        top = top[np.argsort(-lp[top], kind="stable")]
        for r, t in enumerate(top, start=1):
            out[int(t)] = Logprob(float(lp[t]), r)
    out.setdefault(int(token_id), Logprob(chosen, rank))
    return chosen, out


def make_generator(seed: int | None, fallback: np.random.Generator | None = None) -> np.random.Generator:
    """The request's generator: from ``seed`` when given, else drawn from ``fallback`` (or OS entropy)."""
    if seed is not None:
        return np.random.default_rng(seed)
    if fallback is not None:
        return np.random.default_rng(fallback.integers(0, 2**63 - 1))
    return np.random.default_rng()
