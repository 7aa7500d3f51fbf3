"""Weight-only int8 group quantization (symmetric; GGUF Q8_0 is the G = 32 case): numpy side and
the reference PrimFuncs that ``schedules/gemv_int8_cpu.py`` replaces by its kernels.

Layout, for W [N, K]: ``q`` int8 [N, K] row-major (a vector load of L bytes = L consecutive
columns), ``scale`` float16 [N, K/G]; w = q * scale. G must divide K (every GGUF Q8_0 tensor
qualifies: rows are whole blocks of 32). Bytes per parameter at G = 32: 1 + 2/32 = 1.0625.

Variants for the GGUF superblock types kept as they are (``formats/superblocks.py``):

* offset (info ``offset: true``; Q5_K, Q5_1): ``q`` uint8 [N, K] unsigned codes, a third array
  ``min`` after ``scale``; w = q * scale + min.
* superblock scales (info ``sb: 256``; Q6_K, Q3_K, IQ4_XS, and Q5_K with the offset): ``scale`` (and
  ``min``) int8 [N, K/G + 2 * K/256]: the group values sc (m), then the row's superblock d (dmin) as
  little-endian float16 bytes; w = q * (sc * d), or with the offset q * (sc * d) - (m * dmin).
* bit-plane codes (info ``code_bits``: 6 for Q6_K, 5 for Q5_K / Q5_1 / Q5_0, 3 for Q3_K, 2 for Q2_K; CPU
  layouts only): ``q`` uint8 [N, bitplanes.row_bytes(K, bits)], the unsigned codes in the planes of
  ``formats/bitplanes.py`` (as many bits a code as in the file, where bytes took 8); signed codes
  (Q6_K, Q5_0, Q3_K: no min) are stored + 2^(bits-1) and the kernels take that zero point off. With 2-bit
  codes (Q2_K) the scale bytes are the file's sc | m << 4 and the min array [N, 2 K/256] holds dmin alone;
  with 3-bit codes (Q3_K) ``scale`` is int8 [N, K/16], 4 sc with d's bits in the low 2 bits of each
  superblock's first 8 values (``vnni_lowbit.pack_scales_d_low``, its VNNI layout's array).
  ``code_bits`` 4 (IQ4_NL, IQ4_XS): 4-bit indices into ggml's non-linear table, the kernels look the
  value up (``formats/vnni.table_value``).
* their GPU layout (info ``gpu_factors: true``): the codes' planes as uint32 arrays of their own
  (``bitplanes.pack_word_planes``: ``q``, ``q_hi``), the factors in ``formats/gpu_factors.py``'s arrays.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from perfx_compiler.errors import PerfXError
from perfx_compiler.formats import QUANT_ATTR


def check_group(k: int, group: int, what: str = "q8") -> None:
    if k % group:
        raise PerfXError(
            f"{what}: group size {group} does not divide a weight's input size K={k}; "
            f"pick a group dividing {k} (q8 = groups of 32, q8_g64, q8_g128)"
        )


def quantize_int8(w: np.ndarray, group: int, chunk_weights: int = 1 << 20) -> tuple[np.ndarray, np.ndarray]:
    """(codes int8 [N, K] in -127..127, scale float16 [N, K/G]), round to nearest as llama.cpp Q8_0.
    Rows go ``chunk_weights`` weights at a time: the float64 temporaries of a whole 32000 x 2048 head
    (~2 GB) set a float model's ``q8`` compile peak before."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    check_group(k, group)
    codes = np.empty((n, k), np.int8)
    scale = np.empty((n, k // group), np.float16)
    step = max(1, chunk_weights // k)
    for r in range(0, n, step):
        grp = w[r : r + step].reshape(-1, k // group, group).astype(np.float64)
        sc = (np.abs(grp).max(axis=2) / 127.0).astype(np.float16)
        s = sc.astype(np.float64)
        s[s == 0] = 1.0
        codes[r : r + step] = np.clip(np.rint(grp / s[:, :, None]), -127, 127).reshape(-1, k)
        scale[r : r + step] = sc
    return codes, scale


def dequantize_int8(codes: np.ndarray, scale: np.ndarray, group: int) -> np.ndarray:
    idx = np.arange(codes.shape[1]) // group
    return (codes.astype(np.float32) * scale.astype(np.float32)[:, idx]).astype(np.float32)


def lanes8(k: int, group: int) -> int:
    for lanes in (16, 8, 4):
        if group % lanes == 0 and k % lanes == 0:
            return lanes
    raise PerfXError(f"q8: group size {group} must be a multiple of 4")


def int8_matmul_compute(
    n: int, k: int, group: int, kind: str = "matmul", rows: tuple[int | None, int | None] = (1, None),
    ids_dtype: str = "int64", words: bool = False, offset: bool = False, sb: int = 0, gpu_factors: Any = None,
    code_bits: int = 8, word_planes: bool = False,
) -> Any:
    """Reference PrimFunc of an int8 linear (``kind``: matmul / dequant / take, as in ``formats.int4``),
    tagged ``perfx.quant`` with bits = 8. Correct (slow) on any target as it is. ``words``: the codes
    arrive as uint32 [N, K/4] (4 codes per word, little-endian: the int8 array's own bytes), for
    targets without 8-bit types (WGSL); the info then says ``"words": true``. ``offset`` / ``sb``:
    the superblock variants of the module docstring; ``gpu_factors``: the superblock factors' GPU layout
    (a ``formats.gpu_factors.GpuFactors``; info ``"gpu_factors": true``). With
    ``words`` the offset variant's uint8 codes (and the group values) are words too. ``code_bits`` 2 / 3 / 5 / 6:
    the codes in bit planes (module docstring; on CPUs never with ``words``); with ``word_planes`` (GPU
    layouts) each plane a uint32 array of its own (``bitplanes.pack_word_planes``: ``q``, then ``q_hi``)."""
    from tvm import te, tirx

    from perfx_compiler.formats import bitplanes
    from perfx_compiler.formats.vnni import table_value

    check_group(k, group)
    ng = k // group
    if words and k % 4:
        raise PerfXError(f"q8: K={k} is not a multiple of 4; the codes cannot be read as 32-bit words")
    gpu_sb = bool(sb and gpu_factors is not None)
    if (offset or sb) and ((words and sb and not gpu_sb) or (sb and k % sb)):
        raise PerfXError(f"internal: q8 superblock / min variants take byte codes and K % {sb} == 0 (K={k})")
    word_planes = word_planes and code_bits != 8
    if code_bits != 8 and (code_bits not in bitplanes.PLANES or (not word_planes and (words or gpu_sb))):
        raise PerfXError(f"internal: q8 bit-plane codes take 2 to 6 bits and byte arrays (got {code_bits})")
    qshape, qdtype = ((n, bitplanes.row_bytes(k, code_bits)), "uint8") if code_bits != 8 else ((n, k), None)
    nibbles = code_bits == 2 and bool(sb) and offset and not gpu_sb  # Q2_K: scale bytes sc | m << 4
    d_low = code_bits == 3 and bool(sb) and not offset and not gpu_sb  # Q3_K: d in the values' low bits
    z = None
    fs: list[Any] = []
    if gpu_sb:  # codes in word planes (below), factors in gpu_factors' arrays
        if not word_planes:
            raise PerfXError("internal: the GPU superblock layout takes codes in word planes")
        q = s = None
        fs = gpu_factors.placeholders()
    elif offset or sb:
        from perfx_compiler.formats.superblocks import te_factor, te_nibble_factors
        from perfx_compiler.formats.vnni_lowbit import te_factor_d_low

        width = ng + (2 * (k // sb) if sb and not d_low else 0)
        q = te.placeholder((n, -(-k // 4)) if words else qshape, "uint32" if words else qdtype or (
            "uint8" if offset else "int8"), name="q")
        s = te.placeholder((n, width), "int8" if sb else "float16", name="scale")
        if offset:
            z = te.placeholder((n, 2 * (k // sb) if nibbles else width), "int8" if sb else "float16", name="min")
    else:
        q = te.placeholder((n, k // 4) if words else qshape, "uint32" if words else qdtype or "int8", name="q")
        s = te.placeholder((n, ng), "float16", name="scale")

    qs = [q]
    if word_planes:
        qs = [te.placeholder((n, k * width // 32), "uint32", name="q_hi" if i else "q")
              for i, width in enumerate(bitplanes.PLANES[code_bits])]

    def code(row: Any, col: Any) -> Any:
        if word_planes:
            c = bitplanes.word_plane_code(qs, row, col, code_bits)
            if code_bits == 4:  # IQ4 table indices
                return table_value(c, "iq4nl", "int32")
            return c if offset else c - (1 << (code_bits - 1))
        if code_bits != 8:  # unsigned codes; signed ones (no min) stored + 2^(bits-1)
            c = bitplanes.plane_code(lambda r, i: q[r, i], row, col, 0, k, code_bits)
            if code_bits == 4:  # IQ4 table indices
                return table_value(c.astype("uint8"), "iq4nl").astype("int32") - 128
            return c if offset else c - (1 << (code_bits - 1))
        if not words:
            return q[row, col].astype("float32")
        byte = (q[row, col // 4] >> ((col % 4) * 8).astype("uint32")) & tirx.const(255, "uint32")
        if offset:
            return byte  # unsigned codes
        return (byte.astype("int32") ^ 128) - 128  # sign-extend without 8-bit types

    def w(row: Any, col: Any) -> Any:
        if gpu_sb:  # code * (sc * d) [- (m * dmin)], the factors in arrays of their own
            sc, mn = gpu_factors.factors(fs, row, col // group)
            v = code(row, col).astype("float32") * sc
            return v - mn if offset else v
        if nibbles:  # code * (sc * d) - (m * dmin), sc and m the nibbles of one scale byte
            sc, mn = te_nibble_factors(s, z, row, col // group, ng, group, sb)
            return code(row, col).astype("float32") * sc - mn
        if offset or sb:
            g = col // group
            sc = (te_factor_d_low(s, row, g) if d_low else te_factor(s, row, g, ng, group, sb) if sb
                  else s[row, g].astype("float32"))
            if not offset:
                return code(row, col).astype("float32") * sc
            if sb:  # code * (sc * d) - (m * dmin)
                return code(row, col).astype("float32") * sc - te_factor(z, row, g, ng, group, sb)
            return code(row, col).astype("float32") * sc + z[row, g].astype("float32")
        return code(row, col).astype("float32") * s[row, col // group].astype("float32")

    ws = [*qs, *fs] if gpu_sb else [*qs, s] + ([z] if z is not None else [])
    b = tirx.Var("b", "int64") if rows[0] is None else rows[0]
    m = tirx.Var("m", "int64") if rows[1] is None else rows[1]
    if kind == "dequant":
        out = te.compute((n, k), lambda row, col: w(row, col), name="dequant_q8")
        func = te.create_prim_func([*ws, out])
    elif kind == "take":
        ids = te.placeholder((b, m), ids_dtype, name="ids")
        out = te.compute((b, m, k), lambda bi, i, c: w(ids[bi, i], c), name="take_q8")
        func = te.create_prim_func([*ws, ids, out])
    else:
        x = te.placeholder((b, m, k), "float32", name="x")
        r = te.reduce_axis((0, k), name="k")
        out = te.compute((b, m, n), lambda bi, i, j: te.sum(x[bi, i, r] * w(j, r), axis=r), name="matmul_q8")
        func = te.create_prim_func([x, *ws, out])
    info = {"bits": 8, "N": n, "K": k, "group": group, "lanes": lanes8(k, group), "kind": kind}
    if words:
        info["words"] = True
    if offset:  # only then (and sb): the classic facts (and tuning keys) stay as they were
        info["offset"] = True
    if sb:
        info["sb"] = sb
    if gpu_sb:
        info["gpu_factors"] = True
    if code_bits != 8:
        info["code_bits"] = code_bits
    if word_planes:
        info["word_planes"] = True
    return func.with_attr(QUANT_ATTR, json.dumps(info, sort_keys=True))


def int8_packed(codes: np.ndarray, scale: np.ndarray, group: int, words: bool = False, code_bits: int = 8,
                word_planes: bool = False) -> Any:
    """The :class:`~perfx_compiler.formats.Packed` of int8 codes [N, K] + float16 scales [N, K/G]; ``words``: the codes
    stored as uint32 [N, K/4] (same bytes; see :func:`int8_matmul_compute`); ``code_bits`` 5: signed codes
    of that many bits (GGUF Q5_0: -16..15) stored + 2^(bits-1) in bit planes (``formats/bitplanes.py``); 4: the
    codes are IQ4_NL table values, stored as their 4-bit indices; ``word_planes`` (GPU layouts): the planes as
    uint32 arrays of their own (``bitplanes.pack_word_planes``)."""
    from perfx_compiler.formats import Packed

    n, k = codes.shape
    check_group(k, group)

    def compute(kind: str, rows: tuple[int | None, int | None], ids_dtype: str = "int64") -> Any:
        return int8_matmul_compute(n, k, group, kind=kind, rows=rows, ids_dtype=ids_dtype, words=words,
                                   code_bits=code_bits, word_planes=word_planes)

    q = np.ascontiguousarray(codes, dtype=np.int8)
    planes: list[tuple[str, np.ndarray]] = []
    if code_bits != 8:
        from perfx_compiler.formats.bitplanes import pack_planes, pack_word_planes
        from perfx_compiler.formats.vnni import table_indices

        unsigned = table_indices(q, "iq4nl") if code_bits == 4 else q.astype(np.int16) + (1 << (code_bits - 1))
        if word_planes:
            q, *hi = pack_word_planes(unsigned, code_bits)
            planes = [("_q8_hi", h) for h in hi]
        else:
            q = pack_planes(unsigned, code_bits)
    elif words:
        if k % 4:
            raise PerfXError(f"q8: K={k} is not a multiple of 4; the codes cannot be read as 32-bit words")
        q = q.view(np.uint32)
    arrays = [("_q8", q), *planes,
              ("_q8_scale", np.ascontiguousarray(scale, dtype=np.float16))]

    def vnni() -> Any:
        from perfx_compiler.formats.vnni import q8_vnni_packed

        return q8_vnni_packed(codes, scale, group)

    # the code width is part of the kernel names: a Q5_0 / IQ4_NL weight must not share Q8_0's kernel
    tag = f"g{group}" + (f"b{code_bits}" if code_bits != 8 else "")
    return Packed("q8", tag, n, k, arrays, compute, vnni)
