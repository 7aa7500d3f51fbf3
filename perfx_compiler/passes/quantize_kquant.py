"""GGUF K-quant quantization of float weights (quantizations ``q4_k``, ``q5_k``, ``q6_k``): every linear weight
W [N, K] with K a multiple of 256 is quantized to GGUF Q4_K / Q5_K / Q6_K blocks exactly as llama.cpp's
reference quantizer does (``formats/ggml/q4_k.py``, ``q5_k.py``, ``q6_k.py``: ``quantize``, bit-identical blocks),
then unpacked and packed like a weight of that type read from a GGUF file (``gguf_passthrough``):
under int8 activations (x86 AVX-512 VNNI) in the VNNI layout (``formats/vnni.py``: Q4_K int4 row
pairs, Q5_K 5-bit row octets, Q6_K 6-bit row quads), under float activations (every other CPU target, or ``--activations
f32``) in the float-activation CPU layout (``formats/superblocks.py``: Q4_K int4 interleaved codes,
Q6_K int8 codes), each with the int8 sub-block scales (and mins) and the superblock's float16 d.
Any model format with float weights qualifies (Hugging Face folders, ONNX, F16/F32 GGUF).

Weights whose K is not a multiple of 256 become int8 groups of 32 (``q8``'s Q8_0-style format). On GPU
targets the blocks take the GPU layout a GGUF file's blocks take there (``subscaled_packed(gpu=True)``, the
GPU templates' superblock GEMVs).
"""

from __future__ import annotations

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
from perfx_compiler.passes._quantized_linears import current_activations, finalized, linear_weights, rewrite_linears
from perfx_compiler.passes.gguf_passthrough import gpu_target

NAME = "quantize_kquant"
SCHEMES = {"q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K"}  # quantization name -> ggml type
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


def apply(mod: tvm.IRModule, weights: dict[str, Any], ctx: Any) -> tuple[tvm.IRModule, dict[str, Any]]:
    quantization = getattr(ctx.options, "quantization", "f32") or "f32"
    if quantization not in SCHEMES:
        return mod, weights
    qtype = SCHEMES[quantization]
    gpu = gpu_target(ctx)
    raw_target = getattr(ctx.target, "raw", None) or {}  # GPU with int32 indices (WGSL): no 8-bit types
    words = gpu and raw_target.get("index_dtype") == "int32"
    vnni = current_activations() == "int8"
    quant, _ = linear_weights(mod, weights)
    names = sorted(quant)
    for name in names:
        k = int(np.shape(weights[name])[1])
        if k % SB and k % Q8_GROUP:
            raise PerfXError(f"quantization {quantization}: weight {name} has K={k}, neither a multiple of {SB} "
                             f"({qtype}) nor of {Q8_GROUP} (the int8 fallback); use q4_g128/g64/g32 or f32")
    show = bool(getattr(ctx.options, "progress", False)) and len(names) >= 32
    from perfx_compiler.progress import console

    packed = {}
    for name in tqdm(names, desc=f"quantize {qtype}", unit="weight", disable=not show, leave=False, file=console()):
        w = read_once(weights[name])
        if w.shape[1] % SB == 0:
            pk = kquant_packed(w, qtype, vnni, gpu, words)
        else:  # int8 groups of 32 (finalized takes them to the VNNI layout under int8 activations)
            pk = int8_packed(*quantize_int8(w, Q8_GROUP), Q8_GROUP, words)
        del w  # (a lazy float weight's float32 copy: one at a time)
        packed[name] = finalized(pk, ctx)
    return rewrite_linears(mod, weights, packed)
