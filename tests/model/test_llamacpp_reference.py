"""SmolLM2 (the shipped Q4_1 GGUF) against llama.cpp on the same file: an engine PerfX shares no code with.

* Tokenization: PerfX's tokenizer (built from the GGUF's vocabulary) gives llama.cpp's token ids on the
  shipped evaluation text (whole, per line, per clause), on the inputs of llama.cpp's own tokenizer tests,
  with llama.cpp's BOS rule and special-token parsing.
* Logits, teacher-forced over the first ``N_TOKENS`` tokens of that text: llama.cpp evaluates the whole
  sequence once (``logits_all=True``, 2 threads); PerfX runs it as one prefill (int8 activations: also one
  token at a time through the decode kernels). Per position: PerfX's top-1 token == llama.cpp's, and
  KL(llama.cpp || PerfX).
* The same against llama.cpp in float32 (an F32 copy of the file that llama.cpp dequantized itself, F32 KV
  cache): PerfX's f32 build equals it to float32 rounding (1e-4 of max |logit|; measured 1.0e-5).

Why the bounds are not tighter (docs/decisions/int8-agreement-with-llamacpp.md, 320 tokens): llama.cpp is not a float reference. It rounds every quantized linear's input to int8 (Q8_1
blocks for Q4_1 weights, Q8_0 for Q8_0: 32 values, d = amax/127 stored as fp16, round to nearest even: the
codes PerfX's VNNI kernels make; PerfX keeps d in f32) and keeps K/V in fp16. On this model int8 rounding is
chaotic: in a numpy emulation, inputs moved by 1e-6 relative before each rounding move the logits by up to
12% of max |logit| and flip top-1 on 2-2.5% of positions (KL 0.007), as much as int8 against float64 (3.1%,
KL 0.0065); llama.cpp against itself with an F32 KV cache or flash attention agrees on 96.25%; PerfX's int8
GEMM (prefill) and GEMV (decode), same formula, on 96.9%. The emulation with llama.cpp's fp16 d agrees with
llama.cpp on 97.2% (96.6% with fp16 K/V/Q/P too), no closer than PerfX (96.9%); PerfX's kernels changed to
round d and the Q4_1 block sums to fp16 (tried, not kept) gave 96.0% prefill / 97.3% decode. Matching the
block format cannot align rounding noise; only bit-equal inputs to every rounding could. So agreement with
llama.cpp as it runs the file is ~97% for both builds (not the 98% first hoped for int8), and the float32
comparison (llama.cpp on F32 weights: 1.0e-5 from PerfX f32, 100% top-1) is the tight one.

This test (480 positions) prints f32 97.1% top-1, mean KL 0.0055; int8 prefill 96.9%, KL 0.0070; int8 decode
(256) 97.3%, KL 0.0081; float32 1.0e-5. Broken on purpose: RoPE base read as the 10000 default instead of the
file's 100000 -> 79% / KL 0.34 (both builds); RMSNorm eps read as 1e-6 instead of the file's 1e-5 -> the
float32 test fails (1.4e-3), the others pass (97.3% / 0.0055); int8 activations truncated instead of rounded
-> 93.1% / KL 0.028; activation scale 5% off (amax/121) -> 87% / KL 0.12; 0.8% off (amax/126) -> 97.5% /
KL 0.0089, which passes (within the rounding noise).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests._cpu import needs_vnni

llama_cpp = pytest.importorskip("llama_cpp")

TEXT = Path(__file__).resolve().parents[2] / "perfx_compiler" / "data" / "kjv_genesis_1-3.txt"
N_TOKENS = 480  # positions compared in one prefill (the issue asks for >= 256; smol_desc's context is 512)
N_DECODE = 256  # of them, run one token at a time (decode is the slower way through)


def _gguf_path() -> str:
    from perfx_compiler.bench.models import resolve_model

    return str(resolve_model("smollm2-135m"))


@pytest.fixture(scope="module")
def vocab() -> Any:
    """llama.cpp's tokenizer for the shipped file (vocabulary only: no weights loaded)."""
    return llama_cpp.Llama(model_path=_gguf_path(), vocab_only=True, verbose=False)


@pytest.fixture(scope="module")
def perfx_tok(smol_desc) -> Any:
    from perfx_compiler.model.tokenizer import load_tokenizer

    return load_tokenizer(smol_desc.tokenizer_json)


