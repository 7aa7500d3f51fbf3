"""Tokenizers built from GGUF metadata (tiny and real SmolLM2) and chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from perfx_compiler.errors import ModelFormatError, PerfXError, UnsupportedModelError
from perfx_compiler.model.tokenizer import (
    ChatTemplateError,
    load_tokenizer,
    render_chat,
    tokenizer_json_from_gguf,
)

TEXTS = [
    "Once upon a time, there was a little girl named Emma.",
    "Hello world!\n\n\tIndented\r\nWindows line  two   spaces",
    "unicode: café naïve Straße — “quotes” …",
    "emoji 🤗🦙 and flags 🇫🇷, ZWJ 👩‍👩‍👧",
    "中文 日本語 한국어 العربية русский",
    "numbers 3.14159 1234567890 and code: def f(x): return x**2  # ok",
    "   leading and trailing spaces   ",
    "",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def smollm_tok():
    from perfx_compiler.model.gguf_header import read_gguf_header
    from perfx_compiler.model.loader import default_model_path

    try:
        path = default_model_path()
    except ModelFormatError as e:
        pytest.skip(str(e))
    reader = read_gguf_header(path)
    return load_tokenizer(tokenizer_json_from_gguf(reader.fields)), reader


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    from perfx_compiler.model.gguf_header import read_gguf_header
    from perfx_compiler.model.testing import write_tiny_gguf

    path, _ = write_tiny_gguf(tmp_path_factory.mktemp("tok") / "t.gguf")
    return load_tokenizer(tokenizer_json_from_gguf(read_gguf_header(path).fields))


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_round_trip(smollm_tok, text: str) -> None:
    tok, _ = smollm_tok
    ids = tok.encode(text).ids
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_smollm2_known_ids(smollm_tok) -> None:
    tok, reader = smollm_tok
    vocab = reader.fields["tokenizer.ggml.tokens"]
    enc = tok.encode("Once upon a time")
    # Whole words are single tokens; 'Ġ' marks the space (checked against the GGUF vocab itself).
    assert enc.tokens == ["Once", "Ġupon", "Ġa", "Ġtime"]
    assert enc.ids == [6403, 1980, 253, 655]
    assert [vocab[i] for i in enc.ids] == enc.tokens
    # No BOS is added by the tokenizer itself (the runtime adds it per config.add_bos_token).
    assert tok.encode("Hi").ids == tok.encode("Hi", add_special_tokens=True).ids


def test_smollm2_special_tokens(smollm_tok) -> None:
    tok, _ = smollm_tok
    assert tok.encode("<|im_start|>").ids == [1]
    assert tok.encode("<|im_end|>").ids == [2]
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2 and 1 not in ids[1:-1]
    assert tok.decode(ids) == "user\nHi"  # specials skipped by default
    # smollm pre-tokenizer: every digit on its own (llama.cpp's \p{N} split)
    assert tok.encode("2024").tokens == ["2", "0", "2", "4"]


def test_tiny_vocab_merges_and_specials(tiny_tok) -> None:
    enc = tiny_tok.encode("Once the hello<|im_end|>")
    assert enc.tokens == ["Once", "Ġthe", "Ġhello", "<|im_end|>"]
    assert enc.ids[-1] == 2
    for text in TEXTS:
        assert tiny_tok.decode(tiny_tok.encode(text).ids, skip_special_tokens=False) == text


def _fields(**over):
    from perfx_compiler.model.testing import tiny_vocab

    tokens, types, merges = tiny_vocab()
    base = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges}
    base.update(over)
    return base


def test_pre_tokenizer_choice_matters() -> None:
    # gpt-2 keeps digit runs together, smollm/qwen2 split each digit, llama3 groups up to three.
    text = "x 12345"
    gpt2 = load_tokenizer(tokenizer_json_from_gguf(_fields()))
    qwen2 = load_tokenizer(tokenizer_json_from_gguf(_fields(**{"tokenizer.ggml.pre": "qwen2"})))
    llama3 = load_tokenizer(tokenizer_json_from_gguf(_fields(**{"tokenizer.ggml.pre": "llama-bpe"})))
    pieces = {name: t.pre_tokenizer.pre_tokenize_str(text) for name, t in
              (("gpt2", gpt2), ("qwen2", qwen2), ("llama3", llama3))}
    assert [p for p, _ in pieces["gpt2"]] == ["x", "Ġ12345"]
    assert [p for p, _ in pieces["qwen2"]] == ["x", "Ġ", "1", "2", "3", "4", "5"]
    assert [p for p, _ in pieces["llama3"]] == ["x", "Ġ", "123", "45"]


def test_unsupported_tokenizers() -> None:
    with pytest.raises(UnsupportedModelError, match="tekken"):
        tokenizer_json_from_gguf(_fields(**{"tokenizer.ggml.pre": "tekken"}))
    with pytest.raises(UnsupportedModelError, match="bert"):
        tokenizer_json_from_gguf(_fields(**{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(ModelFormatError):
        tokenizer_json_from_gguf(_fields(**{"tokenizer.ggml.tokens": []}))
    with pytest.raises(ModelFormatError):
        load_tokenizer("{not json")


def test_missing_tokenizers_package_is_not_called_a_corrupt_file(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers -> ImportError
    with pytest.raises(PerfXError, match="'tokenizers' package is missing") as e:
        tokenizer_json_from_gguf(_fields())
    assert not isinstance(e.value, ModelFormatError)


def test_sentencepiece_vocab() -> None:
    # A tiny SentencePiece-style vocab: <unk>, <s>, </s>, byte tokens, and scored pieces.
    # (the quote, backslash and newline pieces: merges whose JSON needs escapes)
    pieces = ["▁h", "el", "lo", "▁hel", "▁hello", "▁w", "or", "ld", "▁wor", "▁world", "e", "h", "l", "o", "w", "r", "d", "▁",
              '"', "\\", "\n", '▁"', '"\\', "\n\n"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    fields = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
              "tokenizer.ggml.scores": scores, "tokenizer.ggml.unknown_token_id": 0}
    text = tokenizer_json_from_gguf(fields)
    tok = load_tokenizer(text)
    # The merges are written by PerfX, not by tokenizers: tokenizers reads them back and writes the same text.
    assert tok.to_str() == text
    assert ["▁hel", "lo"] in json.loads(text)["model"]["merges"]
    assert tok.encode('"\\').tokens == ['▁"', "\\"]  # '▁"' outscores '"\\'
    assert tok.encode("\n\n").tokens == ["▁", "\n\n"]
    enc = tok.encode("hello world")
    assert enc.tokens == ["▁hello", "▁world"]
    assert tok.decode(enc.ids) == "hello world"
    enc = tok.encode("hi ☃")  # 'i' and the snowman fall back to bytes
    assert "<0x69>" in enc.tokens and "<0xE2>" in enc.tokens
    assert tok.decode(enc.ids) == "hi ☃"
    assert tok.encode("</s>").ids == [2]


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_render_chat() -> None:
    msgs = [{"role": "user", "content": "Hi"}]
    assert render_chat(CHATML, msgs) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat(CHATML, msgs, add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"
    llama2 = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}{{ eos_token }}"
    assert render_chat(llama2, msgs, bos_token="<s>", eos_token="</s>") == "<s>[INST] Hi [/INST]</s>"
    strict = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}"
    with pytest.raises(ChatTemplateError, match="system first"):
        render_chat(strict, msgs)
    with pytest.raises(ChatTemplateError):
        render_chat("{% for %}", msgs)
    assert render_chat("{{ messages | tojson }}", msgs) == '[{"role": "user", "content": "Hi"}]'


def test_render_smollm2_template(smollm_tok) -> None:
    tok, reader = smollm_tok
    template = reader.fields["tokenizer.chat_template"]
    text = render_chat(template, [{"role": "user", "content": "What is 2+2?"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(text).ids
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2


def test_tokenizer_json_is_self_contained(tmp_path: Path, tiny_tok) -> None:
    p = tmp_path / "tokenizer.json"
    p.write_text(tiny_tok.to_str(), encoding="utf-8")
    again = load_tokenizer(p.read_text(encoding="utf-8"))
    assert again.encode("Once the hello").ids == tiny_tok.encode("Once the hello").ids
