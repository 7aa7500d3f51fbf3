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
    """What the penalties look at: tokens the prompt used, and how often each was generated.

    Penalties touch only these ids (fancy indexing), never the whole vocabulary, so
    their cost grows with the sequence, not with a 150k-entry vocab.
    """

    def __init__(self, vocab_size: int, prompt_ids: Sequence[int] = ()) -> None:
        self.vocab_size = vocab_size
        ids = np.asarray(list(prompt_ids), dtype=np.int64)
        ids = np.unique(ids[(ids >= 0) & (ids < vocab_size)])
        self.output_counts = np.zeros(vocab_size, dtype=np.int32)
        self._output_ids: list[int] = []  # distinct generated ids
        self._seen: set[int] = set(ids.tolist())
        self._seen_ids: list[int] = ids.tolist()  # distinct prompt + generated ids
        self.num_generated = 0

    def append(self, token_id: int) -> None:
        t = int(token_id)
        if 0 <= t < self.vocab_size:
            if self.output_counts[t] == 0:
                self._output_ids.append(t)
                if t not in self._seen:
                    self._seen.add(t)
                    self._seen_ids.append(t)
            self.output_counts[t] += 1
        self.num_generated += 1

    @property
    def output_ids(self) -> np.ndarray:
        return np.asarray(self._output_ids, dtype=np.int64)

    @property
    def seen_ids(self) -> np.ndarray:
        return np.asarray(self._seen_ids, dtype=np.int64)


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
    """Return penalized copies of ``logits`` [batch, vocab] (vLLM semantics and order).

    Repetition divides positive / multiplies negative logits of any token seen in the
    prompt or the output (CTRL / HF style); then frequency (x count) and presence
    (once) are subtracted for generated tokens only (OpenAI style).
    """
    out = np.array(logits, dtype=np.float32, copy=True).reshape(len(histories), -1)
    for r, h in enumerate(histories):
        rp = float(repetition[r])
        if rp != 1.0:
            ids = h.seen_ids
            if ids.size:
                v = out[r, ids]
                out[r, ids] = np.where(v > 0, v / rp, v * rp)
        if frequency[r] or presence[r]:
            ids = h.output_ids
            if ids.size:
                out[r, ids] -= float(frequency[r]) * h.output_counts[ids] + float(presence[r])
    return out


# Draws locate the sampled index through per-block sums first, so a full-vocabulary
# draw costs one summing pass plus a cumsum over one block, not a 150k-entry cumsum.
_DRAW_BLOCK = 1024
# Candidate thresholds (relative to the best token's weight) tried before sorting:
# sorting only tokens above a threshold is exact once they cover the top-k / the nucleus.
_CANDIDATE_TAUS = (1e-4, 1e-10, 0.0)


def _draw(weights: np.ndarray, u: float) -> int:
    """Index drawn with probability proportional to ``weights`` (1-D, >= 0, not all 0); ``u`` in [0, 1)."""
    n = weights.shape[0]
    full = n // _DRAW_BLOCK * _DRAW_BLOCK
    if full:
        sums = weights[:full].reshape(-1, _DRAW_BLOCK).sum(axis=1, dtype=np.float64)
        sums = np.append(sums, weights[full:].sum(dtype=np.float64))
    else:
        sums = np.array([weights.sum(dtype=np.float64)])
    cum = np.cumsum(sums)
    target = u * cum[-1]
    b = min(int(np.searchsorted(cum, target, side="right")), cum.shape[0] - 1)
    lo = b * _DRAW_BLOCK
    seg = weights[lo : min(n, lo + _DRAW_BLOCK)]
    cdf = np.cumsum(seg, dtype=np.float64) + (cum[b - 1] if b else 0.0)
    j = lo + min(int(np.searchsorted(cdf, target, side="right")), seg.shape[0] - 1)
    if weights[j] <= 0:  # rounding pushed us onto an excluded entry: take the nearest allowed one
        nz = np.flatnonzero(weights[: j + 1])
        j = int(nz[-1]) if nz.size else int(np.flatnonzero(weights)[0])
    return j


def _truncate(e: np.ndarray, k: int, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Top-k then top-p (over the top-k distribution, as vLLM) of unnormalized probabilities ``e``.

    Returns the kept token ids sorted by descending weight, and their weights. Only
    tokens above a threshold are sorted; the threshold is lowered until they provably
    contain the top-k set (or, without top-k, the whole nucleus), so the result is exact.
    """
    vocab = e.shape[0]
    total = float(e.sum(dtype=np.float64))
    for tau in _CANDIDATE_TAUS:
        cand = np.flatnonzero(e > tau)
        if tau == 0.0:
            break
        if k < vocab:
            if cand.size >= k:  # every top-k token is above tau
                break
        elif e[cand].sum(dtype=np.float64) >= top_p * total:  # the nucleus is above tau
            break
    w = e[cand]
    order = np.argsort(-w, kind="stable")[:k]
    idx, w = cand[order], w[order]
    if top_p < 1.0:
        # Keep a token while the mass strictly before it is below p (so the best one always stays).
        denom = total if k >= vocab else float(w.sum(dtype=np.float64))
        before = np.cumsum(w, dtype=np.float64) - w
        n = max(1, int(np.count_nonzero(before < top_p * denom)))
        idx, w = idx[:n], w[:n]
    return idx, w


def _sample_row(z: np.ndarray, p: SamplingParams, rng: np.random.Generator) -> int:
    """Temperature / top-k / top-p / min-p draw from one row of (penalized) logits."""
    vocab = z.shape[0]
    m = np.max(z)
    if not np.isfinite(m):
        return int(np.argmax(z))
    e = z - m  # unnormalized probabilities, best token = 1 (float32 keeps this cheap)
    e *= np.float32(1.0 / p.temperature)
    np.exp(e, out=e)
    k = p.top_k if 0 < p.top_k < vocab else vocab
    idx: np.ndarray | None = None
    w = e
    if k < vocab or p.top_p < 1.0:
        idx, w = _truncate(e, k, p.top_p)
    if p.min_p > 0:
        # min-p: drop tokens below min_p x the most likely one (the ratio survives renormalization).
        w = np.where(w >= p.min_p * w.max(), w, 0.0)
    j = _draw(w, float(rng.random()))
    return int(idx[j]) if idx is not None else j


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
    ``min_tokens``). Greedy rows are one vectorized argmax; sampled rows each draw
    one uniform from their own generator, so rows never perturb each other.
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
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = _sample_row(x[i], p, rngs[i])
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
    z = np.asarray(logits, dtype=np.float32).reshape(-1)
    m = float(np.max(z))
    lse = m + float(np.log(np.exp(z - m).sum(dtype=np.float64)))
    chosen = float(z[token_id]) - lse
    rank = int(np.count_nonzero(z > z[token_id])) + 1
    out: dict[int, Logprob] = {}
    if top_n > 0:
        n = min(top_n, z.shape[0])
        top = np.argpartition(-z, n - 1)[:n]
        top = top[np.argsort(-z[top], kind="stable")]
        for r, t in enumerate(top, start=1):
            out[int(t)] = Logprob(float(z[t]) - lse, r)
    out.setdefault(int(token_id), Logprob(chosen, rank))
    return chosen, out


def make_generator(seed: int | None, fallback: np.random.Generator | None = None) -> np.random.Generator:
    """The request's generator: from ``seed`` when given, else drawn from ``fallback`` (or OS entropy)."""
    if seed is not None:
        return np.random.default_rng(seed)
    if fallback is not None:
        return np.random.default_rng(fallback.integers(0, 2**63 - 1))
    return np.random.default_rng()
