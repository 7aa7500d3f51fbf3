"""GGUF K-quant quantization of float weights (quantization ``q4_k``): every linear weight W [N, K]
with K a multiple of 256 is quantized to GGUF Q4_K blocks exactly as llama.cpp's reference
quantizer does (``formats/ggml/q4_k.py: quantize``, bit-identical blocks), then unpacked and packed
for the x86 VNNI kernels like a Q4_K weight read from a GGUF file (``gguf_passthrough``): int4 codes
in row pairs, int8 6-bit sub-block scales and mins times the superblock's float16 d / dmin.
Any model format with float weights qualifies (Hugging Face folders, ONNX, F16/F32 GGUF).

Weights whose K is not a multiple of 256 become int8 groups of 32 (``q8``'s Q8_0-style format).
The Q4_K kernels exist only under int8 activations (AVX-512 VNNI): elsewhere this is a one-line error.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tvm
from tqdm import tqdm

from perfx_compiler.errors import PerfXError
from perfx_compiler.formats import ggml
from perfx_compiler.formats.ggml import q4_k
from perfx_compiler.formats.int8 import int8_packed, quantize_int8
from perfx_compiler.formats.vnni import subscaled_vnni_packed
from perfx_compiler.passes._quantized_linears import current_activations, linear_weights, rewrite_linears

NAME = "quantize_kquant"
SCHEMES = ("q4_k",)
SB = 256  # weights per superblock
Q8_GROUP = 32


def q4_k_packed(w: np.ndarray) -> Any:
    """float32 [N, K] (K % 256 == 0) -> the VNNI Packed of its Q4_K blocks."""
    shape = (int(w.shape[0]), int(w.shape[1]))
    return subscaled_vnni_packed(ggml.unpack("Q4_K", q4_k.quantize(w), shape), "Q4_K")


def apply(mod: tvm.IRModule, weights: dict[str, Any], ctx: Any) -> tuple[tvm.IRModule, dict[str, Any]]:
    quantization = getattr(ctx.options, "quantization", "f32") or "f32"
    if quantization not in SCHEMES:
        return mod, weights
    if current_activations() != "int8":
        raise PerfXError(f"quantization {quantization} runs on x86 CPUs with AVX-512 VNNI in this version "
                         "(int8 activations); use q4_g128 or q8 here")
    quant, _ = linear_weights(mod, weights)
    names = sorted(quant)
    for name in names:
        k = int(np.shape(weights[name])[1])
        if k % SB and k % Q8_GROUP:
            raise PerfXError(f"quantization {quantization}: weight {name} has K={k}, neither a multiple of {SB} "
                             f"(Q4_K) nor of {Q8_GROUP} (the int8 fallback); use q4_g128/g64/g32 or f32")
    show = bool(getattr(ctx.options, "progress", False)) and len(names) >= 32
    from perfx_compiler.progress import console

    packed = {}
    for name in tqdm(names, desc="quantize Q4_K", unit="weight", disable=not show, leave=False, file=console()):
        w = np.asarray(weights[name], dtype=np.float32)
        if w.shape[1] % SB == 0:
            packed[name] = q4_k_packed(w)
        else:  # rewrite_linears takes it to the VNNI layout
            packed[name] = int8_packed(*quantize_int8(w, Q8_GROUP), Q8_GROUP)
    return rewrite_linears(mod, weights, packed)
