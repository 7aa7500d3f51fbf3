"""Half-precision weights (quantization ``f16`` / ``bf16``) and matmul-input rounding (``--precision``):
numpy conversions and the reference PrimFuncs that ``schedules/gemv_half_cpu.py`` replaces.

Layout, for W [N, K]: one array ``<W>_f16`` (float16 [N, K]) or ``<W>_bf16`` (uint16 [N, K]: the
upper half of each float32's bits, rounded to nearest even; numpy has no bfloat16 and the runtime
reads weights with plain numpy dtypes). Kernels widen to float32 in registers (bf16: zero-extend
and shift left 16; f16: vcvtph2ps) and accumulate in float32.

Activations (``act``): ``f32`` leaves the matmul input as it is; ``bf16`` / ``f16`` round it to
that format first (bf16: round to nearest even on the bit pattern, as ``vcvtneps2bf16``), so a
product of two bf16 values is exact in float32 and only the fp32 accumulation order differs from
a ``vdpbf16ps`` kernel.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from perfx_compiler.formats import QUANT_ATTR

FAMILIES = ("f16", "bf16")


def bf16_bits(w: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even; NaN stays a quiet NaN."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    u = w.view(np.uint32)
    # in uint32, in place (no uint64 temporaries: 3x faster on SmolLM2's weights): the largest
    # non-NaN pattern (-inf, 0xFF800000) plus 0x8000 fits; NaNs, which may wrap, are redone below
    r = u >> 16
    r &= 1
    r += 0x7FFF
    r += u
    r >>= 16
    rounded = r.astype(np.uint16)
    nan = np.isnan(w)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_act(x: np.ndarray, act: str) -> np.ndarray:
    """What the kernels do to a matmul input under precision ``act`` (numpy reference)."""
    x = np.asarray(x, dtype=np.float32)
    if act == "bf16":
        return bf16_to_f32(bf16_bits(x))
    if act == "f16":
        return x.astype(np.float16).astype(np.float32)
    return x


def to_half(w: np.ndarray, family: str) -> np.ndarray:
    """The stored array of a float weight in ``family`` (f16: float16; bf16: uint16 bits)."""
    if family == "bf16":
        return bf16_bits(w)
    if family == "f16":
        w32 = np.asarray(w, dtype=np.float32)
        if np.abs(w32).max(initial=0.0) > 65504.0:
            from perfx_compiler.errors import PerfXError

            raise PerfXError("quantization f16: a weight exceeds float16's range (65504); use bf16 or f32")
        return w32.astype(np.float16)
    raise ValueError(family)


def from_half(h: np.ndarray, family: str) -> np.ndarray:
    return bf16_to_f32(h) if family == "bf16" else np.asarray(h, dtype=np.float16).astype(np.float32)


def storage_dtype(family: str) -> str:
    return "uint16" if family == "bf16" else "float16"


def widen_expr(value: Any, family: str) -> Any:
    """TIR: a stored half element -> float32."""
    from tvm import tirx

    if family == "bf16":
        return tirx.reinterpret("float32", value.astype("uint32") << tirx.const(16, "uint32"))
    return value.astype("float32")


def round_expr(value: Any, act: str) -> Any:
    """TIR: a float32 matmul input rounded to ``act`` (returned as float32)."""
    from tvm import tirx

    if act == "bf16":
        u = tirx.reinterpret("uint32", value)
        one = tirx.const(1, "uint32")
        r = u + tirx.const(0x7FFF, "uint32") + ((u >> tirx.const(16, "uint32")) & one)
        return tirx.reinterpret("float32", r & tirx.const(0xFFFF0000, "uint32"))
    if act == "f16":
        return value.astype("float16").astype("float32")
    return value


def half_compute(
    n: int, k: int, family: str, kind: str = "matmul", rows: tuple[int | None, int | None] = (1, None),
    act: str = "f32", ids_dtype: str = "int64",
) -> Any:
    """Reference PrimFunc of a half-weight linear, tagged ``perfx.quant`` with bits = 16; correct
    (slow) on any target. ``kind``: matmul (x [b, m, K] -> [b, m, N], input rounded to ``act``),
    dequant (W as float32 [N, K]), take (embedding rows), round (x [b, m, K] rounded to ``act``)."""
    from tvm import te, tirx

    w = te.placeholder((n, k), storage_dtype(family), name="w")
    b = tirx.Var("b", "int64") if rows[0] is None else rows[0]
    m = tirx.Var("m", "int64") if rows[1] is None else rows[1]
    if kind == "dequant":
        out = te.compute((n, k), lambda r, c: widen_expr(w[r, c], family), name=f"dequant_{family}")
        func = te.create_prim_func([w, out])
    elif kind == "take":
        ids = te.placeholder((b, m), ids_dtype, name="ids")
        out = te.compute((b, m, k), lambda bi, i, c: widen_expr(w[ids[bi, i], c], family), name=f"take_{family}")
        func = te.create_prim_func([w, ids, out])
    elif kind == "round":
        x = te.placeholder((b, m, k), "float32", name="x")
        out = te.compute((b, m, k), lambda bi, i, c: round_expr(x[bi, i, c], act), name=f"round_{act}")
        func = te.create_prim_func([x, out])
    else:
        x = te.placeholder((b, m, k), "float32", name="x")
        r = te.reduce_axis((0, k), name="k")
        out = te.compute(
            (b, m, n),
            lambda bi, i, j: te.sum(round_expr(x[bi, i, r], act) * widen_expr(w[j, r], family), axis=r),
            name=f"matmul_{family}",
        )
        func = te.create_prim_func([x, w, out])
    info = {"bits": 16, "dtype": family, "N": n, "K": k, "kind": kind, "act": act}
    return func.with_attr(QUANT_ATTR, json.dumps(info, sort_keys=True))


def half_packed(w: np.ndarray, family: str, act: str = "f32") -> Any:
    """The :class:`~perfx_compiler.formats.Packed` of one float weight W [N, K] stored in ``family``."""
    from perfx_compiler.formats import Packed

    h = np.ascontiguousarray(to_half(w, family))
    n, k = h.shape

    def compute(kind: str, rows: tuple[int | None, int | None], ids_dtype: str = "int64") -> Any:
        return half_compute(n, k, family, kind=kind, rows=rows, act=act, ids_dtype=ids_dtype)

    tag = "w" if act == "f32" else f"a{act}"
    return Packed(family, tag, n, k, [(f"_{family}", h)], compute)
