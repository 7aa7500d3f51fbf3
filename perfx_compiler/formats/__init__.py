"""Weight formats, one module each: how a format's weights are packed for each kind of kernel, the
float64 reference the tests dequantize with, and what its kernels need to know (the ``perfx.quant``
attribute below).

    int4.py         q4_* groups (asymmetric / symmetric, AWQ) and GGUF Q4_0 / Q4_1
    int8.py         q8 groups and GGUF Q8_0
    gguf_blocks.py  GGUF blocks read as they are (Q4_0, Q4_1, Q8_0) into the int4 / int8 tables
    vnni.py         the x86 AVX-512 VNNI layouts of the int4 / int8 tables (int8 activations)
    superblocks.py  GGUF superblock types (formats/ggml: K-quants, IQ4, Q5_1) in the int4 / int8 tables
    bitplanes.py    2- to 6-bit codes (Q6_K, Q5_K, Q5_1, Q5_0, Q3_K, Q2_K) as bit planes in the int8 tables
                    (per row on CPUs, a uint32 array a plane on GPUs)
    gpu_factors.py  the GPU layout of the superblock factors (group values as bit planes, d | dmin words)
    half.py         f16 / bf16 weights
    panels.py       the [N / nb, K, nb] panels CPU GEMMs / GEMVs read float and half weights in

A quantization pass (``passes/``) packs each weight into a :class:`Packed` and puts the format's facts on
its kernels as ``perfx.quant``; the schedule templates (``schedules/``) match on them. Neither imports the
other for it: both import this package.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

QUANT_ATTR = "perfx.quant"
# static activation rows up to this run a decode GEMV (the passes route them, the GEMV templates take
# them); more rows (prefill) go to the GEMM
GEMV_MAX_ROWS = 8


def read_quant_info(func: Any) -> dict[str, Any] | None:
    """The parsed ``perfx.quant`` attribute of ``func`` (the JSON facts: bits, N, K, group, layout, kind,
    ...); None when it has none or it is not JSON. No TVM import: any object with ``attrs`` will do."""
    attrs = getattr(func, "attrs", None)
    if attrs is None or QUANT_ATTR not in attrs:
        return None
    try:
        return json.loads(str(attrs[QUANT_ATTR]))
    except ValueError:
        return None


@dataclass
class Packed:
    """One quantized weight: its replacement arrays and its kernels' reference PrimFuncs."""

    family: str  # kernel-name prefix: "q4", "q8"
    tag: str  # format tag in kernel names, e.g. "g32s" (int4 symmetric, groups of 32)
    n: int
    k: int
    arrays: list[tuple[str, np.ndarray]]  # (parameter-name suffix, array), kernel-argument order
    compute: Callable[..., Any]  # (kind, rows, ids_dtype="int64") -> PrimFunc
    vnni: Callable[[], Packed] | None = None  # the same weight in the int8-activation (VNNI) layout
    int8_gemm: bool = True  # (VNNI layouts) prefill may run the int8 GEMM; else dequantize + float GEMM

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for _, a in self.arrays))
