"""Our GGUF tokenizers against llama.cpp's own expected tokenizations.

llama.cpp ships vocab-only GGUFs with inputs (.inp) and the token ids its
tokenizer must produce (.out). Fetch them once with tests/setup.sh;
the directory is $PERFX_LLAMACPP_VOCAB_DIR or ~/.cache/perfx/llamacpp-vocab.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from perfx_compiler.model.tokenizer import load_tokenizer, tokenizer_json_from_gguf

VOCAB_DIR = Path(os.environ.get("PERFX_LLAMACPP_VOCAB_DIR", "~/.cache/perfx/llamacpp-vocab")).expanduser()
# Vocabularies whose tokenizer.ggml.model / pre PerfX supports (gpt2-style BPE and SentencePiece 'llama').
VOCABS = (
    "gpt-2", "llama-bpe", "qwen2", "qwen35", "starcoder", "refact", "command-r", "mpt", "falcon",
    "deepseek-coder", "deepseek-llm", "llama-spm", "phi-3",
)
SEP = "\n__ggml_vocab_test__\n"


def _cases(name: str) -> list[tuple[str, list[int]]]:
    base = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
    raw = Path(f"{base}.inp").read_text(encoding="utf-8")
    inputs = raw.split(SEP)
    if inputs and inputs[-1] == "":  # the file ends with a separator
        inputs.pop()
    outputs = Path(f"{base}.out").read_text(encoding="utf-8").split("\n")[: len(inputs)]
    assert len(outputs) == len(inputs), f"{name}: .inp/.out disagree"
    return [(s, [int(t) for t in o.split()]) for s, o in zip(inputs, outputs, strict=True)]


def _tokenizer_json(gguf_path: Path, cache_dir: Path) -> str:
    """Tokenizer JSON for a vocab GGUF, cached: building the tokenizer takes seconds on 150k+ token vocabs.

    The key covers the GGUF file and our tokenizer builder's source, so a code change rebuilds it.
    """
    import perfx_compiler.model.tokenizer as builder
    from perfx_compiler.model.gguf_header import read_gguf_header

    st = gguf_path.stat()
    key = hashlib.sha256(Path(builder.__file__).read_bytes() + f"{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = cache_dir / f"{gguf_path.stem}-{key}.json"
    if cached.is_file():
        return cached.read_text(encoding="utf-8")
    text = tokenizer_json_from_gguf(read_gguf_header(gguf_path).fields)
    cached.write_text(text, encoding="utf-8")
    return text


@pytest.mark.parametrize("name", VOCABS)
def test_matches_llamacpp(name: str, request: pytest.FixtureRequest) -> None:
    gguf_path = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
    if not Path(f"{gguf_path}.out").is_file():
        reason = f"llama.cpp vocab files absent in {VOCAB_DIR}; run tests/setup.sh"
        print(reason)
        pytest.skip(reason)
    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    cache_dir = Path(cache.mkdir("perfx-llamacpp-vocab")) if cache else Path.home() / ".cache/perfx/llamacpp-tok"
    cache_dir.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(_tokenizer_json(gguf_path, cache_dir))
    tok.encode_special_tokens = True  # llama.cpp's test tokenizes with parse_special=false
    bad = []
    for text, expected in _cases(name):
        got = tok.encode(text, add_special_tokens=False).ids
        if got != expected:
            bad.append(f"{text[:40]!r}: {got[:10]} != {expected[:10]}")
    assert not bad, f"{len(bad)} mismatches: " + "; ".join(bad[:3])
