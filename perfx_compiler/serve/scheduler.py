"""Continuous batching over a ``BatchEngine``, in one worker thread.

    sched = Scheduler(engine, tokenizer, max_queue=64)
    sched.start()
    handle = sched.submit(prompt_ids, SamplingParams(max_tokens=32), on_event=print)
    results = handle.result(timeout=60)

Every step of the worker:

1. drops cancelled requests (their sequences' KV pages are freed at once);
2. admits waiting sequences, first come first served, while the batch has room and
   their prompt (plus one token) fits the free KV pages not already promised to
   sequences still prefilling or about to grow; a sequence starts on the cached
   pages of its prompt's longest cached prefix (prefix caching, in the engine) and
   only prefills the rest;
3. runs one prefill call: up to ``prefill_chunk`` prompt tokens of the first admitted
   sequence still prefilling (chunked prefill), so a long prompt does not stall the
   running sequences for more than one chunk (never a 1-token chunk unless the prompt
   is 1 token: see runtime/prefix_cache.py). One call, not the budget spread over several
   prompts: a call costs a pass over the weights whatever its length, and 16 short
   prompts prefilled in one step held every running stream's next token for all 16;
4. runs ONE batched ``decode`` for every sequence that has a sampled token pending.

When a decode step needs more pages than are free, the most recently admitted
sequences are preempted: their pages are freed and they go back to the head of
the queue with prompt + generated tokens as their new "prompt" (recompute, as in
vLLM), so streamed output simply continues later. Sampling, detokenization and
stop handling reuse ``runtime/sampling.py`` and ``runtime/generate.py``; text that
could still turn out to be the start of a stop string is held back while streaming,
so the concatenated deltas always equal the final text.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from perfx_compiler.errors import ContextLengthError, KVCacheFullError
from perfx_compiler.runtime.generate import IncrementalDetokenizer, StopChecker, model_info, prepare_prompt
from perfx_compiler.runtime.prefix_cache import PrefixHit
from perfx_compiler.runtime.sampling import (
    Logprob,
    SamplingParams,
    TokenHistory,
    make_generator,
    sample,
    token_logprobs,
)
from perfx_compiler.serve.records import QueueFull, SchedulerClosed, SchedulerStats, SequenceResult, StreamEvent

__all__ = [
    "QueueFull",
    "RequestHandle",
    "Scheduler",
    "SchedulerClosed",
    "SchedulerStats",
    "SequenceResult",
    "StreamEvent",
]

log = logging.getLogger("perfx.serve")


class BatchEngineLike(Protocol):
    manifest: dict
    max_context: int
    num_pages: int
    max_batch: int

    def free_pages(self) -> int: ...
    def pages_in_use(self) -> int: ...
    def cached_pages(self) -> int: ...
    def pages_needed(self, num_tokens: int) -> int: ...
    def match_prefix(self, prompt: Sequence[int]) -> PrefixHit: ...
    def add_sequence(self, prompt: Sequence[int] | None = None) -> int: ...
    def clear_prefix_cache(self) -> int: ...
    def remove_sequence(self, seq_id: int) -> None: ...
    def prefill(self, seq_id: int, token_ids: Sequence[int]) -> np.ndarray: ...
    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> np.ndarray: ...
    def length(self, seq_id: int) -> int: ...


class Observer(Protocol):
    """What the scheduler reports to metrics (see ``serve/metrics.py``)."""

    def on_prompt_tokens(self, n: int) -> None: ...
    def on_prefix_cache(self, queried: int, hit: int) -> None: ...
    def on_generated_tokens(self, n: int) -> None: ...
    def on_first_token(self, seconds: float) -> None: ...
    def on_inter_token(self, seconds: float) -> None: ...
    def on_sequence_finished(self, reason: str) -> None: ...


class RequestHandle:
    """A submitted request: ``cancel()`` from any thread, ``result()`` blocks until it finishes."""

    def __init__(self, scheduler: Scheduler, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self._scheduler = scheduler
        self.request_id = request_id
        self.prompt_token_ids = prompt_ids
        self.params = params
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.results: list[SequenceResult | None] = [None] * params.n
        self.cancelled = False
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Abort the request; its sequences leave the batch (and free their pages) at the next step."""
        if not self._done.is_set():
            self.cancelled = True
            self._scheduler._wake()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> list[SequenceResult]:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        return [r for r in self.results if r is not None]


