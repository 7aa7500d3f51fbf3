"""Half-precision weights (quantization ``f16`` / ``bf16``): every weight a linear reads, and an
embedding that is only gathered, is stored as float16 or bfloat16 (uint16 bit patterns, round to
nearest even): 2 bytes per parameter. Linears become kernels tagged ``perfx.quant`` (bits = 16)
through the shared quantized-linear rewriter: a GEMV that widens each weight vector to fp32 in
registers (decode, ``schedules/gemv_half_cpu.py``), widen-to-fp32 + float GEMM (prefill) and a
gather that widens the table's rows. ``--precision bf16`` / ``f16`` also rounds each matmul input
to that format (see ``precision.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tvm

from perfx_compiler.formats.half import FAMILIES, half_packed
from perfx_compiler.passes._quantized_linears import linear_weights, rewrite_linears

NAME = "cast_weights"


def apply(mod: tvm.IRModule, weights: dict[str, Any], ctx: Any) -> tuple[tvm.IRModule, dict[str, Any]]:
    family = getattr(ctx.options, "quantization", "f32") or "f32"
    if family not in FAMILIES:
        return mod, weights
    act = getattr(ctx.options, "precision", "f32") or "f32"
    names, uses = linear_weights(mod, weights)
    # an untied embedding is only gathered: its rows come from the half table too (no float copy)
    names |= {n for n, u in uses.items() if "take" in u and "other" not in u}
    packed = {n: half_packed(np.asarray(weights[n], dtype=np.float32), family, act) for n in sorted(names)}
    return rewrite_linears(mod, weights, packed)