@pytest.fixture(scope="module")
def eval_ids(perfx_tok) -> list[int]:
    ids = perfx_tok.encode(TEXT.read_text(encoding="utf-8"), add_special_tokens=False).ids[:N_TOKENS]
    assert len(ids) == N_TOKENS
    return ids


def _llamacpp_eval(ids: list[int], mode: str) -> np.ndarray:
    from perfx_compiler.bench.llamacpp_logits import llamacpp_logits

    return llamacpp_logits(_gguf_path(), ids, mode)


@pytest.fixture(scope="module")
def llamacpp_logits(eval_ids) -> np.ndarray:
    """llama.cpp as it runs the file: int8 activations (Q8_1 / Q8_0 blocks), fp16 KV cache."""
    return _llamacpp_eval(eval_ids, "default")


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def compare(ref: np.ndarray, got: np.ndarray) -> tuple[float, float, float]:
    """(top-1 agreement, mean KL(ref || got), max KL) over positions, in float64."""
    ref, got = np.asarray(ref, dtype=np.float64), np.asarray(got, dtype=np.float64)
    assert ref.shape == got.shape, (ref.shape, got.shape)
    lp, lq = _log_softmax(ref), _log_softmax(got)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    agree = float(np.mean(ref.argmax(-1) == got.argmax(-1)))
    return agree, float(kl.mean()), float(kl.max())


def _perfx_prefill(artifact: Path, ids: list[int]) -> np.ndarray:
    from perfx_compiler.runtime.engine import Engine

    eng = Engine(Path(artifact))
    eng.reset()
    return np.asarray(eng.prefill_all(ids), dtype=np.float64)


def _perfx_decode(artifact: Path, ids: list[int]) -> np.ndarray:
    """Teacher-forced one token at a time: the decode step's kernels (GEMV, fused prologues)."""
    from perfx_compiler.runtime.engine import Engine

    eng = Engine(Path(artifact))
    eng.reset()
    out = [np.asarray(eng.prefill(ids[:1]), dtype=np.float64).reshape(-1)]
    out += [np.asarray(eng.decode(t), dtype=np.float64).reshape(-1) for t in ids[1:]]
    return np.stack(out)


def _check(name: str, ref: np.ndarray, got: np.ndarray, min_agree: float, max_kl: float) -> None:
    agree, kl, kl_max = compare(ref, got)
    print(f"SmolLM2 {name} vs llama.cpp over {len(ref)} positions: top-1 agreement {agree:.4f}, "
          f"mean KL {kl:.5f}, max KL {kl_max:.4f}")
    assert agree >= min_agree and kl <= max_kl, (name, agree, kl)


# -- tokenization -------------------------------------------------------------------------------------


def _llama_ids(vocab: Any, text: str, add_bos: bool = False, special: bool = False) -> list[int]:
    return list(vocab.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special))


def test_tokenization_matches_llamacpp_on_eval_text(vocab, perfx_tok) -> None:
    text = TEXT.read_text(encoding="utf-8")
    assert _llama_ids(vocab, text) == perfx_tok.encode(text, add_special_tokens=False).ids
    # each line (a chapter), and each clause alone with and without the space before it (the text has 5
    # lines; a piece tokenized alone starts a new pre-tokenizer word, which the whole text never does)
    clauses = [c for c in re.split(r"(?<=[.;:,?!]) ", text.replace("\n", " ")) if c]
    pieces = text.splitlines() + clauses + [" " + c for c in clauses]
    assert len(pieces) > 500
    bad = [p for p in pieces if _llama_ids(vocab, p) != perfx_tok.encode(p, add_special_tokens=False).ids]
    assert not bad, f"{len(bad)} of {len(pieces)} pieces differ, first: {bad[0][:60]!r}"


