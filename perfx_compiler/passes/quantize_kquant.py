"""GGUF K-quant quantization of float weights (quantizations ``q4_k``, ``q5_k``, ``q6_k``, and llama.cpp's mixes
``q4_k_m`` / ``q5_k_m``, which give the output projection and some layers' attn_v / ffn_down Q6_K: ``weight_types``):
every linear weight W [N, K] with K a multiple of 256 is quantized to GGUF Q4_K / Q5_K / Q6_K blocks exactly as llama.cpp's
reference quantizer does (``formats/ggml/q4_k.py``, ``q5_k.py``, ``q6_k.py``: ``quantize``, bit-identical blocks),
then unpacked and packed like a weight of that type read from a GGUF file (``gguf_passthrough``):
under int8 activations (x86 AVX-512 VNNI) in the VNNI layout (``formats/vnni.py``: Q4_K int4 row
pairs, Q5_K 5-bit row octets, Q6_K 6-bit row quads), under float activations (every other CPU target, or ``--activations
f32``) in the float-activation CPU layout (``formats/superblocks.py``: Q4_K int4 interleaved codes,
Q6_K int8 codes), each with the int8 sub-block scales (and mins) and the superblock's float16 d.
Any model format with float weights qualifies (Hugging Face folders, ONNX, F16/F32 GGUF).

An untied embedding (only gathered) becomes blocks of the base type too, as in llama.cpp's files; its rows are
dequantized as they are gathered. Weights whose K is not a multiple of 256 become int8 groups of 32 (``q8``'s Q8_0-style format). On GPU
targets the blocks take the GPU layout a GGUF file's blocks take there (``subscaled_packed(gpu=True)``, the
GPU templates' superblock GEMVs).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import numpy as np
import tvm
from tqdm import tqdm

from perfx_compiler.errors import PerfXError
from perfx_compiler.formats import ggml
from perfx_compiler.formats.ggml import q4_k, q5_k, q6_k
from perfx_compiler.formats.int8 import int8_packed, quantize_int8
from perfx_compiler.formats.superblocks import subscaled_packed
from perfx_compiler.formats.vnni import subscaled_vnni_packed
from perfx_compiler.model.lazy import read_once
from perfx_compiler.passes._quantized_linears import current_activations, finalized, packed_weights, rewrite_linears
from perfx_compiler.passes.gguf_passthrough import gpu_target

NAME = "quantize_kquant"
# quantization name -> ggml type (of every linear; the _m mixes' base type, see weight_types)
SCHEMES = {"q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K", "q4_k_m": "Q4_K", "q5_k_m": "Q5_K"}
MIXES = ("q4_k_m", "q5_k_m")  # llama.cpp's Q4_K_M / Q5_K_M recipes
_MORE_BITS_ROLES = re.compile(r"^model_layers_(\d+)_(?:self_attn_v_proj|mlp_down_proj)_weight$")
_LAYER = re.compile(r"^model_layers_(\d+)_")
EMBEDDING = "model_embed_tokens_weight"
QUANTIZE = {"Q4_K": q4_k.quantize, "Q5_K": q5_k.quantize, "Q6_K": q6_k.quantize}  # float32 [N, K] -> raw blocks
SB = 256  # weights per superblock
Q8_GROUP = 32


def kquant_packed(w: np.ndarray, qtype: str = "Q4_K", vnni: bool = True, gpu: bool = False,
                  words: bool = False) -> Any:
    """float32 [N, K] (K % 256 == 0) -> the Packed of its ``qtype`` blocks: the VNNI layout (int8
    activations), the float-activation CPU layout, or on a GPU target (``gpu``) the GPU layout the GGUF
    passthrough gives a file's blocks (``words``: every 8-bit array as uint32 words, WGSL); no ``.vnni``
    kept outside the VNNI layout (its closure would hold the unpacked codes)."""
    shape = (int(w.shape[0]), int(w.shape[1]))
    sub = ggml.unpack(qtype, QUANTIZE[qtype](w), shape)
    if vnni and not gpu:
        return subscaled_vnni_packed(sub, qtype)
    pk = subscaled_packed(sub, qtype, gpu=gpu, words=words)
    pk.vnni = None
    return pk


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third layer between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def weight_types(names: Iterable[str], quantization: str) -> dict[str, str]:
    """Relax weight name -> the ggml type ``quantization`` makes of that weight (when it is a linear's): the
    scheme's one type, or for the mixes llama.cpp's recipe (llama_tensor_get_type for Q4_K_M / Q5_K_M): Q6_K
    for the output projection, and for attn_v and ffn_down in the layers ``use_more_bits`` picks; the base type
    elsewhere. ``merge_projections`` reads this table, so Q/K/V stay apart where V takes Q6_K (as a llama.cpp
    Q4_K_M file's do). Empty for other quantizations."""
    base = SCHEMES.get(quantization)
    if base is None:
        return {}
    names = list(names)
    if quantization not in MIXES:
        return dict.fromkeys(names, base)
    layers = 1 + max((int(m.group(1)) for n in names if (m := _LAYER.match(n))), default=-1)
    output = "lm_head_weight" if "lm_head_weight" in names else EMBEDDING  # tied: the embedding is the output
    types = {}
    for name in names:
        m = _MORE_BITS_ROLES.match(name)
        more = name == output or (m is not None and use_more_bits(int(m.group(1)), layers))
        types[name] = "Q6_K" if more else base
    return types


def apply(mod: tvm.IRModule, weights: dict[str, Any], ctx: Any) -> tuple[tvm.IRModule, dict[str, Any]]:
    quantization = getattr(ctx.options, "quantization", "f32") or "f32"
    if quantization not in SCHEMES:
        return mod, weights
    types = weight_types(weights, quantization)
    gpu = gpu_target(ctx)
    raw_target = getattr(ctx.target, "raw", None) or {}  # GPU with int32 indices (WGSL): no 8-bit types
    words = gpu and raw_target.get("index_dtype") == "int32"
    vnni = current_activations() == "int8"
    names = sorted(packed_weights(mod, weights))  # (an untied embedding: the base type, as in llama.cpp's files)
    for name in names:
        k = int(np.shape(weights[name])[1])
        if k % SB and k % Q8_GROUP:
            raise PerfXError(f"quantization {quantization}: weight {name} has K={k}, neither a multiple of {SB} "
                             f"({types[name]}) nor of {Q8_GROUP} (the int8 fallback); use q4_g128/g64/g32 or f32")
    show = bool(getattr(ctx.options, "progress", False)) and len(names) >= 32
    from perfx_compiler.progress import console

    packed = {}
    for name in tqdm(names, desc=f"quantize {quantization}", unit="weight", disable=not show, leave=False,
                     file=console()):
        w = read_once(weights[name])
        if w.shape[1] % SB == 0:
            pk = kquant_packed(w, types[name], vnni, gpu, words)
        else:  # int8 groups of 32 (finalized takes them to the VNNI layout under int8 activations)
            pk = int8_packed(*quantize_int8(w, Q8_GROUP), Q8_GROUP, words)
        del w  # (a lazy float weight's float32 copy: one at a time)
        packed[name] = finalized(pk, ctx)
    return rewrite_linears(mod, weights, packed)
