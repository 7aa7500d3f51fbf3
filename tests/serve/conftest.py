"""Fixtures for the serving tests: a FakeBatchEngine with the BatchEngine interface, and a live server.

The fake's logits depend on the sequence's whole history (a rolling hash) as well as
its last token, so a scheduler that mixed up sequences, positions or pages would
change the text. Only printable ASCII can win, so greedy outputs are readable. Its
pages (and prefix cache) are the real engine's bookkeeping, ``PagePool``.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from perfx_compiler.runtime.prefix_cache import PagePool, PrefixHit
from tests.runtime.conftest import BOS, EOS, build_tokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


class FakeBatchEngine:
    """The ``BatchEngine`` interface over numpy: paged accounting, batched decode, deterministic logits."""

    def __init__(
        self,
        tokenizer_path: str | Path,
        *,
        vocab_size: int,
        bos_token_id: int,
        eos_token_id: int,
        max_context: int = 128,
        page_size: int = 4,
        num_pages: int | None = None,
        max_batch: int = 16,
        eos_after: int | None = None,
        step_delay: float = 0.0,
        decode_gate: threading.Event | None = None,
        chat_template: str | None = CHAT_TEMPLATE,
        seed: int = 0,
        prefix_cache: bool = True,
    ) -> None:
        self.manifest: dict[str, Any] = {
            "model": {
                "name": "fake-model",
                "vocab_size": vocab_size,
                "max_context": max_context,
                "bos_token_id": bos_token_id,
                "eos_token_ids": [eos_token_id],
                "add_bos_token": True,
            },
            "chat_template": chat_template,
        }
        self.tokenizer_path = Path(tokenizer_path)
        self.max_context = max_context
        self.page_size = page_size
        self.max_batch = max_batch
        self.num_pages = num_pages or max_batch * -(-max_context // page_size)
        self.vocab_size = vocab_size
        self.eos = eos_token_id
        self.eos_after = eos_after  # force EOS after this many generated tokens
        self.step_delay = step_delay
        self.decode_gate = decode_gate  # decode blocks until the test sets it: timing-free queueing tests
        rng = np.random.default_rng(seed)
        self.table = rng.normal(0.0, 2.0, size=(vocab_size, vocab_size)).astype(np.float32)
        self.mix = rng.normal(0.0, 1.0, size=(997, vocab_size)).astype(np.float32)
        printable = np.zeros(vocab_size, dtype=bool)
        printable[32:127] = True
        self.table[:, ~printable] = -50.0  # EOS (and BOS, control bytes, merges) never win by chance
        self.page_pool = PagePool(self.num_pages, page_size, max_context, prefix_cache=prefix_cache)
        self._tokens: dict[int, list[int]] = {}
        self._prompt_len: dict[int, int] = {}
        self.decode_batch_sizes: list[int] = []
        self.prefill_chunks: list[int] = []
        self.lock = threading.Lock()  # asserts the engine is never used from two threads at once

    def free_pages(self) -> int:
        return self.page_pool.free_pages()

    def pages_in_use(self) -> int:
        return self.page_pool.pages_in_use()

    def cached_pages(self) -> int:
        return self.page_pool.cached_pages()

    def pages_needed(self, num_tokens: int) -> int:
        return self.page_pool.pages_needed(num_tokens)

    def match_prefix(self, prompt: Sequence[int]) -> PrefixHit:
        return self.page_pool.match(prompt)

    def add_sequence(self, prompt: Sequence[int] | None = None) -> int:
        sid = self.page_pool.add_sequence(prompt)
        self._tokens[sid] = [int(t) for t in (prompt or [])[: self.page_pool.length(sid)]]  # the cached prefix
        if prompt is not None:
            self._prompt_len[sid] = len(prompt)
        return sid

    def remove_sequence(self, seq_id: int) -> None:
        self.page_pool.remove_sequence(seq_id)
        self._tokens.pop(seq_id, None)
        self._prompt_len.pop(seq_id, None)

    def clear_prefix_cache(self) -> int:
        return self.page_pool.clear()

    def length(self, seq_id: int) -> int:
        assert self.page_pool.length(seq_id) == len(self._tokens[seq_id])
        return len(self._tokens[seq_id])

    def _logits(self, sid: int) -> np.ndarray:
        toks = self._tokens[sid]
        h = 0
        for t in toks:
            h = (h * 31 + t) % 997
        row = self.table[toks[-1]] + 0.5 * self.mix[h]
        gen = len(toks) - self._prompt_len.get(sid, len(toks))
        if self.eos_after is not None and gen >= self.eos_after:
            row = row.copy()
            row[self.eos] = 100.0
        return row

    def prefill(self, seq_id: int, token_ids: Sequence[int]) -> np.ndarray:
        with self.lock:
            if not token_ids:
                raise ValueError("no tokens")
            self.page_pool.reserve(seq_id, len(token_ids))
            if not self._tokens[seq_id]:
                self._prompt_len.setdefault(seq_id, len(token_ids))
            self._tokens[seq_id].extend(int(t) for t in token_ids)
            self.page_pool.commit(seq_id, token_ids, prefill=True)
            self.prefill_chunks.append(len(token_ids))
            if self.step_delay:
                time.sleep(self.step_delay)
            return self._logits(seq_id)

    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        with self.lock:
            assert len(seq_ids) == len(token_ids) and len(set(seq_ids)) == len(seq_ids)
            if self.decode_gate is not None and not self.decode_gate.wait(60):
                raise TimeoutError("the test never opened the decode gate")
            for sid in seq_ids:
                self.page_pool.reserve(sid, 1)
            for sid, t in zip(seq_ids, token_ids, strict=True):
                self._tokens[sid].append(int(t))
                self.page_pool.commit(sid, [t], prefill=False)
            self.decode_batch_sizes.append(len(seq_ids))
            if self.step_delay:
                time.sleep(self.step_delay)
            return np.stack([self._logits(sid) for sid in seq_ids])


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    return build_tokenizer()


@pytest.fixture(scope="session")
def tokenizer_file(tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture
def make_engine(tokenizer: Any, tokenizer_file: Path) -> Callable[..., FakeBatchEngine]:
    def make(**kw: Any) -> FakeBatchEngine:
        kw.setdefault("vocab_size", tokenizer.get_vocab_size(with_added_tokens=True))
        kw.setdefault("bos_token_id", tokenizer.token_to_id(BOS))
        kw.setdefault("eos_token_id", tokenizer.token_to_id(EOS))
        return FakeBatchEngine(tokenizer_file, **kw)

    return make


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LiveServer:
    """uvicorn serving an app on a free 127.0.0.1 port in a background thread."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(20)