def test_tokenization_bos_and_special_tokens_match_llamacpp(vocab, perfx_tok, smol_desc) -> None:
    """llama.cpp's BOS rule (the GGUF's add_bos_token) is the one PerfX's generation loop applies, and
    special tokens in the text are parsed as such (special=True) or tokenized as text (special=False)."""
    from perfx_compiler.model.tokenizer import render_chat

    line = TEXT.read_text(encoding="utf-8").splitlines()[0]
    bos = [smol_desc.config.bos_token_id] if smol_desc.config.add_bos_token else []
    assert _llama_ids(vocab, line, add_bos=True) == bos + perfx_tok.encode(line, add_special_tokens=False).ids
    chat = render_chat(smol_desc.chat_template, [{"role": "user", "content": line}], add_generation_prompt=True)
    assert "<|im_start|>" in chat
    parsed = perfx_tok.encode(chat, add_special_tokens=False).ids
    assert _llama_ids(vocab, chat, special=True) == parsed
    assert parsed.count(vocab.tokenize(b"<|im_start|>", add_bos=False, special=True)[0]) >= 2
    perfx_tok.encode_special_tokens = True  # special tokens as plain text, as llama.cpp's special=False
    try:
        assert _llama_ids(vocab, chat, special=False) == perfx_tok.encode(chat, add_special_tokens=False).ids
    finally:
        perfx_tok.encode_special_tokens = False


def test_tokenization_matches_llamacpp_on_vocab_test_inputs(vocab, perfx_tok) -> None:
    """SmolLM2's vocabulary over the inputs of llama.cpp's tokenizer tests (every ggml-vocab-*.inp: odd
    whitespace, scripts, emoji, digits, code), as text (special=False, as those tests tokenize)."""
    from tests.model.test_llamacpp_vocab import SEP, VOCAB_DIR

    files = sorted(VOCAB_DIR.glob("ggml-vocab-*.gguf.inp"))
    if not files:
        pytest.skip(f"llama.cpp vocab files absent in {VOCAB_DIR}; run tests/setup.sh")
    texts = sorted({t for f in files for t in f.read_text(encoding="utf-8").split(SEP) if t})
    assert len(texts) >= 40  # the files share most inputs: 49 distinct ones in llama-cpp-python 0.3.36
    perfx_tok.encode_special_tokens = True
    try:
        bad = [t for t in texts if _llama_ids(vocab, t) != perfx_tok.encode(t, add_special_tokens=False).ids]
    finally:
        perfx_tok.encode_special_tokens = False
    assert not bad, f"{len(bad)} of {len(texts)} inputs differ, first: {bad[0][:60]!r}"


# -- logits -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_f32_activations_equal_llamacpp_in_float32(smol_artifact, eval_ids) -> None:
    """llama.cpp on an F32 copy of the file it dequantized itself, F32 KV cache: a float32 engine with no
    int8 or fp16 step, so PerfX's f32 build must give its logits to float32 summation order: every
    position within 1e-4 of max |logit| (measured 1.0e-5), the same top-1 everywhere. Tighter than the
    float64 reference check (1e-3) and independent of PerfX's GGUF reader (RoPE base, eps, Q/K rows)."""
    ref = _llamacpp_eval(eval_ids, "f32-weights")
    got = _perfx_prefill(smol_artifact, eval_ids)
    err = np.abs(got - ref).max(axis=-1) / np.abs(ref).max(axis=-1)
    agree, kl, _ = compare(ref, got)
    print(f"SmolLM2 f32 activations vs llama.cpp in float32 over {len(ref)} positions: max rel logit error "
          f"{err.max():.2e} (median {np.median(err):.2e}), top-1 agreement {agree:.4f}, mean KL {kl:.2e}")
    assert err.max() < 1e-4 and agree == 1.0, (err.max(), agree)


@pytest.mark.slow
def test_f32_activations_agree_with_llamacpp(smol_artifact, eval_ids, llamacpp_logits) -> None:
    """>= 95% top-1, mean KL <= 0.01 (measured 97.1%, 0.0055: llama.cpp's own int8/fp16 rounding)."""
    _check("f32 activations (prefill)", llamacpp_logits, _perfx_prefill(smol_artifact, eval_ids), 0.95, 0.01)


@pytest.mark.slow
@needs_vnni
def test_int8_activations_agree_with_llamacpp(smol_int8_artifact, eval_ids, llamacpp_logits) -> None:
    """>= 94% top-1, mean KL <= 0.015 (measured 96.9% / 0.0070 prefill, 97.3% / 0.0081 decode: two
    independent int8 rounding noises, see the module docstring; a bound at 98% would fail at random)."""
    _check("int8 activations (prefill)", llamacpp_logits, _perfx_prefill(smol_int8_artifact, eval_ids), 0.94, 0.015)
    ids = eval_ids[:N_DECODE]
    _check("int8 activations (decode)", llamacpp_logits[:N_DECODE], _perfx_decode(smol_int8_artifact, ids), 0.94, 0.015)
