"""Read a llama.cpp GGUF file into a ``ModelDescription``.

Weights are dequantized with the ``gguf`` package to float32 in the Hugging Face
layout; llama.cpp's Q/K row interleave (done by its converter for the llama
architecture, whose RoPE is GPT-J style) is undone so Q/K are in rotate-half
order. Q4_0/Q4_1/Q5_0/Q8_0 tensors and the superblock types of ``formats/ggml`` (K-quants, IQ4,
Q5_1; their scales checked finite at load) are also kept raw (memory-mapped) in
``ModelDescription.quantized`` for a passthrough pass; their Q/K rows are
un-permuted the same way (a row permutation moves whole quantized rows).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from perfx_compiler.errors import (
    ContextLengthError,
    ModelFormatError,
    UnsupportedModelError,
)
from perfx_compiler.formats.ggml import FORMATS as SUPERBLOCK_FORMATS
from perfx_compiler.formats.ggml import check_finite
from perfx_compiler.heap import drop_file_pages, trim_heap
from perfx_compiler.model.description import (
    ModelConfig,
    ModelDescription,
    rope_inv_freq,
)
from perfx_compiler.model.families import family_for_gguf_arch, gguf_archs
from perfx_compiler.model.families._family import GGUF_GLOBAL_NAMES, GGUF_LAYER_NAMES, GGUFMeta, qk_row_order, row_plan
from perfx_compiler.model.gguf_header import GGUFFile, GGUFTensor, read_gguf_header
from perfx_compiler.model.lazy import FLOAT_TYPES

# Types we read (each checked against an independent reference in tests).
SUPPORTED_GGML_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K",
    "IQ4_NL", "IQ4_XS",
)
# Types kept raw for the quantized-passthrough pass (formats/gguf_blocks.py, formats/ggml/), and
# which the lazy loader keeps instead of floats.
PASSTHROUGH_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", *sorted(SUPERBLOCK_FORMATS))
# Matrix types the lazy loader keeps as their mapped bytes: the block types and the float ones (model/lazy.py).
LAZY_TYPES = (*PASSTHROUGH_TYPES, *FLOAT_TYPES)

DEFAULT_MAX_CONTEXT = 2048
# chat end markers that also stop generation (ChatML, Llama 3, GPT-style, Gemma)
STOP_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<end_of_turn>")
# What numpy / the dequantizer raise on corrupt bytes (never shown to users as is).
READ_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, OSError, MemoryError, EOFError)


_BLK = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    """Canonical HF name of a llama.cpp tensor name (None when unknown)."""
    if gguf_name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[gguf_name]
    m = _BLK.match(gguf_name)
    if m and m.group(2) in GGUF_LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{GGUF_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp converter's permutation: HF rotate-half rows -> interleaved rows."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of ``permute_qk``: interleaved rows -> HF rotate-half rows (the row order the loader uses)."""
    order = qk_row_order(n_head, w.shape[0] // n_head, 0, "interleaved")
    return w[order]


class _Meta:
    """Typed access to GGUF metadata (plain values) with one-line errors."""

    def __init__(self, fields: Mapping[str, Any], source: str) -> None:
        self.fields = fields
        self.source = source

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def require(self, key: str) -> Any:
        v = self.get(key)
        if v is None:
            raise ModelFormatError(f"{self.source}: metadata '{key}' is missing; re-convert the model with llama.cpp")
        return v


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """The GGUF's metadata and tensor infos (``gguf_header.read_gguf_header``), every defect a one-line ModelFormatError."""
    p = Path(path)
    if not p.is_file():
        raise ModelFormatError(f"{p}: no such GGUF file; check the path")
    size = p.stat().st_size
    if size == 0:
        raise ModelFormatError(f"{p}: file is empty; re-download or re-convert the model")
    with open(p, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ModelFormatError(f"{p}: not a GGUF file (magic {magic!r}, expected b'GGUF'); pass a .gguf model file")
    reader = read_gguf_header(p)  # counts and lengths checked against the file's size
    _check_tensor_layout(reader, p)
    return reader


def _check_tensor_layout(reader: GGUFFile, p: Path) -> None:
    """llama.cpp's rule (gguf.cpp): tensors are stored back to back in the order of their infos, each
    padded to the alignment. A data offset that breaks it (a flipped byte: two tensors sharing bytes,
    one reading another's) or a size that does (a changed type or shape) is a corrupt file, refused
    as llama.cpp refuses it, not read as other weights."""
    align = reader.alignment
    expected = reader.data_offset
    for t in reader.tensors:
        if t.data_offset != expected:
            raise ModelFormatError(
                f"{p}: tensor '{t.name}' data is at byte {t.data_offset}, expected {expected} (after the previous "
                "tensor); the file is corrupt, re-download or re-convert the model"
            )
        expected += -(-t.n_bytes // align) * align


def dequantize_tensor(t: Any, source: str = "") -> np.ndarray:
    """Float32 array in numpy (HF) shape of a ``GGUFTensor`` (``data``, ``tensor_type``, GGML-order ``shape``)."""
    from gguf.quants import dequantize

    tname = t.tensor_type.name
    if tname not in SUPPORTED_GGML_TYPES:
        raise UnsupportedModelError(
            f"{source}: tensor '{t.name}' has ggml type {tname}, which PerfX cannot read; "
            f"use a model quantized as one of {', '.join(SUPPORTED_GGML_TYPES)}"
        )
    shape = tuple(int(d) for d in reversed(list(t.shape)))
    try:
        out = np.ascontiguousarray(dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32)
        if not out.flags.writeable:  # F32 tensors come back as read-only views of the mapped file
            out = out.copy()
        return out.reshape(shape)
    except READ_ERRORS as e:
        raise ModelFormatError(f"{source}: tensor '{t.name}' cannot be decoded ({e}); the file is corrupt") from None


def _llama3_scaling(rope_freqs: np.ndarray, base: ModelConfig, source: str) -> dict[str, Any]:
    """Recover HF llama3 rope_scaling parameters from llama.cpp's ``rope_freqs`` factors.

    llama.cpp stores the per-frequency divisors instead of the parameters; we try the
    usual parameter grid and keep the one that reproduces the stored factors.
    """
    factors = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    if factors.shape[0] != base.head_dim // 2:
        raise ModelFormatError(f"{source}: rope_freqs has {factors.shape[0]} entries, expected {base.head_dim // 2}")
    if np.allclose(factors, 1.0):
        return {}
    plain = rope_inv_freq(base)
    factor = float(factors.max())
    for orig in (8192, *(1 << k for k in range(4, 21) if k != 13)):  # the usual one first
        for low in (1.0, 2.0, 0.5):
            for high in (4.0, 2.0, 8.0, 1.0):
                if high <= low:
                    continue
                sc = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                      "high_freq_factor": high, "original_max_position_embeddings": orig}
                cfg = ModelConfig(**{**base.to_dict(), "rope_scaling": sc})
                if np.allclose(plain / rope_inv_freq(cfg), factors, rtol=1e-4, atol=1e-5):
                    return sc
    raise UnsupportedModelError(f"{source}: rope_freqs factors do not match llama3 RoPE scaling; this RoPE variant is unsupported")


def _special_ids(meta: _Meta, tokens: list[str]) -> tuple[int | None, list[int]]:
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = meta.get(key)
        if v is not None and int(v) not in eos and (not tokens or 0 <= int(v) < len(tokens)):
            eos.append(int(v))
    index = {t: i for i, t in enumerate(tokens)} if tokens else {}
    for t in STOP_TOKENS:
        if t in index and index[t] not in eos:
            eos.append(index[t])
    return (int(bos) if bos is not None else None), eos


def config_from_metadata(
    fields: Mapping[str, Any], tensors: Mapping[str, Any], source: str, max_context: int | None = None
) -> ModelConfig:
    """Build the ModelConfig from GGUF metadata (``tensors``: name -> GGUFTensor, for shapes)."""
    meta = _Meta(fields, source)
    arch = str(meta.require("general.architecture"))
    family = family_for_gguf_arch(arch)
    if family is None:
        raise UnsupportedModelError(
            f"{source}: GGUF architecture '{arch}' is not supported; PerfX reads {', '.join(gguf_archs())} GGUF models"
        )
    hidden = int(meta.require(f"{arch}.embedding_length"))
    heads = int(meta.require(f"{arch}.attention.head_count"))
    if heads < 1:  # divides below; ModelConfig checks every other count
        raise ModelFormatError(f"{source}: metadata '{arch}.attention.head_count' is {heads}; the file is corrupt")
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    # not rope.dimension_count: with partial rotary (Phi-4-mini, GLM) RoPE covers part of each head
    head_dim = int(meta.get(f"{arch}.attention.key_length", 0) or hidden // heads)
    tokens = meta.get("tokenizer.ggml.tokens") or []
    emb = tensors.get("token_embd.weight")
    if emb is None:
        raise ModelFormatError(f"{source}: tensor 'token_embd.weight' is missing; the file is incomplete")
    if int(emb.shape[0]) != hidden:  # llama.cpp's shape check; a corrupt width would size the Q/K row orders
        raise ModelFormatError(f"{source}: metadata '{arch}.embedding_length' is {hidden}, but 'token_embd.weight' "
                               f"has rows of {int(emb.shape[0])}; the file is corrupt")
    vocab = int(meta.get(f"{arch}.vocab_size", 0) or int(emb.shape[1]))
    ctx = int(meta.get(f"{arch}.context_length", DEFAULT_MAX_CONTEXT))
    if max_context is None:
        max_ctx = min(ctx, DEFAULT_MAX_CONTEXT)
    elif max_context < 1 or max_context > ctx:
        raise ContextLengthError(f"max_context={max_context} is outside the model's trained context 1..{ctx}; pick a value in that range")
    else:
        max_ctx = int(max_context)
    bos, eos = _special_ids(meta, tokens)
    tok_model = meta.get("tokenizer.ggml.model")
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:  # llama.cpp's defaults: SentencePiece and llama3-style BPE add BOS
        add_bos = tok_model == "llama" or meta.get("tokenizer.ggml.pre") in ("llama3", "llama-bpe", "llama-v3")
    name = meta.get("general.name") or meta.get("general.basename") or Path(source).stem
    fields = dict(
        architecture=family.name,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(meta.require(f"{arch}.feed_forward_length")),
        num_layers=int(meta.require(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        max_context=max_ctx,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=bos,
        eos_token_ids=eos,
        add_bos_token=bool(add_bos),
        name=str(name),
    )
    fields.update(family.gguf_features(GGUFMeta(meta.get, arch)))
    cfg = ModelConfig(**fields)
    if "rope_factors_long.weight" in tensors:
        raise UnsupportedModelError(f"{source}: LongRoPE scaling (rope_factors_long) is not supported; use a 4k-context variant")
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind == "linear":
        cfg.rope_scaling = {"rope_type": "linear", "factor": float(meta.require(f"{arch}.rope.scaling.factor"))}
    elif kind not in (None, "none"):
        raise UnsupportedModelError(f"{source}: rope scaling '{kind}' is not supported (linear, llama3 are)")
    if "rope_freqs.weight" in tensors:
        sc = _llama3_scaling(dequantize_tensor(tensors["rope_freqs.weight"], source), cfg, source)
        cfg.rope_scaling = sc or cfg.rope_scaling
    return cfg


# Above this many bytes of float32 matrices (of LAZY_TYPES) the loader keeps them lazy (see lazy.py),
# which every real model is: eagerly Gemma 3 270M Q4_K_M (253 MB) compiled in a 4.0 GB peak, SmolLM2 Q4_1
# in 1.5 GB. Below it (the tests' tiny models) the eager path's check of every packed weight against
# gguf-py's floats is cheap enough to keep.
LAZY_FLOAT_BYTES = 64 << 20


def _want_lazy(tensors: Mapping[str, GGUFTensor], lazy: bool | None) -> bool:
    """``lazy`` as given; None: the env var PERFX_LAZY_WEIGHTS (0/1), else lazy above LAZY_FLOAT_BYTES."""
    if lazy is not None:
        return lazy
    env = os.environ.get("PERFX_LAZY_WEIGHTS", "").strip()
    if env in ("0", "1"):
        return env == "1"
    floats = sum(4 * int(np.prod(t.shape)) for t in tensors.values()
                 if t.tensor_type.name in LAZY_TYPES and len(t.shape) == 2)
    return floats > LAZY_FLOAT_BYTES


def load_gguf(
    path: str | os.PathLike[str], max_context: int | None = None, lazy: bool | None = None
) -> ModelDescription:
    """Load a llama/qwen2 GGUF file: config, float32 HF-layout weights, tokenizer, chat template.

    ``lazy``: matrices of a block or float type become ``lazy.QuantizedWeight`` (the mapped bytes, no
    float32 copy); None decides by size (``_want_lazy``)."""
    from perfx_compiler.model.lazy import QuantizedWeight
    from perfx_compiler.model.tokenizer import tokenizer_json_from_gguf

    source = str(path)
    reader = open_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    try:
        cfg = config_from_metadata(reader.fields, tensors, source, max_context)
    except (ValueError, TypeError, ArithmeticError) as e:  # e.g. a string where a count belongs, an infinite float
        raise ModelFormatError(f"{source}: malformed model metadata ({e}); re-convert the model") from None
    family = family_for_gguf_arch(str(reader.fields["general.architecture"]))
    layout = family.gguf_rope_layout

    weights: dict[str, Any] = {}
    quantized: dict[str, Any] = {}
    keep_lazy = _want_lazy(tensors, lazy)
    for gname, t in tensors.items():
        if gname == "rope_freqs.weight":
            continue  # folded into cfg.rope_scaling
        name = hf_name(gname)
        if name is None:
            raise UnsupportedModelError(f"{source}: tensor '{gname}' is not part of a {cfg.architecture} model PerfX understands")
        qtype = t.tensor_type.name
        raw = np.asarray(t.data) if qtype in PASSTHROUGH_TYPES else None
        shape = tuple(reversed(t.shape))
        if qtype in SUPERBLOCK_FORMATS and len(shape) == 2:
            check_finite(qtype, raw, shape, f"{source}: {gname}")  # one clear line for corrupt blocks
            drop_file_pages(raw)  # the scan read every block: the pages need not stay until packing
        if keep_lazy and qtype in LAZY_TYPES and raw is None and len(shape) == 2:
            raw = np.asarray(t.data).view(np.uint8)  # a float matrix's rows as bytes: [N, K * element bytes]
        lazy_here = keep_lazy and raw is not None and len(shape) == 2
        if lazy_here and (raw.ndim != 2 or raw.shape[0] != shape[0]):  # type: ignore[union-attr]
            raise ModelFormatError(f"{source}: tensor '{gname}' ({qtype}) has {raw.shape} bytes for shape {shape}; the file is corrupt")  # type: ignore[union-attr]
        w = None if lazy_here else dequantize_tensor(t, source)
        plan = row_plan(name, shape[0] if shape else 0, cfg, layout)
        for part, rows, order in plan:
            n_rows = len(range(*rows.indices(shape[0]))) if shape else 0
            if order is not None and n_rows != len(order):
                raise ModelFormatError(f"{source}: tensor '{gname}' has {n_rows} rows, expected {len(order)} for its heads")
            part_shape = (n_rows, *shape[1:]) if shape else shape
            if lazy_here:
                release = functools.partial(drop_file_pages, raw) if len(plan) == 1 else None
                lw = QuantizedWeight(qtype, [raw[rows]], part_shape, [order], [release])  # type: ignore[index]
                weights[part] = lw
                if qtype in PASSTHROUGH_TYPES:
                    quantized[part] = (qtype, lw, part_shape)  # the blocks live in the weight (passthrough reads them there)
                continue
            wp = w[rows] if len(plan) > 1 else w  # type: ignore[index]
            rp = raw[rows] if raw is not None and len(plan) > 1 else raw
            if order is not None:
                wp = wp[order]
                rp = rp[order] if rp is not None else None
            weights[part] = wp
            if rp is not None:
                quantized[part] = (qtype, rp, part_shape)

    tok_json = None
    if "tokenizer.ggml.tokens" in reader.fields:
        tok_json = tokenizer_json_from_gguf(reader.fields)
    template = _Meta(reader.fields, source).get("tokenizer.chat_template") or family.chat_template
    desc = ModelDescription(
        config=cfg, weights=weights, tokenizer_json=tok_json,
        chat_template=str(template) if template else None, source=source, quantized=quantized,
    )
    desc.validate()
    trim_heap()  # building a large vocabulary's tokenizer freed ~200 MB that the compile would otherwise keep
    return desc
