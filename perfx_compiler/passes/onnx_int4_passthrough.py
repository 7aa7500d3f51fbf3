"""ONNX int4 passthrough (quantization ``onnx``): linears of an imported onnxruntime-genai model read
its ``MatMulNBits`` int4 blocks as they are, on PerfX's own int4 kernels (``perfx.quant``-tagged,
the ones ``quantize_int4`` and ``gguf_passthrough`` produce), never dequantized and requantized.

The foreign-ONNX reader (``model/foreign_onnx/graph_to_description``) keeps each int4 weight's codes, scales and zero
points in ``ModelDescription.quantized`` as an ``NBitsTable`` (type ``MatMulNBits``; Q/K rows in
Hugging Face order, a packed QKV already split). Here each becomes ``int4_packed(codes, scale,
zero, Int4Format(block_size, symmetric=no zero points))``:

* codes: copied bit for bit (unpacked nibbles repacked into the kernels' layout);
* zero points: the file's packed uint8 zero points, or 8 when it has none (symmetric);
* scales: the kernels hold float16 scales; the file's float32 scales are rounded to float16
  (relative change <= 2^-11). A weight whose scales do not survive that (outside float16's normal
  range) stays float32.

Merged projections (QKV, gate+up) concatenate their members' tables by rows when the block sizes
agree (a symmetric member joins an asymmetric one with explicit zero points 8). Each packed
weight is checked against the float weight the graph was built from (the same table,
dequantized); a mismatch is an internal error, never a silent change of the model.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tvm

from perfx_compiler.errors import PerfXError
from perfx_compiler.formats import Packed
from perfx_compiler.formats.int4 import Int4Format, int4_packed, words_target
from perfx_compiler.model.foreign_onnx.nbits import NBitsTable
from perfx_compiler.passes._quantized_linears import linear_weights, rewrite_linears
from perfx_compiler.passes.merge_projections import complete_groups

NAME = "onnx_int4_passthrough"
QUANTIZATION = "onnx"
QTYPE = "MatMulNBits"
FP16_NORMAL_MIN = float(np.finfo(np.float16).tiny)
FP16_MAX = float(np.finfo(np.float16).max)


def int4_tables(desc: Any) -> dict[str, NBitsTable]:
    """Relax weight name -> int4 table, merged groups included (their members' rows concatenated)."""
    out = {n.replace(".", "_"): t for n, (q, t, _) in desc.quantized.items()
           if q == QTYPE and isinstance(t, NBitsTable) and t.bits == 4}
    for prefix, merged, members in complete_groups(out):
        parts = [out[f"{prefix}{s}_weight"] for s in members]
        if len({p.block for p in parts}) != 1:
            continue
        zeros = None
        if any(p.zeros is not None for p in parts):
            zeros = np.concatenate([p.zero_points() for p in parts], axis=0)
        out[f"{prefix}{merged}_weight"] = NBitsTable(
            4, parts[0].block, np.concatenate([p.codes for p in parts], axis=0),
            np.concatenate([p.scales for p in parts], axis=0), zeros,
        )
    return out


def fp16_scales(scales: np.ndarray) -> np.ndarray | None:
    """The scales as float16 when each rounds to its nearest float16 within float16's normal range
    (relative change <= 2^-11), else None."""
    s = np.asarray(scales, dtype=np.float32)
    a = np.abs(s)
    if not np.all(np.isfinite(s)) or np.any(a > FP16_MAX) or np.any((a > 0) & (a < FP16_NORMAL_MIN)):
        return None
    return s.astype(np.float16)


def packed_from_table(t: NBitsTable, words: bool = False) -> Packed | None:
    """The :class:`~perfx_compiler.formats.Packed` of an int4 table, or None when the kernels cannot hold it (``words``: zero
    points as uint32 words, ``formats.int4.words_target``)."""
    n, k = t.shape
    fmt = Int4Format(t.block, symmetric=t.zeros is None)
    try:
        fmt.lanes(k)
    except PerfXError:
        return None  # K not a multiple of 32: this weight stays float32
    scale = fp16_scales(t.scales)
    if scale is None:
        return None
    return int4_packed(t.codes, scale, t.zero_points(), fmt, words=words)


def apply(mod: tvm.IRModule, weights: dict[str, Any], ctx: Any) -> tuple[tvm.IRModule, dict[str, Any]]:
    if (getattr(ctx.options, "quantization", "f32") or "f32") != QUANTIZATION:
        return mod, weights
    desc = ctx.desc
    tables = int4_tables(desc) if desc is not None else {}
    if not tables:
        raise PerfXError(
            "quantization 'onnx' needs an ONNX model with int4 MatMulNBits weights (onnxruntime-genai int4); "
            "this model has none (use f32, q8 or q4_g128)"
        )
    quant, _ = linear_weights(mod, weights)
    packed = {}
    for name in sorted(quant):
        if name not in tables:
            continue  # float linears (an fp32 lm_head, 8-bit blocks) stay float
        t = tables[name]
        w = np.asarray(weights[name], dtype=np.float32)
        if tuple(w.shape) != t.shape:
            raise PerfXError(f"internal: MatMulNBits table of {name} has shape {t.shape}, the graph's weight {w.shape}")
        err = float(np.abs(t.dequantize() - w).max())
        if err > 1e-6 * max(float(np.abs(w).max()), 1e-30):
            raise PerfXError(f"internal: MatMulNBits table of {name} does not reproduce its weights (max error {err:g})")
        pk = packed_from_table(t, words_target(ctx.target))
        if pk is not None:
            packed[name] = pk
    return rewrite_linears(mod, weights, packed)
