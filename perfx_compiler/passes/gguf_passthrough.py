"""GGUF passthrough (quantization ``gguf``): linears read the file's blocks as they are, repacked into
the kernels' layouts, never requantized: Q4_0 / Q4_1 / Q5_0 / Q8_0 on every target
(``formats/gguf_blocks.py``), the superblock types (K-quants, IQ4_NL / IQ4_XS, Q5_1:
``formats/ggml``) on CPU targets: under int8 activations the VNNI kernels read their sub-block
scales and superblock d as they are (``formats/vnni.py``), under float activations the int4 / int8
CPU kernels do (``formats/superblocks.py``); on GPU targets (OpenCL, CUDA, ROCm, WGSL) they take
``subscaled_packed``'s GPU layout (group values and superblock d in arrays of their own, d as
float32 bits; on WGSL every 8-bit array as uint32 words) and run through the GPU templates (dlight's
GEMV for decode). On Adreno the image path (``texture_weights``) takes the K-quants and IQ4_XS
(``formats/superblock_images.py``); the one-level ones stay buffers.

The loader keeps each such tensor's raw blocks in ``ModelDescription.quantized`` (Q/K rows already
in Hugging Face order). Merged projections (``merge_projections``: QKV, gate+up) take their
members' blocks concatenated by rows when all members share one type. Each packed weight is
checked against the float weight the graph was built from (the same file, dequantized by the
``gguf`` package); a mismatch is an internal error, never a silent change of the model. Weights
of other types (F32, F16) stay float32.

Lazy models (``model/lazy.py``, large GGUFs): the weight itself is a ``QuantizedWeight`` holding
the mapped blocks; they are repacked one weight at a time straight from the file (no float
matrix, nothing to check against: the graph's weight *is* those blocks), and under int8
activations straight into the VNNI layout, so only the packed arrays stay in memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tvm
from tqdm import tqdm

from perfx_compiler.errors import PerfXError
from perfx_compiler.formats import ggml
from perfx_compiler.formats.gguf_blocks import BLOCK_BYTES, dequantize_blocks, packed_from_blocks
from perfx_compiler.formats.superblocks import subscaled_packed
from perfx_compiler.formats.vnni import ROW_CHUNKS, subscaled_vnni_packed
from perfx_compiler.heap import drop_file_pages
from perfx_compiler.model.lazy import is_lazy
from perfx_compiler.passes._quantized_linears import current_activations, finalized, packed_weights, rewrite_linears
from perfx_compiler.passes.merge_projections import complete_groups

NAME = "gguf_passthrough"


def relax_name(hf_name: str) -> str:
    """The Relax parameter name of a weight (the ONNX importer turns dots into underscores)."""
    return hf_name.replace(".", "_")


def block_tables(desc: Any) -> dict[str, tuple[str, np.ndarray, tuple[int, int]]]:
    """Relax weight name -> (ggml type, raw blocks [rows, bytes], (N, K)), merged groups included."""
    # lazy weights carry their own (merged) blocks: no tables, no concatenated copies here
    out = {relax_name(n): (t, raw, tuple(shape)) for n, (t, raw, shape) in desc.quantized.items() if not is_lazy(raw)}
    for prefix, merged, members in complete_groups(out):
        parts = [out[f"{prefix}{s}_weight"] for s in members]
        if len({p[0] for p in parts}) != 1:
            continue
        raw = np.concatenate([np.asarray(p[1]) for p in parts], axis=0)
        rows = sum(p[2][0] for p in parts)
        out[f"{prefix}{merged}_weight"] = (parts[0][0], raw, (rows, parts[0][2][1]))
    return out


def packable(qtype: str, vnni: bool, gpu: bool = False) -> bool:
    """Whether this pass keeps a ``qtype`` weight as blocks (under int8 activations when ``vnni``; on a
    GPU target when ``gpu``): every GGUF block type it reads, on every target (the superblock types in
    their GPU layout on GPU targets, ``formats.superblocks.subscaled_packed``)."""
    return qtype in BLOCK_BYTES or qtype in ggml.FORMATS


def gpu_target(ctx: Any) -> bool:
    """Whether the pass context compiles for a GPU target (``packable``'s ``gpu``)."""
    return getattr(getattr(ctx, "target", None), "family", "") == "gpu"


def _pack(qtype: str, raw: np.ndarray, shape: tuple[int, int], words8: bool, vnni: bool, gpu: bool = False,
          sub: Any = None, rows: int | None = None) -> Any:
    """The Packed of one tensor's blocks (``sub``: its superblock arrays, when already unpacked; ``rows``: the
    whole weight's N when ``raw`` is a chunk of its rows, VNNI layouts only)."""
    if qtype in ggml.FORMATS:
        sub = sub if sub is not None else ggml.unpack(qtype, raw, shape)
        return subscaled_vnni_packed(sub, qtype, rows=rows) if vnni else subscaled_packed(sub, qtype, gpu=gpu, words=words8)
    return packed_from_blocks(qtype, raw, shape, words8, vnni, gpu, rows=rows)


PACK_CHUNK_BYTES = 8 << 20  # blocks packed at a time: unpacking widens them (int8 / int16 codes, scales)


def _pack_in_chunks(qtype: str, raw: np.ndarray, shape: tuple[int, int], words8: bool, vnni: bool,
                    gpu: bool = False, reserve: Callable[..., np.ndarray] | None = None) -> Any:
    """``_pack``; a large weight in the VNNI layout a chunk of rows at a time into the whole arrays
    (``formats.vnni.ROW_CHUNKS``: axis 0 runs over the rows in every layout), so unpacking's temporaries
    are a chunk's, not the weight's (7B Q4_K_M: 882 MB anonymous at the passes' peak with whole weights,
    docs/decisions/gguf-superblocks.md). ``reserve`` (``PassContext.weight_file.reserve``): the whole arrays are placed
    in the weights file and each chunk's rows leave memory once written (Gemma 3's 262144-row embedding: its
    178 MB of codes would otherwise sit on the heap whole)."""
    n, k = shape
    step = max(ROW_CHUNKS, PACK_CHUNK_BYTES // max(1, raw.shape[1]) // ROW_CHUNKS * ROW_CHUNKS)
    if not vnni or gpu or words8 or n <= 2 * step:  # (the VNNI layouts are the CPU's int8-activation ones)
        return _pack(qtype, raw, shape, words8, vnni, gpu)
    starts = list(range(0, n, step))

    def chunk(a: int) -> Any:
        b = min(a + step, n)
        packed = _pack(qtype, raw[a:b], (b - a, k), False, vnni, rows=n)
        drop_file_pages(raw[a:b])  # read once: the file's pages need not stay resident (a mapped weight)
        return packed

    def put(out: np.ndarray, at: int, part: np.ndarray) -> None:
        out[at : at + part.shape[0]] = part
        drop_file_pages(out[at : at + part.shape[0]], written=True)  # (a reserved array: in the file now)

    first, last = chunk(starts[0]), chunk(starts[-1])  # (the last one's extent is the padded end's)
    arrays = []
    for (suffix, head), (_, tail) in zip(first.arrays, last.arrays, strict=True):
        out = (reserve or np.empty)((head.shape[0] * (len(starts) - 1) + tail.shape[0], *head.shape[1:]), head.dtype)
        put(out, 0, head)
        put(out, head.shape[0] * (len(starts) - 1), tail)
        arrays.append((suffix, out))
    for i, a in enumerate(starts[1:-1], start=1):
        for (_, out), (_, part) in zip(arrays, chunk(a).arrays, strict=True):
            put(out, i * part.shape[0], part)
    first.arrays = arrays
    return first


def _checked(name: str, weight: Any, table: tuple[str, np.ndarray, tuple[int, int]], words8: bool, vnni: bool,
             gpu: bool = False) -> Any:
    """The Packed of eager blocks, after checking they reproduce the graph's float weight."""
    qtype, raw, shape = table
    w = np.asarray(weight, dtype=np.float32)
    if tuple(w.shape) != shape:
        raise PerfXError(f"internal: GGUF blocks of {name} have shape {shape}, the graph's weight {w.shape}")
    # superblock types are unpacked once: the check and the packing read the same arrays
    sub = ggml.unpack(qtype, raw, shape) if qtype in ggml.FORMATS else None
    back = ggml.weights(sub) if sub is not None else dequantize_blocks(qtype, raw, shape)
    err = float(np.abs(back - w).max())
    if err > 1e-6 * max(float(np.abs(w).max()), 1e-30):
        raise PerfXError(f"internal: GGUF blocks of {name} ({qtype}) do not reproduce its weights (max error {err:g})")
    return _pack(qtype, raw, shape, words8, vnni, gpu, sub)


def apply(mod: tvm.IRModule, weights: dict[str, Any], ctx: Any) -> tuple[tvm.IRModule, dict[str, Any]]:
    if (getattr(ctx.options, "quantization", "f32") or "f32") != "gguf":
        return mod, weights
    desc = ctx.desc
    if desc is None or not getattr(desc, "quantized", None):
        raise PerfXError(
            "quantization 'gguf' needs a GGUF model with Q4_0, Q4_1, Q5_0 or Q8_0 weights; this model has none "
            "(use f32, q8 or q4_g128)"
        )
    if any(v[0] == "MatMulNBits" for v in desc.quantized.values()):
        raise PerfXError("quantization 'gguf' reads GGUF blocks; this ONNX model's int4 MatMulNBits blocks "
                         "run as quantization 'onnx' (the default)")
    quant = packed_weights(mod, weights)
    tables = block_tables(desc)
    # GPU targets without 8-bit types (WGSL; index_dtype int32) read int8 codes as 32-bit words
    raw_target = getattr(ctx.target, "raw", None) or {}
    words8 = getattr(ctx.target, "family", "") == "gpu" and raw_target.get("index_dtype") == "int32"
    # Under int8 activations each weight goes to the VNNI layout right away: the unpacked codes
    # (twice the blocks' size) are dropped before the next weight, not kept for rewrite_linears.
    vnni = current_activations() == "int8"
    gpu = gpu_target(ctx)

    def qtype_of(n: str) -> str:
        return weights[n].qtype if is_lazy(weights[n]) else tables[n][0] if n in tables else ""

    # others stay float (a lazy one dequantizes where it is read as an array)
    names = [n for n in sorted(quant) if packable(qtype_of(n), vnni, gpu)]
    show = bool(getattr(ctx.options, "progress", False)) and len(names) >= 32
    packed = {}
    from perfx_compiler.progress import console

    weight_file = getattr(ctx, "weight_file", None)
    reserve = weight_file.reserve if weight_file is not None else None
    for name in tqdm(names, desc="pack GGUF weights", unit="weight", disable=not show, leave=False, file=console()):
        w = weights[name]
        if is_lazy(w):
            packed[name] = _pack_in_chunks(w.qtype, w.blocks(), w.shape, words8, vnni, gpu, reserve=reserve)
            w.release()  # read once: its file pages need not stay resident
        else:
            packed[name] = _checked(name, w, tables[name], words8, vnni, gpu)
        packed[name] = finalized(packed[name], ctx)  # off the heap, to the weights file
    return rewrite_linears(mod, weights, packed)
