"""Weight-only int4 group quantization: numpy packing and the reference (compute-form) PrimFuncs.

Packed layout (what ``schedules/gemv_int4_cpu.py`` reads), for W [N, K]:

* ``q``: uint32 [N, K/8]. K is cut into blocks of ``B = 8 * L`` (L = 16, 8 or 4 lanes: the widest
  with K % B == 0). Word ``kb * L + l`` of a row holds, in nibble ``j`` (bits 4j..4j+3), the code of
  column ``k = kb * B + j * L + l``. So one vector load of L words + a constant shift + mask gives
  L *consecutive* columns: unpacking is three vector ops and x is read contiguously.
* ``scale``: float16 [N, ceil(K/G)], ``zero``: uint8 [N, ceil(K/G)]; w = (code - zero) * scale.
  Symmetric formats (GGUF Q4_0, q4 ``s`` groups, ONNX MatMulNBits without zero points) have zero = 8
  everywhere and store no zero array: their kernels take the constant. A group size that does not divide
  K leaves a shorter last group (K = 576 with g128: 4 groups of 128 + one of 64).
* Offset variant (``Int4Format.offset``, GGUF Q4_1 as it is): the third array is ``min``, float16
  [N, ceil(K/G)], and w = code * scale + min.
* Superblock scales (info ``sb: 256``, GGUF Q4_K as it is, ``formats/superblocks.py``;
  offset only): ``scale`` and ``min`` are int8 [N, NG + 2 * K/256]: the group values (sub-block
  scale ``sc``, min ``m``), then the row's superblock ``d`` (``dmin``) as little-endian float16 bytes;
  w = code * (sc * d) - (m * dmin), every product exact in float32. GPU layout (info ``gpu_factors``):
  the factors in ``formats/gpu_factors.py``'s uint32 arrays (``formats.superblocks.subscaled_packed``'s ``gpu``).
* Zero words (``words``, GPU targets without 8-bit types: WGSL): ``zero`` is uint32 [N, ceil(ng/4)],
  the uint8 zeros' own bytes (4 groups a word, little-endian, the last word zero-padded), as the int8
  codes of ``formats.int8`` are.

Bytes per parameter at g128: 0.5 + 3/128 = 0.523.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from perfx_compiler.errors import PerfXError
from perfx_compiler.formats import QUANT_ATTR


@dataclass(frozen=True)
class Int4Format:
    group: int
    symmetric: bool
    offset: bool = False  # third array is a float16 min (w = code * scale + min), not a uint8 zero

    @property
    def tag(self) -> str:
        """Format tag in kernel names: g128, g32s (symmetric), g32m (min offset)."""
        return f"g{self.group}{'s' if self.symmetric else ''}{'m' if self.offset else ''}"

    def lanes(self, k: int) -> int:
        """Interleave width L (block B = 8L) for a row of ``k`` columns."""
        for lanes in (16, 8, 4):
            if k % (8 * lanes) == 0 and self.group % lanes == 0:
                return lanes
        raise PerfXError(
            f"int4 packing needs the input size to be a multiple of 32; a weight has K={k} "
            f"(use quantization f32 or q8 for this model)"
        )


def quantize_int4(w: np.ndarray, fmt: Int4Format) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes uint8 [N, K] in 0..15, scale float16 [N, ng], zero uint8 [N, ng])."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    g = fmt.group
    ng = -(-k // g)
    pad = ng * g - k
    # Pad the ragged last group with its own first value so it does not widen the range.
    wp = np.concatenate([w, np.repeat(w[:, -1:] if pad else w[:, :0], pad, axis=1)], axis=1) if pad else w
    grp = wp.reshape(n, ng, g).astype(np.float64)
    if fmt.symmetric:
        amax = np.abs(grp).max(axis=2)
        scale = (amax / 7.0).astype(np.float16)
        s = scale.astype(np.float64)
        s[s == 0] = 1.0
        zero = np.full((n, ng), 8, dtype=np.uint8)
        codes = np.clip(np.rint(grp / s[:, :, None]) + 8, 0, 15)
    else:
        lo, hi = np.minimum(grp.min(axis=2), 0.0), np.maximum(grp.max(axis=2), 0.0)
        scale = ((hi - lo) / 15.0).astype(np.float16)
        s = scale.astype(np.float64)
        s[s == 0] = 1.0
        zero = np.clip(np.rint(-lo / s), 0, 15).astype(np.uint8)
        codes = np.clip(np.rint(grp / s[:, :, None]) + zero[:, :, None], 0, 15)
    codes = codes.reshape(n, ng * g)[:, :k].astype(np.uint8)
    return codes, scale, zero


def dequantize_int4(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray, group: int) -> np.ndarray:
    """Float32 weights the kernels compute with (the reference for tests)."""
    k = codes.shape[1]
    idx = np.arange(k) // group
    s = scale.astype(np.float32)[:, idx]
    z = zero.astype(np.float32)[:, idx]
    return ((codes.astype(np.float32) - z) * s).astype(np.float32)


def pack_int4(codes: np.ndarray, lanes: int) -> np.ndarray:
    """codes [N, K] -> uint32 [N, K/8] in the interleaved layout of the module docstring."""
    n, k = codes.shape
    blocks = k // (8 * lanes)
    c = codes.reshape(n, blocks, 8, lanes).astype(np.uint32)  # [n, kb, nibble j, lane l]
    words = np.zeros((n, blocks, lanes), dtype=np.uint32)
    for j in range(8):
        words |= c[:, :, j, :] << np.uint32(4 * j)
    return words.reshape(n, blocks * lanes)


def unpack_int4(words: np.ndarray, k: int, lanes: int) -> np.ndarray:
    n = words.shape[0]
    w = words.reshape(n, k // (8 * lanes), lanes)
    out = np.stack([(w >> np.uint32(4 * j)) & np.uint32(15) for j in range(8)], axis=2)
    return out.reshape(n, k).astype(np.uint8)


def words_target(target: Any) -> bool:
    """GPU targets with int32 indices (WebGPU/WGSL: no 8-bit or 64-bit integers) read 8-bit arrays
    (int8 codes, uint8 zero points) as uint32 words."""
    raw = getattr(target, "raw", None) or {}
    return getattr(target, "family", "") == "gpu" and raw.get("index_dtype") == "int32"


def zero_words(zero: np.ndarray) -> np.ndarray:
    """uint8 zeros [N, ng] -> uint32 [N, ceil(ng/4)]: group g in byte g % 4 of word g // 4."""
    z = np.asarray(zero, dtype=np.uint8)
    n, ng = z.shape
    padded = np.zeros((n, -(-ng // 4) * 4), dtype=np.uint8)
    padded[:, :ng] = z
    return padded.view("<u4").astype(np.uint32)


def quant_info(n: int, k: int, group: int, lanes: int, symmetric: bool, offset: bool = False, sb: int = 0) -> str:
    """The JSON the schedule template reads from a quantized matmul PrimFunc."""
    info = {"bits": 4, "N": n, "K": k, "group": group, "lanes": lanes, "sym": symmetric}
    if offset:
        info["offset"] = True
    if sb:  # only then: the classic formats' facts (and tuning keys) stay as they were
        info["sb"] = sb
    return json.dumps(info, sort_keys=True)


def int4_packed(
    codes: np.ndarray, scale: np.ndarray, third: np.ndarray, fmt: Int4Format, words: bool = False
) -> Any:
    """The :class:`~perfx_compiler.formats.Packed` of int4 codes [N, K] with scale and zero (or min, ``fmt.offset``);
    ``words``: the zeros as uint32 words (:func:`zero_words`; no effect on the min variant)."""
    from perfx_compiler.formats import Packed

    n, k = codes.shape
    lanes = fmt.lanes(k)
    words = words and not fmt.offset

    def compute(kind: str, rows: tuple[int | None, int | None], ids_dtype: str = "int64") -> Any:
        return int4_matmul_compute(
            n, k, fmt.group, lanes, fmt.symmetric, kind=kind, rows=rows, offset=fmt.offset, ids_dtype=ids_dtype,
            words=words,
        )

    arrays = [("_q4", pack_int4(codes, lanes)), ("_q4_scale", np.ascontiguousarray(scale, dtype=np.float16))]
    if fmt.offset:
        arrays.append(("_q4_min", np.ascontiguousarray(third, dtype=np.float16)))
    elif not fmt.symmetric:  # (symmetric: zero point 8, no array)
        zero = np.ascontiguousarray(third, dtype=np.uint8)
        arrays.append(("_q4_zero", zero_words(zero) if words else zero))

    def vnni() -> Any:
        from perfx_compiler.formats.vnni import q4_vnni_packed

        return q4_vnni_packed(codes, scale, third, fmt)

    return Packed("q4", fmt.tag, n, k, arrays, compute, vnni)


def int4_matmul_compute(
    n: int, k: int, group: int, lanes: int, symmetric: bool, kind: str = "matmul",
    rows: tuple[int | None, int | None] = (1, None), offset: bool = False, ids_dtype: str = "int64",
    words: bool = False, sb: int = 0, gpu_factors: Any = None,
) -> Any:
    """Reference PrimFunc ``y[0, m, n] = sum_k x[0, m, k] * dequant(W)[n, k]`` (M symbolic), tagged
    with ``perfx.quant`` so the int4 template can replace it with its scheduled kernel. Correct
    (slow) as it is on any target. ``kind="take"``: the embedding gather out[0, s, :] = W[ids[0, s]];
    ``kind="dequant"``: the whole float W [N, K] (prefill then runs the float GEMM template).
    ``rows``: the two leading dims of x (ids), each static or None for symbolic; ``ids_dtype``: the
    graph's index dtype (int32 on targets without 64-bit integers, where shapes are int32 too);
    ``words``: the zeros arrive as uint32 words (:func:`zero_words`) and the info says ``"words": true``;
    ``sb``: superblock scales (module docstring; offset only); ``gpu_factors``: their GPU layout (a
    ``formats.gpu_factors.GpuFactors``, every array uint32; info ``"gpu_factors": true``)."""
    from tvm import te, tirx

    ng = -(-k // group)
    block = 8 * lanes
    gpu_sb = bool(sb and gpu_factors is not None)
    if sb and (not offset or (words and not gpu_sb) or k % sb):
        raise PerfXError(f"internal: int4 superblock scales need the min variant and K % {sb} == 0 (K={k})")
    q = te.placeholder((n, k // 8), "uint32", name="q")
    words = words and (not offset or gpu_sb)
    fs: list[Any] = []
    if gpu_sb:
        s = z = None
        fs = gpu_factors.placeholders()
    elif sb:
        from perfx_compiler.formats.superblocks import te_factor

        s = te.placeholder((n, ng + 2 * (k // sb)), "int8", name="scale")
        z = te.placeholder((n, ng + 2 * (k // sb)), "int8", name="min")
    elif words:
        s = te.placeholder((n, ng), "float16", name="scale")
        z = te.placeholder((n, -(-ng // 4)), "uint32", name="zero")
    else:
        s = te.placeholder((n, ng), "float16", name="scale")
        z = te.placeholder((n, ng), "float16" if offset else "uint8", name="min" if offset else "zero")
    if symmetric and not offset:  # zero point 8 everywhere: no array
        z = None

    def zero(row: Any, g: Any) -> Any:
        if z is None:
            return tirx.const(8.0, "float32")
        if not words:
            return z[row, g].astype("float32")
        byte = (z[row, g // 4] >> ((g % 4) * 8).astype("uint32")) & tirx.const(255, "uint32")
        return byte.astype("float32")

    def w(row: Any, col: Any) -> Any:
        word = q[row, (col // block) * lanes + col % lanes]
        code = (word >> ((col % block) // lanes * 4).astype("uint32")) & tirx.const(15, "uint32")
        g = col // group
        if gpu_sb:  # code * (sc * d) - (m * dmin), the factors in arrays of their own
            sc, mn = gpu_factors.factors(fs, row, g)
            return code.astype("float32") * sc - mn
        if sb:  # code * (sc * d) - (m * dmin)
            return code.astype("float32") * te_factor(s, row, g, ng, group, sb) - te_factor(z, row, g, ng, group, sb)
        if offset:
            return code.astype("float32") * s[row, g].astype("float32") + z[row, g].astype("float32")
        return (code.astype("float32") - zero(row, g)) * s[row, g].astype("float32")

    b = tirx.Var("b", "int64") if rows[0] is None else rows[0]
    m = tirx.Var("m", "int64") if rows[1] is None else rows[1]
    ws = [q, *fs] if gpu_sb else [q, s] if z is None else [q, s, z]
    if kind == "dequant":
        out = te.compute((n, k), lambda row, col: w(row, col), name="dequant_q4")
        func = te.create_prim_func([*ws, out])
    elif kind == "take":
        ids = te.placeholder((b, m), ids_dtype, name="ids")
        out = te.compute((b, m, k), lambda bi, i, c: w(ids[bi, i], c), name="take_q4")
        func = te.create_prim_func([*ws, ids, out])
    else:
        x = te.placeholder((b, m, k), "float32", name="x")
        r = te.reduce_axis((0, k), name="k")
        out = te.compute((b, m, n), lambda bi, i, j: te.sum(x[bi, i, r] * w(j, r), axis=r), name="matmul_q4")
        func = te.create_prim_func([x, *ws, out])
    info = json.loads(quant_info(n, k, group, lanes, symmetric, offset, sb))
    info["kind"] = kind
    if words:
        info["words"] = True
    if gpu_sb:
        info["gpu_factors"] = True
    return func.with_attr(QUANT_ATTR, json.dumps(info, sort_keys=True))
