"""Weight-only int8 quantization of every linear layer (quantization ``q8`` = symmetric groups of
32, as llama.cpp's Q8_0; ``q8_g64`` / ``q8_g128``): W [N, K] becomes ``<W>_q8`` (int8 [N, K]) and
``<W>_q8_scale`` (float16 [N, K/G]); linears run the fused int8 GEMV of
``schedules/gemv_int8_cpu.py`` in decode and dequantize + float GEMM in prefill. The group size
must divide every K (one-line error otherwise).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import tvm

from perfx_compiler.formats.int8 import check_group, int8_packed, quantize_int8
from perfx_compiler.model.lazy import read_once
from perfx_compiler.passes._quantized_linears import finalized, packed_weights, rewrite_linears

NAME = "quantize_int8"
_Q8 = re.compile(r"^q8(?:_g(32|64|128))?$")


def parse(quantization: str) -> int | None:
    """Group size of a q8 scheme name, None for other schemes."""
    m = _Q8.match(quantization)
    if not m:
        return None
    return int(m.group(1) or 32)


def apply(mod: tvm.IRModule, weights: dict[str, Any], ctx: Any) -> tuple[tvm.IRModule, dict[str, Any]]:
    group = parse(getattr(ctx.options, "quantization", "f32") or "f32")
    if group is None:
        return mod, weights
    quant = packed_weights(mod, weights)
    for name in quant:
        check_group(int(np.shape(weights[name])[1]), group, getattr(ctx.options, "quantization", "q8"))
    raw_target = getattr(ctx.target, "raw", None) or {}  # GPU with int32 indices (WGSL): no 8-bit types
    words = getattr(ctx.target, "family", "") == "gpu" and raw_target.get("index_dtype") == "int32"
    packed = {
        n: finalized(int8_packed(*quantize_int8(read_once(weights[n]), group), group, words), ctx)
        for n in quant
    }
    return rewrite_linears(mod, weights, packed)
