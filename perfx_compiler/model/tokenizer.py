"""Tokenizers built from GGUF metadata, and chat-template rendering.

Contract for every ``tokenizer_json`` PerfX produces: encoding adds no special
tokens by itself (no post-processor); the runtime prepends
``config.bos_token_id`` when ``config.add_bos_token`` is set. Special tokens
written in the text (``<|im_start|>``) are recognised as single ids.

GGUF vocabularies:
* ``tokenizer.ggml.model == 'gpt2'``: byte-level BPE; the pre-tokenizer regexes
  follow llama.cpp's ``tokenizer.ggml.pre`` table (llama-vocab.cpp), applied in
  sequence as llama.cpp does.
* ``tokenizer.ggml.model == 'llama'``: SentencePiece vocab with scores, rebuilt as
  a BPE with byte fallback whose merges are ranked by the merged piece's score
  (what llama.cpp's SPM tokenizer does).
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import numpy as np

from perfx_compiler.errors import ModelFormatError, PerfXError, UnsupportedModelError

# llama.cpp token types (gguf.TokenType)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# deepseek-llm's explicit Latin/Greek/Cyrillic... letter class, verbatim from llama.cpp.
_DEEPSEEK_LLM = ["[\r\n]", '\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+', '\\s?[!-/:-~！-／：-～‘-‟\u3000-。]+', r"\s+$", '[一-龥ࠀ-一가-\ud7ff]+', r"\p{N}+"]
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> (regexes applied in sequence, BPE ignore_merges) as in llama.cpp's llama-vocab.cpp
_PRE: dict[str, tuple[list[str], bool]] = {}
for _names, _regexes, _ignore in (
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "lfm2"), [_LLAMA3], True),
    (("dbrx", "smaug-bpe"), [_LLAMA3], False),
    (("qwen2", "deepseek-r1-qwen", "stablelm2"), [_QWEN2], False),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"), [r"\p{N}", _GPT2], False),
    (("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4"), [_GPT2], False),
    (("falcon",), [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"], False),
    (("deepseek-llm",), _DEEPSEEK_LLM, False),
    (("qwen35",), [_QWEN35], False),
    (("deepseek-coder",), ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"], False),
    (("default",), [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"], False),
):
    for _n in _names:
        _PRE[_n] = (_regexes, _ignore)

SUPPORTED_PRE_TOKENIZERS = tuple(sorted(_PRE))


def _add_added_tokens(tok: Any, tokens: Sequence[str], types: Sequence[int], skip: set[int]) -> None:
    """CONTROL tokens become special added tokens, USER_DEFINED ones plain added tokens.

    Both are matched verbatim in input text, as llama.cpp does.
    """
    from tokenizers import AddedToken

    special, plain = [], []
    for i, (t, ty) in enumerate(zip(tokens, types, strict=False)):
        if i in skip or ty not in (_CONTROL, _USER_DEFINED) or not t:
            continue
        added = AddedToken(t, special=ty == _CONTROL, normalized=False, single_word=False, lstrip=False, rstrip=False)
        (special if ty == _CONTROL else plain).append(added)
    tok.add_special_tokens(special)
    tok.add_tokens(plain)


def _bpe_tokenizer(tokens: Sequence[str], types: Sequence[int], merges: Sequence[str], pre: str) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    if pre not in _PRE:
        raise UnsupportedModelError(
            f"GGUF pre-tokenizer '{pre}' is not supported; PerfX handles: {', '.join(SUPPORTED_PRE_TOKENIZERS)}"
        )
    regexes, ignore_merges = _PRE[pre]
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # first id wins on duplicates, like llama.cpp's token_to_id
    pairs = []
    for m in merges:
        cut = m.find(" ", 1)  # like llama.cpp: the first piece may itself be a space
        if cut < 0:
            continue
        left, right = m[:cut], m[cut + 1:]
        if left in vocab and right in vocab and left + right in vocab:
            pairs.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges, fuse_unk=False, byte_fallback=False))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in regexes]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    _add_added_tokens(tok, tokens, types, set())
    return tok


_NO_MERGES = '"merges":[]'
_MERGES_SLICE = 16384


def _spm_tokenizer_json(tokens: Sequence[str], types: Sequence[int], scores: Sequence[float], add_space_prefix: bool,
                        unk_id: int | None) -> str:
    """The tokenizer JSON of an SPM vocabulary: a BPE with byte fallback whose merges rank by the merged piece's score.

    ``tokenizers`` builds and serializes everything but the merges (vocabulary, special tokens, normalizer,
    decoder: a BPE with an empty merge list); the merges array is written here, slice by slice, in the form
    ``tokenizers`` writes (``[["left","right"], ...]``). For Gemma 3's 262k pieces (515k merges) the merges as
    Python tuples, the Rust BPE's copy and its serialization each held 55-85 MB at once."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    # Every split of a piece into two pieces of the vocabulary is a merge (valid by construction).
    # Kept as id arrays, not tuples of strings: 515k merges are 160 MB as tuples.
    pids, lefts, rights = array("i"), array("i"), array("i")
    for piece, pid in vocab.items():
        if types[pid] not in (_NORMAL, _USER_DEFINED):
            continue
        for k in range(1, len(piece)):
            left, right = vocab.get(piece[:k]), vocab.get(piece[k:])
            if left is not None and right is not None:
                pids.append(pid)
                lefts.append(left)
                rights.append(right)
    pid_a, left_a, right_a = (np.frombuffer(a, dtype=np.int32) for a in (pids, lefts, rights))
    neg_score = -np.asarray(scores, dtype=np.float64)[pid_a]
    order = np.lexsort((right_a, left_a, pid_a, neg_score))  # best score first, then by ids
    left_a, right_a = left_a[order], right_a[order]
    del pids, lefts, rights, pid_a, order
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=unk, fuse_unk=True, byte_fallback=True))
    del vocab
    norm = [normalizers.Replace(" ", "▁")]
    if add_space_prefix:
        norm.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(norm)
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    skip = {unk_id} if unk_id is not None else set()
    _add_added_tokens(tok, tokens, types, skip)
    text = tok.to_str()
    del tok
    # A quote inside a JSON string is escaped, so the empty merge list's text occurs only as the model's key.
    if text.count(_NO_MERGES) != 1:
        raise PerfXError("the installed tokenizers package writes a BPE model's merges in a form PerfX does not "
                         "know; install tokenizers 0.20-0.23")
    quoted = json.JSONEncoder(ensure_ascii=False).encode
    slices = []
    for at in range(0, len(left_a), _MERGES_SLICE):
        pairs = zip(left_a[at : at + _MERGES_SLICE].tolist(), right_a[at : at + _MERGES_SLICE].tolist(), strict=True)
        slices.append(",".join(f"[{quoted(tokens[a])},{quoted(tokens[b])}]" for a, b in pairs))
    head, tail = text.split(_NO_MERGES)
    del text  # (a 262k-piece vocabulary's JSON is ~30 MB as a str: four bytes a character once one needs them)
    return f'{head}"merges":[{",".join(slices)}]{tail}'


