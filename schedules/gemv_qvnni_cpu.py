"""x86 AVX-512 VNNI kernels for quantized linears with int8 activations (functions tagged
``perfx.quant`` with ``layout: vnni``: int4 q4_g32/64/128 sym and asym, GGUF Q4_0 / Q4_1 / Q8_0,
q8 — the ``--activations int8`` path).

* GEMV (static rows <= 8, decode): x quantized to int8 per weight group inside the call, then
  ``vpdpbusd`` (64 u8 x s8 MACs per instruction) per 64-column step and unit (a row pair for
  int4, a row for int8); per-group float scales through one ``vpermps`` per step, zero point /
  min once per 16 groups (see ``_vnni_kernels``). Knobs (``_vnni_kernels.gemv``): ``units``,
  ``tasks``, ``unroll``, ``prefetch``, ``split``, ``hinib``, ``sprefetch`` (searched); ``nta``,
  ``ploc``, ``tquant`` (default config only: their gain is in the decode step around the GEMV,
  which one kernel's timing cannot see). Why each default: docs/decisions/gemv-qvnni-cpu.md.
* GEMV with a fused prologue (``passes/fuse_gemv_prologue.py``, decode, int4 or int8): x made inside the call
  from add_rms_norm's or swiglu's inputs, group by group as it is quantized; or with a swiglu epilogue
  (gate|up GEMV: each task takes gate and up rows of the same range and writes their h); keyed as the
  plain GEMV of its shape, so the same records and knobs apply.
* Dequantize (prefill) and the embedding gather read the same layout.

``match`` declines targets without AVX-512 VNNI (their passes never produce this layout: the
pipeline resolves activations to f32 there).
"""

from __future__ import annotations

import functools
from typing import Any

from perfx_compiler.formats import GEMV_MAX_ROWS
from perfx_compiler.formats.vnni import has_avx512_vnni
from perfx_compiler.formats.vnni_lowbit import lane_groups
from perfx_compiler.schedule_template import (
    ScheduleConfigError,
    ScheduleTemplate,
    Workload,
    is_cpu_target,
    make_workload,
)
from perfx_compiler.targets import TargetDescription
from schedules import _vnni_dequant
from schedules import _vnni_kernels as vk
from schedules.gemv_int4_cpu import _like, panel_of, quant_info

MAX_ACC = 16  # rows x activation rows held in zmm accumulators (x2 with the scale vectors)
MAX_REGS = 24  # zmm registers for accumulators and scale vectors (of 32: the rest for codes/activations)


def _info(func: Any) -> dict[str, Any] | None:
    info = quant_info(func)
    if info is None:
        return None
    return info if info.get("layout") == "vnni" and info.get("bits") in (2, 3, 4, 5, 6, 8) else None


def _plain_gemv(info: dict[str, Any], rows: tuple[int, int] | None) -> Any:
    """The unfused GEMV of a fused one's shape, as the passes emit it (the function a record's key hashes)."""
    return _plain_gemv_of(int(info["N"]), int(info["K"]), int(info["group"]), int(info["bits"]), bool(info.get("sym")),
                          bool(info.get("offset")), rows or (1, 1), int(info.get("sb", 0)), str(info.get("lut", "")))


@functools.lru_cache(maxsize=64)
def _plain_gemv_of(n: int, k: int, group: int, bits: int, sym: bool, offset: bool, rows: tuple[int, int],
                   sb: int = 0, lut: str = "") -> Any:
    # cached: a model has a handful of fused shapes, each matched once per layer and again per tuning task
    from perfx_compiler.formats.vnni import vnni_compute
    from perfx_compiler.kernels.tir_queries import OPAQUE

    return vnni_compute(n, k, group, bits, sym, offset, "matmul", rows, sb=sb, lut=lut).with_attr("op_pattern", OPAQUE)


def _rows(func: Any, kind: str) -> tuple[int, int] | None:
    buf = func.params[0] if kind == "matmul" else None
    if buf is None:
        return None
    dims = [getattr(d, "value", None) for d in list(buf.shape)[:2]]
    return (dims[0], dims[1]) if all(isinstance(d, int) for d in dims) else None


