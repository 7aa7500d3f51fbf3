"""Tiny random-weight GGUF models for tests and benchmarks.

``write_tiny_gguf`` writes a file the way llama.cpp's converter does (Q/K rows
permuted for llama, optional quantization, byte-level BPE vocab with real
merges and ChatML specials), so ``load_gguf`` has to undo everything itself.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from perfx_compiler.model.description import (
    ModelConfig,
    expected_weight_shapes,
    rope_inv_freq,
)
from perfx_compiler.model.families import FAMILIES
from perfx_compiler.model.families._family import GGUF_GLOBAL_NAMES, GGUF_LAYER_NAMES
from perfx_compiler.model.gguf import permute_qk, unpermute_qk

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# A few English merges (byte-level spelling: 'Ġ' is a space) so BPE does real work.
MERGES = (
    "Ġ t", "e l", "el l", "ell o", "Ġ h", "Ġh ello", "h e", "Ġt he", "i n", "Ġ a", "o n", "e r", "Ġ w", "a s",
    "Ġw as", "Ġ o", "r e", "a n", "Ġ i", "Ġ s", "i s", "Ġi s", "O n", "On c", "Onc e",
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# K-quants: gguf cannot quantize them, so we write random valid super-blocks instead.
_K_TYPES = ("Q4_K", "Q5_K", "Q6_K")


@lru_cache(maxsize=1)
def byte_level_alphabet() -> list[str]:
    """GPT-2's byte -> printable unicode map, as a list indexed by byte value."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs, strict=True))
    return [chr(table[b]) for b in range(256)]


def tiny_vocab(vocab: int | None = None) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): ChatML specials, 256 bytes, merge results, then unused padding."""
    tokens = list(SPECIAL_TOKENS) + byte_level_alphabet()
    types = [3] * len(SPECIAL_TOKENS) + [1] * 256
    for m in MERGES:
        merged = m.replace(" ", "")
        if merged not in tokens:
            tokens.append(merged)
            types.append(1)
    if vocab is not None:
        if vocab < len(tokens):
            raise ValueError(f"vocab={vocab} is below the tiny vocabulary's {len(tokens)} tokens")
        for i in range(vocab - len(tokens)):
            tokens.append(f"<unused_{i}>")
            types.append(3)
    return tokens, types, list(MERGES)


def _gguf_name(hf: str) -> str:
    for g, h in GGUF_GLOBAL_NAMES.items():
        if h == hf:
            return g
    _, _, idx, rest = hf.split(".", 3)
    module, _, kind = rest.rpartition(".")
    for g, h in GGUF_LAYER_NAMES.items():
        if h == module:
            return f"blk.{idx}.{g}.{kind}"
    raise KeyError(hf)


def _random_k_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: str) -> np.ndarray:
    """Random raw K-quant super-blocks with small finite f16 scales."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    qt = GGMLQuantizationType[qtype]
    block, size = GGML_QUANT_SIZES[qt]
    if cols % block:
        raise ValueError(f"{qtype} needs every row length to be a multiple of {block}; got {cols}")
    nb = rows * cols // block
    raw = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    scale = (rng.random((nb, 2)) * 0.01).astype(np.float16).view(np.uint8)
    if qtype == "Q6_K":  # layout: ql[128] qh[64] scales[16] d(f16)
        raw[:, 208:210] = scale[:, :2]
    else:  # Q4_K / Q5_K: d, dmin (f16) first
        raw[:, 0:4] = scale
    return raw.reshape(rows, cols // block * size)


def _encode(w: np.ndarray, qtype: str, rng: np.random.Generator) -> tuple[np.ndarray, Any]:
    """(array to write, raw ggml type) for a float weight in numpy [out, in] layout."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    qt = GGMLQuantizationType[qtype]
    if qtype == "F32":
        return w.astype(np.float32), None
    if qtype == "F16":
        return w.astype(np.float16), None
    if qtype in _K_TYPES:
        return _random_k_blocks(rng, w.shape[0], w.shape[1], qtype), qt
    return quantize(w.astype(np.float32), qt), qt


def add_tiny_tokenizer(w: Any, tokens: list[str], types: list[int], merges: list[str], pre: str) -> None:
    """The tokenizer metadata of the tiny test models (``tiny_vocab``'s byte-level BPE, ChatML
    template, BOS <|im_start|> = 1, EOS <|im_end|> = 2, no BOS added) on a ``gguf.GGUFWriter``."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)


def write_tiny_gguf(
    path: str | os.PathLike[str],
    *,
    arch: str = "llama",
    vocab: int | None = None,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    qtype: str = "F32",
    tied: bool = True,
    seed: int = 0,
    with_bias: bool = False,
    context_length: int = 4096,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    pre: str | None = None,
    embed_qtype: str | None = None,
) -> tuple[Path, dict[str, np.ndarray]]:
    """Write a random-weight GGUF; return (path, the float32 HF-layout weights load_gguf must give).

    ``qtype`` applies to 2-D matrices (the embedding too unless ``embed_qtype``);
    norms and biases stay F32 as in llama.cpp files. Returned weights are the
    dequantized values, so tests can compare exactly.
    """
    import gguf
    from gguf.quants import dequantize

    rng = np.random.default_rng(seed)
    tokens, types, merges = tiny_vocab(vocab)
    head_dim = hidden // heads
    cfg = ModelConfig(
        architecture=arch, vocab_size=len(tokens), hidden_size=hidden, intermediate_size=ffn, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, tie_word_embeddings=tied, attention_bias=with_bias,
        rope_theta=rope_theta, rope_scaling=rope_scaling,
    )
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(context_length)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(len(tokens))
    kind = (rope_scaling or {}).get("rope_type")
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope_scaling["factor"]))  # type: ignore[index]
    add_tiny_tokenizer(w, tokens, types, merges, pre or ("qwen2" if arch == "qwen2" else "smollm"))

    expected: dict[str, np.ndarray] = {}
    for name, shape in expected_weight_shapes(cfg).items():
        if len(shape) == 1:
            mean = 1.0 if name.endswith("norm.weight") else 0.0
            f, q = (mean + 0.1 * rng.standard_normal(shape)).astype(np.float32), "F32"
        else:
            f = (0.05 * rng.standard_normal(shape)).astype(np.float32)
            q = embed_qtype if (embed_qtype and name == "model.embed_tokens.weight") else qtype
        n_perm = None
        if FAMILIES[arch].gguf_rope_layout == "interleaved" and (".q_proj." in name or ".k_proj." in name):
            n_perm = heads if ".q_proj." in name else kv_heads
            f = permute_qk(f, n_perm)  # llama.cpp's converter layout
        arr, raw_type = _encode(f, q, rng)
        back = np.asarray(dequantize(arr, gguf.GGMLQuantizationType[q]), dtype=np.float32).reshape(shape)
        if n_perm is not None:
            back = unpermute_qk(back, n_perm)
        expected[name] = back
        w.add_tensor(_gguf_name(name), arr, raw_dtype=raw_type)
    if kind == "llama3":
        base = ModelConfig(**{**cfg.to_dict(), "rope_scaling": None})
        factors = (rope_inv_freq(base) / rope_inv_freq(cfg)).astype(np.float32)
        w.add_tensor("rope_freqs.weight", factors)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, expected