@dataclass
class _Seq:
    req: RequestHandle
    index: int
    on_event: Callable[[StreamEvent], None] | None
    prompt_ids: list[int]
    rng: np.random.Generator
    detok: IncrementalDetokenizer
    stopper: StopChecker
    history: TokenHistory | None
    end_ids: set[int]
    stop_ids: set[int]
    budget: int
    hold: int  # characters held back while streaming (a stop string may start there)
    feed: list[int] = field(default_factory=list)  # tokens to prefill on (re)admission
    computed: int = 0  # of ``feed`` already prefilled
    seq_id: int | None = None
    out_ids: list[int] = field(default_factory=list)
    sent: int = 0  # characters of text already streamed
    last_token_time: float = 0.0
    cum_lp: float | None = None
    lp_list: list[dict[int, Logprob]] | None = None
    finished: bool = False

    @property
    def params(self) -> SamplingParams:
        return self.req.params


class Scheduler:
    """Continuous batching over one ``BatchEngine`` (which only the worker thread touches)."""

    def __init__(
        self,
        engine: BatchEngineLike,
        tokenizer: Any,
        *,
        max_queue: int = 64,
        max_batch: int | None = None,
        prefill_chunk: int = 256,
        seed: int | None = None,
        observer: Observer | None = None,
        retry_after: float = 1.0,
    ) -> None:
        """``tokenizer``: anything with ``decode(ids, skip_special_tokens=...)`` (``tokenizers.Tokenizer``
        or ``runtime.api.Tokenizer``). ``max_batch`` defaults to (and is capped at) ``engine.max_batch``."""
        if max_queue < 1 or prefill_chunk < 1:
            raise ValueError("max_queue and prefill_chunk must be >= 1")
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_queue = max_queue
        cap = int(getattr(engine, "max_batch", max_batch or 16))
        self.max_batch = max(1, min(max_batch or cap, cap))
        self.prefill_chunk = prefill_chunk
        self.observer = observer
        self.retry_after = retry_after
        self.info = model_info(engine)
        self.max_context = int(engine.max_context)
        self._rng = np.random.default_rng(seed)
        self._ids = itertools.count()
        self._cv = threading.Condition()
        self._waiting: deque[_Seq] = deque()  # guarded by _cv
        self._running: list[_Seq] = []  # worker only; admission order
        self._stats = SchedulerStats(kv_pages_total=int(engine.num_pages))  # replaced under _cv
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False
        self._clears: list[tuple[threading.Event, list[int]]] = []  # clear_prefix_cache calls for the worker

    # -- public API ---------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="perfx-scheduler", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort every request and stop the worker."""
        with self._cv:
            self._closed = True
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():  # stuck in an engine call: leave the engine alone
                log.warning("scheduler worker did not stop within %.0f s", timeout)
                return
            self._thread = None
        with self._cv:  # the worker is gone (or never ran): abort what is left here
            leftovers = [*self._waiting, *self._running]
            self._waiting.clear()
            self._running = []
            for done, _ in self._clears:  # clear_prefix_cache calls still waiting: they raise
                done.set()
        for s in leftovers:
            self._finish(s, "abort", error="the server is shutting down")

    def clear_prefix_cache(self, timeout: float = 60.0) -> int:
        """Drop the engine's cached prefixes (the next requests start cold), on the worker thread between
        two steps; returns how many cached pages were freed."""
        done, freed = threading.Event(), []
        with self._cv:
            if self._closed or self._thread is None:
                raise SchedulerClosed("the scheduler is not running")
            self._clears.append((done, freed))
            self._cv.notify_all()
        if not done.wait(timeout):
            raise TimeoutError(f"the prefix cache was not cleared within {timeout} s")
        if not freed:
            raise SchedulerClosed("the scheduler shut down before clearing the prefix cache")
        return freed[0]

    def stats(self) -> SchedulerStats:
        with self._cv:
            return SchedulerStats(**vars(self._stats))

    def prepare(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt as the engine will see it (BOS added); raises ``ContextLengthError`` /
        ``InvalidRequestError`` when it cannot be served."""
        ids = prepare_prompt(self.engine, prompt_ids, extra_tokens=1)
        need = self.engine.pages_needed(len(ids) + 1)
        if need > int(self.engine.num_pages):
            raise ContextLengthError(
                f"the prompt needs {need} KV pages but the server's pool has {self.engine.num_pages}; "
                "shorten the prompt or start the server with more pages"
            )
        return ids

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        on_event: Callable[[StreamEvent], None] | None = None,
        request_id: str | None = None,
        prepared: bool = False,
    ) -> RequestHandle:
        """Queue a request (``params.n`` sequences). Raises ``QueueFull`` when the queue is full,
        ``SchedulerClosed`` after shutdown. ``on_event`` runs on the worker thread and must not block."""
        ids = [int(t) for t in prompt_ids] if prepared else self.prepare(prompt_ids, params)
        rid = request_id or f"req-{next(self._ids)}"
        handle = RequestHandle(self, rid, ids, params)
        with self._cv:
            if self._closed:
                raise SchedulerClosed("the scheduler is not accepting requests (shutting down)")
            if self._thread is None:
                raise SchedulerClosed("the scheduler is not started; call start() first")
            depth = len({id(s.req) for s in self._waiting})
            if depth >= self.max_queue:
                raise QueueFull(
                    f"the request queue is full ({depth} waiting); retry later", retry_after=self.retry_after
                )
            seqs = [self._new_seq(handle, i, on_event) for i in range(params.n)]
            self._waiting.extend(seqs)
            self._stats.queue_depth = depth + 1
            self._cv.notify_all()
        if self.observer is not None:
            self.observer.on_prompt_tokens(len(ids))
        return handle

    # -- request setup ------------------------------------------------------------------------

    def _new_seq(self, req: RequestHandle, index: int, on_event: Callable[[StreamEvent], None] | None) -> _Seq:
        p = req.params
        if p.seed is not None:  # reproducible whatever else is running; index 0 matches LLM.generate
            rng = make_generator(p.seed) if index == 0 else np.random.default_rng([p.seed, index])
        else:
            rng = make_generator(None, self._rng)
        eos = set() if p.ignore_eos else set(self.info["eos_token_ids"])
        stop_ids = set(p.stop_token_ids or [])
        vocab = self.info.get("vocab_size")
        ids = req.prompt_token_ids
        stopper = StopChecker(p.stop_list, p.include_stop_str_in_output)
        room = self.max_context - len(ids)
        return _Seq(
            req=req,
            index=index,
            on_event=on_event,
            prompt_ids=ids,
            rng=rng,
            detok=IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=p.skip_special_tokens),
            stopper=stopper,
            history=TokenHistory(vocab, ids) if (p.has_penalties and vocab) else None,
            end_ids=eos | stop_ids,
            stop_ids=stop_ids,
            budget=min(p.max_tokens, room) if p.max_tokens is not None else room,
            hold=max(0, stopper.max_len - 1),
            feed=list(ids),
            cum_lp=0.0 if p.logprobs is not None else None,
            lp_list=[] if p.logprobs is not None else None,
        )

    # -- worker ---------------------------------------------------------------------------------

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._waiting and not self._running and not self._clears:
                    self._cv.wait()
                if self._stopping:
                    return
            try:
                self._step()
            except Exception as e:  # an engine failure must not kill the server: fail what was running
                log.exception("scheduler step failed")
                for s in list(self._running):
                    self._finish(s, "error", error=f"engine error: {e}")
            self._publish()

    def _publish(self) -> None:
        used, cached = int(self.engine.pages_in_use()), int(self.engine.cached_pages())
        with self._cv:
            st = self._stats
            st.queue_depth = len({id(s.req) for s in self._waiting})
            st.running = len(self._running)
            st.kv_pages_used, st.kv_pages_cached = used, cached

    def _step(self) -> None:
        with self._cv:
            clears, self._clears = self._clears, []
        for done, freed in clears:
            freed.append(int(self.engine.clear_prefix_cache()))
            done.set()
        self._drop_cancelled()
        decoding = [s for s in self._running if s.computed >= len(s.feed)]  # a sampled token is pending
        self._admit(decoding)
        self._publish()
        self._prefill()
        if decoding:
            self._decode(decoding)
        with self._cv:
            self._stats.steps += 1

    def _drop_cancelled(self) -> None:
        with self._cv:
            gone = [s for s in self._waiting if s.req.cancelled]
            if gone:
                self._waiting = deque(s for s in self._waiting if not s.req.cancelled)
        for s in gone + [s for s in self._running if s.req.cancelled]:
            self._finish(s, "abort")

    def _growth(self, seqs: Sequence[_Seq]) -> int:
        """Pages the next decode step of ``seqs`` adds."""
        eng = self.engine
        return sum(eng.pages_needed(eng.length(s.seq_id) + 1) - eng.pages_needed(eng.length(s.seq_id)) for s in seqs)

    def _promised(self) -> int:
        """Pages still to be taken by admitted sequences finishing their prefill (+ their first token)."""
        eng = self.engine
        return sum(
            max(0, eng.pages_needed(len(s.feed) + 1) - eng.pages_needed(eng.length(s.seq_id)))
            for s in self._running
            if s.computed < len(s.feed)
        )

    def _admit(self, decoding: list[_Seq]) -> None:
        eng = self.engine
        looked_up: list[tuple[int, int]] = []  # (prompt tokens, cached tokens) per admitted sequence
        with self._cv:
            if not self._waiting or len(self._running) >= self.max_batch:
                return
            available = eng.free_pages() - self._promised() - self._growth(decoding)
            while self._waiting and len(self._running) < self.max_batch:
                s = self._waiting[0]
                hit = eng.match_prefix(s.feed)
                # Cached pages are shared, not allocated; those nobody holds now stop counting as free.
                need = eng.pages_needed(len(s.feed) + 1) - len(hit.pages) + hit.idle
                if need > available:
                    break  # first come first served: later requests wait behind the head
                self._waiting.popleft()
                s.seq_id = eng.add_sequence(s.feed)
                s.computed = eng.length(s.seq_id)  # the cached prefix is not prefilled again
                self._running.append(s)
                available -= need
                looked_up.append((len(s.feed), s.computed))
        if self.observer is not None:
            for queried, hit_tokens in looked_up:
                self.observer.on_prefix_cache(queried, hit_tokens)

    def _prefill(self) -> None:
        s = next((s for s in self._running if s.computed < len(s.feed)), None)
        if s is None:
            return
        rest = len(s.feed) - s.computed
        take = min(self.prefill_chunk, rest)
        # No 1-token chunks: they take other kernels than longer chunks (last bits differ; the KV they
        # write is never cached), so a prompt's logits would depend on how it was chunked.
        if rest - take == 1:
            take = rest  # one token over the budget
        try:
            logits = self.engine.prefill(s.seq_id, s.feed[s.computed : s.computed + take])
        except KVCacheFullError as e:
            # Our page accounting should prevent this; requeue unless nothing else could free pages.
            if len(self._running) == 1:
                self._finish(s, "error", error=f"KV cache too small for this request: {e}")
            else:
                self._preempt(s)
            return
        s.computed += take
        if s.computed == len(s.feed):
            self._sample([s], np.asarray(logits).reshape(1, -1))

    def _decode(self, decoding: list[_Seq]) -> None:
        eng = self.engine
        decoding = [s for s in decoding if not s.finished and s.seq_id is not None]
        # Make room for this step's new pages by preempting the latest admitted sequences.
        while decoding and self._growth(decoding) > eng.free_pages():
            victim = self._running[-1]
            if victim is decoding[0] and len(decoding) == 1 and len(self._running) == 1:
                self._finish(victim, "length")  # alone and the pool is full: nothing else to free
                return
            self._preempt(victim)
            decoding = [s for s in decoding if s is not victim]
        if not decoding:
            return
        logits = eng.decode([s.seq_id for s in decoding], [s.out_ids[-1] for s in decoding])
        self._sample(decoding, np.asarray(logits).reshape(len(decoding), -1))

    def _preempt(self, s: _Seq) -> None:
        self.engine.remove_sequence(s.seq_id)
        self._running.remove(s)
        s.seq_id = None
        s.feed = s.prompt_ids + s.out_ids  # recompute: the last sampled token is fed by the prefill
        s.computed = 0
        with self._cv:
            self._waiting.appendleft(s)
            self._stats.preemptions += 1

    # -- sampling and output ----------------------------------------------------------------------

    def _sample(self, seqs: list[_Seq], logits: np.ndarray) -> None:
        params = [s.params for s in seqs]
        hist = [s.history for s in seqs] if any(s.history is not None for s in seqs) else None
        banned = [sorted(s.end_ids) if len(s.out_ids) < s.params.min_tokens else [] for s in seqs]
        toks = sample(logits, params, [s.rng for s in seqs], hist, banned=banned)
        now = time.perf_counter()
        for row, (s, tok) in enumerate(zip(seqs, toks.tolist(), strict=True)):
            self._accept(s, int(tok), logits[row], now)

    def _accept(self, s: _Seq, tok: int, logits: np.ndarray, now: float) -> None:
        p = s.params
        if s.history is not None:
            s.history.append(tok)
        step_lp: list[dict[int, Logprob]] | None = None
        if s.lp_list is not None:
            lp, top = token_logprobs(logits, tok, p.logprobs or 0)
            for t, entry in top.items():
                entry.decoded_token = self.tokenizer.decode([t], skip_special_tokens=False)
            s.cum_lp += lp
            s.lp_list.append(top)
            step_lp = [top]
        s.out_ids.append(tok)
        obs = self.observer
        if obs is not None:
            obs.on_generated_tokens(1)
            if s.last_token_time:
                obs.on_inter_token(now - s.last_token_time)
        if s.req.first_token_time is None:
            s.req.first_token_time = now
            if obs is not None:
                obs.on_first_token(now - s.req.arrival_time)
        s.last_token_time = now

        if tok in s.end_ids:
            if p.include_stop_str_in_output:
                s.detok.add(tok)
            self._finish(s, "stop", stop_reason=tok if tok in s.stop_ids else None, new=[tok], lp=step_lp)
            return
        delta = s.detok.add(tok)
        hit = s.stopper.check(s.detok.text, len(delta))
        if hit is not None:
            self._finish(s, "stop", stop_reason=hit[1], text=hit[0], new=[tok], lp=step_lp)
            return
        if len(s.out_ids) >= s.budget or len(s.prompt_ids) + len(s.out_ids) >= self.max_context:
            self._finish(s, "length", new=[tok], lp=step_lp)
            return
        safe = len(s.detok.text) - s.hold
        text = ""
        if safe > s.sent:
            text = s.detok.text[s.sent : safe]
            s.sent = safe
        self._emit(s, StreamEvent(s.req.request_id, s.index, text, [tok], step_lp))

    def _finish(
        self,
        s: _Seq,
        reason: str,
        *,
        stop_reason: int | str | None = None,
        text: str | None = None,
        new: list[int] | None = None,
        lp: list[dict[int, Logprob]] | None = None,
        error: str | None = None,
    ) -> None:
        if s.finished:
            return
        s.finished = True
        if s.seq_id is not None:
            self.engine.remove_sequence(s.seq_id)  # pages back to the pool at once
            s.seq_id = None
        if s in self._running:
            self._running.remove(s)
        final = s.detok.text if text is None else text
        req = s.req
        req.results[s.index] = SequenceResult(
            index=s.index,
            text=final,
            token_ids=list(s.out_ids),
            finish_reason=reason,
            stop_reason=stop_reason,
            cumulative_logprob=s.cum_lp,
            logprobs=s.lp_list,
            error=error,
        )
        all_done = all(r is not None for r in req.results)
        if all_done:
            req.finished_time = time.perf_counter()
        if self.observer is not None:
            self.observer.on_sequence_finished(reason)
        event = StreamEvent(
            req.request_id,
            s.index,
            final[s.sent :],
            new or [],
            lp,
            finish_reason=reason,
            stop_reason=stop_reason,
            error=error,
            request_finished=all_done,
        )
        s.sent = len(final)
        self._emit(s, event)
        if all_done:
            req._done.set()

    def _emit(self, s: _Seq, event: StreamEvent) -> None:
        if s.on_event is None:
            return
        try:
            s.on_event(event)
        except Exception:  # a broken consumer must not stop the batch
            log.exception("stream callback of request %s failed", event.request_id)