@pytest.fixture
def serve(make_engine: Callable[..., FakeBatchEngine]) -> Iterator[Callable[..., LiveServer]]:
    """``serve(engine_kw={}, **app_kw)``: start the app on a FakeBatchEngine; stopped after the test."""
    from perfx_compiler.serve.app import create_app

    servers: list[LiveServer] = []

    def start(engine_kw: dict[str, Any] | None = None, **app_kw: Any) -> LiveServer:
        engine = make_engine(**(engine_kw or {}))
        srv = LiveServer(create_app(engine, **app_kw)).__enter__()
        srv.engine = engine  # type: ignore[attr-defined]
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        with contextlib.suppress(Exception):
            srv.__exit__(None, None, None)


@pytest.fixture(scope="module")
def serve_shared(tokenizer: Any, tokenizer_file: Path) -> Iterator[LiveServer]:
    """One server (default FakeBatchEngine) shared by a module's read-only tests."""
    from perfx_compiler.serve.app import create_app

    engine = FakeBatchEngine(
        tokenizer_file,
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        bos_token_id=tokenizer.token_to_id(BOS),
        eos_token_id=tokenizer.token_to_id(EOS),
    )
    with LiveServer(create_app(engine)) as srv:
        srv.engine = engine  # type: ignore[attr-defined]
        yield srv


@pytest.fixture
def sched_factory(make_engine: Any, tokenizer: Any):
    """Started schedulers over fake engines (``engine_kw``: FakeBatchEngine options; the rest: Scheduler's),
    shut down after the test."""
    from perfx_compiler.serve.scheduler import Scheduler

    made: list[Scheduler] = []

    def make(engine_kw: dict[str, Any] | None = None, **kw: Any) -> Scheduler:
        s = Scheduler(make_engine(**(engine_kw or {})), tokenizer, **kw)
        s.start()
        made.append(s)
        return s

    yield make
    for s in made:
        s.shutdown()
