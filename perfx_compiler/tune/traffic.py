"""What a candidate must at least move and compute, so the tuner can time it like the model runs
it (cold caches for decode GEMVs) and refuse timings no machine could produce.

Decode GEMVs stream their weights from DRAM in the model: a decode step reads every layer's
weights once (SmolLM2-135M gguf: ~80 MB, over this host's 32 MiB LLC), so a layer's weights are
evicted before its GEMV runs again. Timed back to back on the same inputs, a 0.2 MB weight stays
in L2 and the tuner ranks configurations by cache speed: warm-tuned VNNI GEMV records made the
model decode 1.21x slower than the template defaults (docs/decisions/tuning-records.md).
So matmul-kind workloads with at most ``COLD_MAX_ROWS`` rows (decode-shaped, whatever the
template: gemv_*, gemm_half_cpu at M=1, the M=1 bucket of a prefill GEMM) are timed cold.
Prefill GEMMs reuse each weight over many rows (compute-bound), gathers and attention read
activations the previous kernel just wrote: those stay warm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from perfx_compiler.formats import GEMV_MAX_ROWS
from perfx_compiler.targets import TargetDescription

COLD_MAX_ROWS = GEMV_MAX_ROWS  # the VNNI / int4 / int8 GEMV templates' static rows
# A correct timing cannot beat these multiples of the target file's ceilings. Cold GEMVs measured
# here reach ~1.4x the stated 30 GB/s (benchmarks of the VNNI GEMV); a timing bug is off by 100x+.
MAX_BANDWIDTH_X = 4.0
# x the fp32 peak: int8 VNNI does 4 multiply-adds per 32-bit lane (vpdpbusd), so 4x is reachable
# in principle; 8x leaves room for a conservative peak in the target file.
MAX_COMPUTE_X = 8.0
_DEFAULT_LLC = 32 << 20


@dataclass(frozen=True)
class KernelTraffic:
    input_bytes: int  # bytes of every input tensor (a matmul reads all of x, weights, scales)
    flops: float  # 2 * rows * N * K
    rows: int
    cold: bool  # time with the weights flushed from the caches before each call


def llc_bytes() -> int:
    """Last-level cache size of this host (sysfs), 32 MiB when unknown."""
    best = 0
    for idx in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if int((idx / "level").read_text()) < 3:
                continue
            text = (idx / "size").read_text().strip().upper()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            best = max(best, int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return best or _DEFAULT_LLC


def _nbytes(shape: tuple[int, ...] | None, dtype: str) -> int:
    if shape is None:
        return 0
    import numpy as np

    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def matmul_rows(dims: dict[str, int], m_value: int | None) -> int:
    """Rows of a matmul workload: its static M (gemv_qvnni_cpu: batch x rows), else the M it is
    timed at (a symbolic-M function's bucket); 0 when neither is known."""
    if "B" in dims and "MM" in dims:  # gemv_qvnni_cpu: static batch x rows
        return int(dims["B"]) * int(dims["MM"]) or int(m_value or 0)
    return int(dims.get("M") or 0) or int(m_value or 0)


def decode_shaped(dims: dict[str, int] | None, bucket: int | None) -> bool:
    """Whether a record's workload (its dims and M bucket) is one the measurer times cold, judged
    from the record alone: a matmul (N and K dims) over at most ``COLD_MAX_ROWS`` rows. Used for
    records that predate the ``timing`` provenance field (records.py: such records are stale)."""
    if not dims or not {"N", "K"} <= dims.keys():
        return False
    return 0 < matmul_rows(dims, bucket) <= COLD_MAX_ROWS


def kernel_traffic(func: Any, workload: Any, m_value: int) -> KernelTraffic | None:
    """Input bytes and flops of a matmul-kind workload at M = m_value; None for other kernels
    (a gather reads one row of its table, attention a pinned cache length: their inputs' size
    says nothing about the bytes they must read)."""
    from perfx_compiler.tune.measure import output_names, param_specs

    dims = workload.dims
    if not {"N", "K"} <= dims.keys() or workload.info.get("kind", "matmul") != "matmul":
        return None
    rows = matmul_rows(dims, m_value)
    outs = output_names(func)
    every = param_specs(func, m_value)
    specs = [(name, shape, dtype) for name, shape, dtype in every if shape is not None]
    inputs = [(name, _nbytes(shape, dtype)) for name, shape, dtype in specs if name not in outs]
    total = sum(b for _, b in inputs)
    # The flush (measure.time_module) keeps the first argument hot, as the model does with x
    # (written by the previous kernel): only right when the first argument is x, not a weight;
    # otherwise time warm rather than flush the wrong buffers.
    first = every[0] if every else None
    first_small = (first is not None and first[1] is not None and first[0] not in outs
                   and 4 * _nbytes(first[1], first[2]) <= total)
    cold = rows <= COLD_MAX_ROWS and first_small
    return KernelTraffic(total, 2.0 * rows * dims["N"] * dims["K"], rows, cold)


def implausible(seconds: float, traffic: KernelTraffic | None, target: TargetDescription, cold: bool) -> str | None:
    """Why a measured time is physically impossible on ``target`` (a measurement error, not a
    best configuration), or None. Bandwidth is checked when the inputs come from DRAM: timed cold,
    or larger than the LLC."""
    if traffic is None or not math.isfinite(seconds):
        return None
    if seconds <= 0:
        return f"implausible timing: {seconds:g} s"
    bandwidth = target.memory_bandwidth_gbs
    if bandwidth and (cold or traffic.input_bytes > llc_bytes()):
        gbs = traffic.input_bytes / seconds / 1e9
        if gbs > MAX_BANDWIDTH_X * bandwidth:
            return (f"implausible timing: {seconds * 1e6:.3g} us for {traffic.input_bytes / 1e6:.3g} MB of inputs is "
                    f"{gbs:.0f} GB/s, over {MAX_BANDWIDTH_X:g}x the target's {bandwidth:g} GB/s")
    peak = target.peak_gflops_fp32
    if peak and traffic.flops:
        gflops = traffic.flops / seconds / 1e9
        if gflops > MAX_COMPUTE_X * peak:
            return (f"implausible timing: {seconds * 1e6:.3g} us is {gflops:.0f} GFLOP/s, over "
                    f"{MAX_COMPUTE_X:g}x the target's {peak:g} GFLOP/s fp32 peak")
    return None