def tokenizer_json_from_gguf(reader_fields: Mapping[str, Any]) -> str:
    """Serialized ``tokenizers`` JSON for the vocabulary in GGUF metadata.

    ``reader_fields``: key -> plain value (``gguf_header.GGUFFile.fields``).
    """
    model = reader_fields.get("tokenizer.ggml.model", "gpt2")
    tokens = reader_fields.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelFormatError("GGUF file has no tokenizer.ggml.tokens; use a model file that includes its vocabulary")
    types = reader_fields.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ModelFormatError("GGUF tokenizer.ggml.token_type length differs from the token list; the file is corrupt")
    try:
        return _build(reader_fields, str(model), tokens, types)
    except PerfXError:
        raise
    except ImportError as e:  # a broken install, not a corrupt file
        raise PerfXError(f"the '{e.name or 'tokenizers'}' package is missing; reinstall PerfX (pip install .)") from None
    except Exception as e:  # tokenizers raises plain Exception on inconsistent vocabularies
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelFormatError(f"GGUF vocabulary cannot form a tokenizer ({first}); the file is corrupt") from e


def _build(reader_fields: Mapping[str, Any], model: str, tokens: Sequence[str], types: Sequence[int]) -> str:
    if model == "gpt2":
        merges = reader_fields.get("tokenizer.ggml.merges") or []
        pre = reader_fields.get("tokenizer.ggml.pre") or "default"
        return _bpe_tokenizer(tokens, types, merges, str(pre)).to_str()
    if model == "llama":
        scores = reader_fields.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ModelFormatError("GGUF SentencePiece vocabulary lacks tokenizer.ggml.scores; the file is corrupt")
        unk = reader_fields.get("tokenizer.ggml.unknown_token_id")
        prefix = bool(reader_fields.get("tokenizer.ggml.add_space_prefix", True))
        return _spm_tokenizer_json(tokens, types, scores, prefix, int(unk) if unk is not None else None)
    raise UnsupportedModelError(f"GGUF tokenizer model '{model}' is not supported; PerfX handles 'gpt2' (BPE) and 'llama' (SentencePiece)")


def load_tokenizer(json_str: str) -> Any:
    """A ``tokenizers.Tokenizer`` from its JSON (as stored in ``ModelDescription.tokenizer_json``)."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(json_str)
    except Exception as e:  # tokenizers raises plain Exception for malformed JSON
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelFormatError(f"tokenizer JSON cannot be loaded ({first}); re-export the model") from e


class ChatTemplateError(PerfXError):
    """A chat template failed to render (bad template or messages it rejects)."""


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """Render a Hugging Face style Jinja chat template the way ``transformers`` does."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(f"chat template rejected the messages: {message}")

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(
            messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
            bos_token=bos_token, eos_token=eos_token, **extra,
        )
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the model's chat template failed: {e}; pass a raw prompt instead") from None
