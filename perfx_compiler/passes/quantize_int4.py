"""Weight-only int4 group quantization of every linear layer (``CompileOptions.quantization``).

``q4_g128`` / ``q4_g64`` / ``q4_g32``: asymmetric (scale + zero point per group of G input
columns); ``q4_sym_g128`` (also g64/g32): symmetric. Each weight W [N, K] becomes three
parameters at its position in the weight table: ``<W>_q4`` (uint32 codes, interleaved layout of
``formats.int4.py``), ``<W>_q4_scale`` (fp16) and ``<W>_q4_zero`` (uint8). Each linear
``matmul(x, permute_dims(W)) [+ b]`` becomes one call of a dequantize+matmul PrimFunc (opaque to
FuseOps) that ``schedules/gemv_int4_cpu.py`` replaces by its GEMV kernel. Many-row linears
(prefill, M symbolic) become ``dequantize -> float matmul``: the GEMM template then runs at fp32
speed and the dequantized scratch is reused from layer to layer. A tied embedding is gathered straight from the packed table, so no
float copy of it remains.
"""

from __future__ import annotations

import re
from typing import Any

import tvm

from perfx_compiler.errors import PerfXError
from perfx_compiler.formats.int4 import Int4Format, int4_packed, quantize_int4, words_target
from perfx_compiler.model.lazy import read_once
from perfx_compiler.passes._quantized_linears import GEMV_MAX_ROWS, finalized, packed_weights, rewrite_linears
from perfx_compiler.passes.quantize_kquant import SCHEMES as KQUANT_SCHEMES

NAME = "quantize_int4"

# Schemes other passes implement (gguf_passthrough, quantize_int8, awq, quantize_kquant): not int4 RTN, but valid names.
OTHER = ("f32", "f16", "bf16", "gguf", "onnx", "q8", "q8_g32", "q8_g64", "q8_g128", "q4_awq_g128", "q4_awq_g64", "q4_awq_g32",
         *KQUANT_SCHEMES)
INT4 = ("q4_g128", "q4_g64", "q4_g32", "q4_sym_g128", "q4_sym_g64", "q4_sym_g32")
NOT_YET: tuple[str, ...] = ()  # planned schemes: refuse rather than silently compile f32
KNOWN = OTHER
__all__ = ["GEMV_MAX_ROWS", "parse", "quantize_linears", "apply"]
_Q4 = re.compile(r"^q4_(sym_)?g(32|64|128)$")


def parse(quantization: str) -> Int4Format | None:
    """The int4 format a quantization name asks for; None for non-int4 schemes; error if unknown."""
    m = _Q4.match(quantization)
    if m:
        return Int4Format(group=int(m.group(2)), symmetric=bool(m.group(1)))
    if quantization in KNOWN:
        return None
    if quantization in NOT_YET:
        raise PerfXError(f"quantization '{quantization}' is not implemented yet; use f32, gguf, q8 or q4_g128/g64/g32")
    plain = [n for n in OTHER if n not in KQUANT_SCHEMES and not n.startswith("q4_")]
    names = ["auto", *plain, *INT4, *(n for n in OTHER if n.startswith("q4_awq")), *KQUANT_SCHEMES]
    raise PerfXError(f"unknown quantization '{quantization}'; use one of {', '.join(names)}")


def quantize_linears(
    mod: tvm.IRModule, weights: dict[str, Any], fmt: Int4Format, ctx: Any, prepare: Any = None
) -> tuple[tvm.IRModule, dict[str, Any]]:
    """The pass body, reusable by AWQ (``prepare(name, W) -> W'`` adjusts a weight first)."""
    words = words_target(ctx.target)  # zero points as uint32 words
    packed = {}
    for name in sorted(packed_weights(mod, weights)):
        w = read_once(weights[name])
        if prepare is not None:
            w = prepare(name, w)
        fmt.lanes(w.shape[1])  # one-line error when K does not suit the packing
        packed[name] = finalized(int4_packed(*quantize_int4(w, fmt), fmt, words=words), ctx)
    return rewrite_linears(mod, weights, packed)


def apply(mod: tvm.IRModule, weights: dict[str, Any], ctx: Any) -> tuple[tvm.IRModule, dict[str, Any]]:
    quantization = getattr(ctx.options, "quantization", "f32") or "f32"
    fmt = parse(quantization)
    if fmt is None:
        return mod, weights
    return quantize_linears(mod, weights, fmt, ctx)
