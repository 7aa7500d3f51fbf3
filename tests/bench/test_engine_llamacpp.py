"""The llama.cpp peer of perfx-bench generates greedily: its tokens are the argmax of llama.cpp's logits.

llama-cpp-python is an optional dependency (``pip install .[bench]``); without it these tests skip.
"""

from __future__ import annotations

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from perfx_compiler.bench.engines import LlamaCppEngine  # noqa: E402
from perfx_compiler.bench.models import resolve_model  # noqa: E402


def _reference_greedy(path: str, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens from logits the bindings copy out themselves (``logits_all=True``: ``scores``), with the
    peer's own settings otherwise (flash attention, batch sizes, threads): other settings round differently
    and flip near-ties (seeds 1 and 8 did with the defaults)."""
    llm = llama_cpp.Llama(model_path=path, n_ctx=256, n_batch=64, n_ubatch=64, n_threads=2, n_threads_batch=2,
                          logits_all=True, flash_attn=True, verbose=False)
    llm.eval(prompt)
    out = [int(np.argmax(llm.scores[llm.n_tokens - 1]))]
    for _ in range(steps):
        llm.eval([out[-1]])
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
    return out


def test_llamacpp_peer_is_greedy():
    path = str(resolve_model("smollm2-135m"))
    prompt = [int(t) for t in np.random.default_rng().integers(100, 20000, 12)]
    expected = _reference_greedy(path, prompt, 6)
    assert len(set(expected)) > 1  # a real continuation, not one token repeated

    engine = LlamaCppEngine(path, threads=2, n_ctx=256, n_batch=64)
    engine.reset()
    stepwise = [engine.prefill(prompt)]
    for _ in range(6):
        stepwise.append(engine.decode(stepwise[-1]))
    assert stepwise == expected

    # the many-step loop the benchmark times (one llama_decode per token) gives the same last token,
    # after a reset, and leaves the engine able to run a new sequence
    for _ in range(2):
        engine.reset()
        first = engine.prefill(prompt)
        assert first == expected[0]
        assert engine.decode_many(first, 6) == expected[-1]
        assert engine.llm.n_tokens == len(prompt) + 6