class GemvQVnniCPU(ScheduleTemplate):
    name = "gemv_qvnni_cpu"
    knobs = ("units", "tasks", "unroll", "prefetch", "split", "hinib", "sprefetch", "nta", "ploc", "tquant")
    version = 1

    def match(self, func: Any, target: TargetDescription) -> Workload | None:
        if not is_cpu_target(target) or not has_avx512_vnni(target):
            return None
        info = _info(func)
        if info is None:
            return None
        kind = info.get("kind", "matmul")
        rows = _rows(func, kind)
        dims = {"N": int(info["N"]), "K": int(info["K"]), "G": int(info["group"]), "bits": int(info["bits"]),
                "B": rows[0] if rows else 0, "MM": rows[1] if rows else 0}
        prologue, epilogue = str(info.get("prologue", "")), str(info.get("epilogue", ""))
        # A GEMV with a fused prologue or epilogue (passes/fuse_gemv_prologue.py) is keyed as the plain
        # GEMV of its shape: the row schedule is the same, so its records (tuned before the fusion) apply
        keyed = _plain_gemv(info, rows) if prologue or epilogue else func
        return make_workload(
            self.name, keyed, target, dims, symbolic=None if rows or kind != "matmul" else "M",
            info={"kind": kind, "sym": bool(info.get("sym")), "offset": bool(info.get("offset")), "nb": panel_of(func),
                  "sb": int(info.get("sb", 0)),
                  "prologue": prologue, "eps": float(info.get("eps", 0.0)), "epilogue": epilogue,
                  # only when set: the other layouts' workload keys stay as they were
                  **({"lut": str(info["lut"])} if info.get("lut") else {})},
            version=self.version,
        )

    def _units(self, d: dict[str, int]) -> int:
        return -(-d["N"] // vk.ROWS_PER_UNIT[d["bits"]])

    def space(self, workload: Workload, target: TargetDescription) -> dict[str, list]:
        d = workload.dims
        kind = workload.info.get("kind")
        tasks = [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= max(1, d["N"] // 2)]
        if kind == "take":
            return {}  # the gather (_vnni_dequant.take) has no knob: tuning `tasks` timed one config under many names
        if kind != "matmul":
            return {"tasks": tasks}
        return {
            "units": {2: [1, 2], 3: [1], 4: [1, 2, 4], 5: [1], 6: [1, 2]}.get(d["bits"], [1, 2, 4, 8]),
            "tasks": tasks,
            "unroll": [1, 2, 4, 8],
            "prefetch": [0, 16, 64, 128, 256],  # software prefetch of the codes, in 64-byte steps ahead (0: off)
            "split": [1] if lane_groups(d["bits"]) else [1, 2],  # (lane groups: one float FMA a chunk)
            "hinib": [0, 1] if d["bits"] == 4 and not workload.info.get("lut") else [0],
            "sprefetch": [0, 1],  # scales (and zero/min) prefetched as far ahead as the codes
            # nta, ploc and tquant are default-config knobs, not searched: their gain shows in the whole
            # decode step, not in one kernel's timing (docs/decisions/gemv-qvnni-cpu.md)
        }

    def builtin_default(self, workload: Workload, target: TargetDescription) -> dict[str, Any]:
        """Each choice and the measurement behind it: docs/decisions/gemv-qvnni-cpu.md."""
        d = workload.dims
        if workload.info.get("kind") != "matmul":
            return {"tasks": 16 if d["N"] >= 64 else 2}
        long_rows = d["bits"] == 4 and vk.plan(d["K"], d["G"])["KP"] >= 2048
        rpu = vk.ROWS_PER_UNIT[d["bits"]]
        # one unit per iteration: one code stream per task reads 1.2-1.75x faster than two or four at every
        # shape measured, short rows too (and the tuner picks it for every SmolLM2 GEMV)
        units = 1
        m = max(1, d["B"] * d["MM"])
        # 5- and 3-bit octets: one step per inner iteration (Q5_0 step x1.09 on one core's hyperthreads,
        # x1.01 on two cores; Q3_K GEMVs x1.43 on two cores, level on hyperthreads; the tuner picks 1-2
        # for Gemma 3's K = 640 Q5_0 GEMVs too). 4-, 6-bit: 4 (unroll 1 x0.98 / x0.97 on two cores)
        unroll = 1 if d["bits"] in (3, 5) else max(4, d["G"] // vk.STEP)
        # two accumulators per row while they fit the registers with the scale vectors (6-bit: int32 sums
        # over a chunk, one float FMA a chunk: nothing to split)
        split = 2 if units * rpu * m * 3 <= MAX_REGS and not lane_groups(d["bits"]) else 1
        hinib = 1 if d["bits"] == 4 and not workload.info.get("lut") else 0  # (no use on table indices)
        if long_rows and m == 1:  # decode's long rows: hinib alone
            split = 1
        # one activation row (decode): one task per core, each quantizing x for itself after the fork
        tquant = int(m == 1)
        return {"units": units, "tasks": max(1, int(target.cores or 1)) if tquant else 16, "unroll": unroll,
                # codes 128 64-byte steps (8 KiB) ahead; 6-bit quads (one stream of 3 lines a step) 96
                # lines (6 KiB): Q6_K ffn_down x1.08, lm_head x1.035 over 128. 5-bit octets keep 128:
                # 64 won x1.05 on one core's hyperthreads but lost x0.91 on two cores, where each core
                # needs more lines in flight (docs/decisions/gemv-qvnni-cpu.md)
                "prefetch": 96 if d["bits"] == 6 else 128,
                "split": split, "hinib": hinib,
                "sprefetch": int(d["N"] <= 4096),  # scale chunks prefetched with the codes, up to N = 4096
                "nta": int(long_rows and m == 1),  # long decode rows: prefetchnta (targets may override)
                "tquant": tquant,
                "ploc": 3}  # the codes' prefetch locality without nta: L1 (targets may override)

    def is_valid(self, workload: Workload, config: dict[str, Any], target: TargetDescription) -> bool:
        return self._why_invalid(workload, config) is None

    def _why_invalid(self, workload: Workload, config: dict[str, Any]) -> str | None:
        d = workload.dims
        tasks = int(config.get("tasks", 1))
        if tasks < 1:
            return "tasks must be >= 1"
        if workload.info.get("kind") != "matmul":
            return None
        if workload.symbolic is not None or d["B"] * d["MM"] > GEMV_MAX_ROWS:
            return "the VNNI GEMV takes static rows <= 8 (the pass emits dequantize + GEMM for more)"
        units, unroll = int(config.get("units", 1)), int(config.get("unroll", 1))
        if int(config.get("prefetch", 0)) < 0:
            return "prefetch distance must be >= 0"
        spc = vk.plan(d["K"], d["G"])["SPC"]
        if units < 1 or units > self._units(d):
            return f"units={units} exceeds the {self._units(d)} row units"
        rpu = vk.ROWS_PER_UNIT[d["bits"]]
        # (a 3- / 5-bit octet's 8 rows are the smallest unit: past 2 activation rows its accumulators spill)
        if units * rpu * d["B"] * d["MM"] > MAX_ACC and not (rpu == 8 and units == 1):
            return f"units={units} x {d['B'] * d['MM']} activation rows needs more than {MAX_ACC} accumulators"
        split = int(config.get("split", 1))
        if split not in (1, 2) or (split > 1 and units * rpu * d["B"] * d["MM"] * 3 > MAX_REGS):
            return f"split={split} must be 1 or 2, and 2 only while 3 vectors per row fit {MAX_REGS} registers"
        if int(config.get("nta", 0)) not in (0, 1):
            return "nta is 0 or 1"
        if int(config.get("ploc", 3)) not in (0, 1, 2, 3):
            return "ploc (the codes' prefetch locality) is 0..3"
        if int(config.get("tquant", 0)) not in (0, 1):
            return "tquant is 0 or 1"
        if int(config.get("sprefetch", 0)) not in (0, 1):
            return "sprefetch is 0 or 1"
        if int(config.get("hinib", 0)) not in (0, 1) or (config.get("hinib") and d["bits"] != 4):
            return "hinib is 0 or 1, and 1 only for int4 codes"
        if workload.info.get("epilogue") and (d["N"] // 2 < units * max(2, rpu) or d["N"] % (2 * rpu)):
            return f"units={units}: the swiglu epilogue splits N={d['N']} rows into gate and up halves of whole units"
        if unroll < 1 or (unroll * vk.STEP) % d["G"] or spc % unroll:
            return f"unroll={unroll} must cover whole groups (G={d['G']}) and divide {spc} steps per chunk"
        return None

    def apply(self, func: Any, workload: Workload, config: dict[str, Any], target: TargetDescription) -> Any:
        why = self._why_invalid(workload, config)
        if why is not None:
            raise ScheduleConfigError(f"invalid VNNI config {config} for {workload.dims}: {why}")
        d, info = workload.dims, workload.info
        args = (d["bits"], d["N"], d["K"], d["G"], info["sym"], info["offset"])
        kind, lut = info.get("kind"), str(info.get("lut", ""))
        if kind == "take":
            kernel = _vnni_dequant.take(*args, sb=int(info.get("sb", 0)), lut=lut)
        elif kind == "dequant":
            kernel = _vnni_dequant.dequant(*args, int(config["tasks"]), int(info.get("nb", 0)), sb=int(info.get("sb", 0)),
                                           lut=lut)
        else:
            # a record tuned before `ploc` existed (or one that does not search it) gets the target's
            # default: the locality is the machine's, not the shape's
            if "ploc" not in config:
                config = {**config, "ploc": self.default_config(workload, target).get("ploc", 3)}
            kernel = vk.gemv(*args, (d["B"], d["MM"]), config, str(info.get("prologue", "")),
                             float(info.get("eps", 0.0)), str(info.get("epilogue", "")), int(info.get("sb", 0)), lut)
        return _like(kernel, func)


TEMPLATE = GemvQVnniCPU()
