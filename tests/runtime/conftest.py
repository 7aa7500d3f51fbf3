"""Fixtures for the runtime tests: a tiny byte-level BPE tokenizer and a FakeEngine.

The FakeEngine implements the ``Engine`` interface with deterministic numpy logits:
a seeded bigram table, optionally overridden by a *script* (the continuation it
should produce after the prompt, then EOS) so text-level behaviour is testable.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run from anywhere, without an install
    sys.path.insert(0, str(REPO))

from perfx_compiler.errors import ContextLengthError  # noqa: E402  (after the sys.path insert above)
from perfx_compiler.model.testing import byte_level_alphabet  # noqa: E402

BOS, EOS = "<s>", "</s>"


def build_tokenizer() -> Any:
    """Byte-level BPE: ids 0-255 are the bytes, then 3 merges, then <s> and </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    b2u = byte_level_alphabet()  # GPT-2's byte -> printable character map (ByteLevel pre-tokenization's)
    vocab = {b2u[b]: b for b in range(256)}
    merges = [("h", "e"), ("l", "l"), (b2u[ord(" ")], "w")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS])
    return tok


class FakeEngine:
    """The ``Engine`` interface over a bigram table; never lets the cache exceed max_context."""

    def __init__(
        self,
        tokenizer_path: str | Path,
        *,
        vocab_size: int,
        bos_token_id: int,
        eos_token_id: int,
        max_context: int = 64,
        add_bos_token: bool = True,
        chat_template: str | None = None,
        script: Sequence[int] | None = None,
        seed: int = 0,
        last_only: bool = False,
    ) -> None:
        self.manifest: dict[str, Any] = {
            "model": {
                "name": "fake",
                "vocab_size": vocab_size,
                "max_context": max_context,
                "bos_token_id": bos_token_id,
                "eos_token_ids": [eos_token_id],
                "add_bos_token": add_bos_token,
            },
            "chat_template": chat_template,
            "target": "fake",
        }
        self.tokenizer_path = Path(tokenizer_path)
        self.max_context = max_context
        self.position = 0
        self.tokens: list[int] = []
        self.eos = eos_token_id
        self.script = list(script) if script is not None else None
        self.prompt_len = 0
        rng = np.random.default_rng(seed)
        self.table = rng.normal(0.0, 2.0, size=(vocab_size, vocab_size)).astype(np.float32)
        self.table[:, [bos_token_id, eos_token_id]] = -10.0  # unscripted runs don't stop by chance
        self.last_only = last_only  # like the real engine: prefill -> [1, vocab], prefill_all -> [len, vocab]
        self.prefill_calls: list[list[int]] = []
        self.decode_calls: list[int] = []

    def reset(self) -> None:
        self.tokens = []
        self.position = 0

    def _next_logits(self, i: int) -> np.ndarray:
        row = self.table[self.tokens[i]].copy()
        k = i + 1 - self.prompt_len  # index of the token being predicted in the script
        if self.script is not None and k >= 0:
            row[self.script[k] if k < len(self.script) else self.eos] += 30.0
        return row

    def _append(self, ids: Sequence[int]) -> np.ndarray:
        if self.position + len(ids) > self.max_context:
            raise ContextLengthError(f"cache full: {self.position}+{len(ids)} > {self.max_context}")
        start = len(self.tokens)
        self.tokens.extend(int(t) for t in ids)
        self.position = len(self.tokens)
        return np.stack([self._next_logits(i) for i in range(start, self.position)])

    def prefill(self, token_ids: Sequence[int]) -> np.ndarray:
        if self.position == 0:
            self.prompt_len = len(token_ids)
        self.prefill_calls.append(list(token_ids))
        out = self._append(token_ids)
        return out[-1:] if self.last_only else out

    def prefill_all(self, token_ids: Sequence[int]) -> np.ndarray:
        if self.position == 0:
            self.prompt_len = len(token_ids)
        return self._append(token_ids)

    def decode(self, token_id: int) -> np.ndarray:
        self.decode_calls.append(int(token_id))
        return self._append([token_id])[0]


class GreedyLoopFakeEngine(FakeEngine):
    """A FakeEngine with ``decode_greedy`` (the real Engine's many-step greedy call), counting its calls."""

    greedy_calls = 0

    def decode_greedy(self, token_id: int, max_tokens: int, stop_ids: Sequence[int] = ()) -> list[int]:
        if self.position + max_tokens > self.max_context:
            raise ContextLengthError(f"cache full: {self.position}+{max_tokens} > {self.max_context}")
        self.greedy_calls += 1
        out: list[int] = []
        tok = int(token_id)
        while len(out) < max_tokens:
            self.decode_calls.append(tok)
            tok = int(np.argmax(self._append([tok])[0]))
            out.append(tok)
            if tok in set(stop_ids):
                break
        return out


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    return build_tokenizer()


@pytest.fixture
def make_engine(tokenizer: Any, tmp_path: Path) -> Callable[..., FakeEngine]:
    """``make_engine(script_text=None, **kw)``: a FakeEngine over the test tokenizer."""
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))

    def make(script_text: str | None = None, greedy_loop: bool = False, **kw: Any) -> FakeEngine:
        if script_text is not None:
            kw["script"] = tokenizer.encode(script_text, add_special_tokens=False).ids
        kw.setdefault("vocab_size", tokenizer.get_vocab_size(with_added_tokens=True))
        kw.setdefault("bos_token_id", tokenizer.token_to_id(BOS))
        kw.setdefault("eos_token_id", tokenizer.token_to_id(EOS))
        return (GreedyLoopFakeEngine if greedy_loop else FakeEngine)(path, **kw)

    return make


def write_artifact(directory: Path, tokenizer: Any, engine_kw: dict[str, Any] | None = None) -> Path:
    """A directory that looks like an artifact to ``resolve_artifact``; ``load_engine`` is faked."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "perfx-config.json").write_text(json.dumps({"fake_engine": engine_kw or {}}))
    return directory


@pytest.fixture
def fake_artifacts(monkeypatch: pytest.MonkeyPatch, tokenizer: Any, tmp_path: Path) -> Callable[..., Path]:
    """Patch ``api.load_engine`` to build FakeEngines; returns ``make_artifact(script_text=None, **kw)``."""
    from perfx_compiler.runtime import api

    def load(artifact_dir: str | Path, *, verify: bool = True) -> FakeEngine:
        d = Path(artifact_dir)
        kw = dict(json.loads((d / "perfx-config.json").read_text())["fake_engine"])
        script_text = kw.pop("script_text", None)
        if script_text is not None:
            kw["script"] = tokenizer.encode(script_text, add_special_tokens=False).ids
        kw.setdefault("vocab_size", tokenizer.get_vocab_size(with_added_tokens=True))
        kw.setdefault("bos_token_id", tokenizer.token_to_id(BOS))
        kw.setdefault("eos_token_id", tokenizer.token_to_id(EOS))
        return FakeEngine(d / "tokenizer.json", **kw)

    monkeypatch.setattr(api, "load_engine", load)
    counter = iter(range(10**6))

    def make_artifact(script_text: str | None = None, **kw: Any) -> Path:
        if script_text is not None:
            kw["script_text"] = script_text
        return write_artifact(tmp_path / f"artifact{next(counter)}", tokenizer, kw)

    return make_artifact
