"""x86 AVX-512 VNNI kernels for quantized linears with int8 activations (functions tagged
``perfx.quant`` with ``layout: vnni``: int4 q4_g32/64/128 sym and asym, GGUF Q4_0 / Q4_1 / Q8_0,
q8 — the ``--activations int8`` path).

* GEMV (static rows <= 8, decode): x quantized to int8 per weight group inside the call, then
  ``vpdpbusd`` (64 u8 x s8 MACs per instruction) per 64-column step and unit (a row pair for
  int4, a row for int8); per-group float scales through one ``vpermps`` per step, zero point /
  min once per 16 groups (see ``_vnni_kernels``). Knobs: ``units`` per iteration (rows sharing
  each activation load), ``tasks`` (parallel chunks of rows), ``unroll`` (steps per inner loop),
  ``prefetch`` (software prefetch distance of the codes in 64-byte steps, default 128; 0 = hardware
  prefetch only), ``sprefetch`` (the scale / zero chunks prefetched as far ahead, in rows),
  ``pquant`` (x quantized in a parallel loop of its own; 0: on the calling thread), ``tquant`` (x
  quantized by every row task for itself, after the task has requested its first weight lines; the
  decode default, with one task per core), ``qtree`` (x's
  per-group reductions as trees; same codes), ``split``
  (float accumulators per row, by turns over the steps: shorter FMA dependency chains), ``hinib``
  (int4: the odd row's codes as ``q & 0xF0``, 1/16 in its scale: no shift per step).
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

from perfx_compiler.build_switches import build_switch
from perfx_compiler.passes._qvnni import has_avx512_vnni
from perfx_compiler.schedule_template import (
    ScheduleConfigError,
    ScheduleTemplate,
    Workload,
    is_cpu_target,
    make_workload,
)
from perfx_compiler.targets import TargetDescription
from schedules import _vnni_kernels as vk
from schedules.gemv_int4_cpu import _like, panel_of, quant_info

GEMV_MAX_ROWS = 8
MAX_ACC = 16  # rows x activation rows held in zmm accumulators (x2 with the scale vectors)
MAX_REGS = 24  # zmm registers for accumulators and scale vectors (of 32: the rest for codes/activations)


def _info(func: Any) -> dict[str, Any] | None:
    info = quant_info(func)
    if info is None:
        return None
    return info if info.get("layout") == "vnni" and info.get("bits") in (4, 8) else None


def _plain_gemv(info: dict[str, Any], rows: tuple[int, int] | None) -> Any:
    """The unfused GEMV of a fused one's shape, as the passes emit it (the function a record's key hashes)."""
    return _plain_gemv_of(int(info["N"]), int(info["K"]), int(info["group"]), int(info["bits"]), bool(info.get("sym")),
                          bool(info.get("offset")), rows or (1, 1))


@functools.lru_cache(maxsize=64)
def _plain_gemv_of(n: int, k: int, group: int, bits: int, sym: bool, offset: bool, rows: tuple[int, int]) -> Any:
    # cached: a model has a handful of fused shapes, each matched once per layer and again per tuning task
    from perfx_compiler.passes._qvnni import vnni_compute
    from perfx_compiler.passes._relax_util import OPAQUE

    return vnni_compute(n, k, group, bits, sym, offset, "matmul", rows).with_attr("op_pattern", OPAQUE)


def _rows(func: Any, kind: str) -> tuple[int, int] | None:
    buf = func.params[0] if kind == "matmul" else None
    if buf is None:
        return None
    dims = [getattr(d, "value", None) for d in list(buf.shape)[:2]]
    return (dims[0], dims[1]) if all(isinstance(d, int) for d in dims) else None


class GemvQVnniCPU(ScheduleTemplate):
    name = "gemv_qvnni_cpu"
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
                  "prologue": prologue, "eps": float(info.get("eps", 0.0)), "epilogue": epilogue},
            version=self.version,
        )

    def _units(self, d: dict[str, int]) -> int:
        return -(-d["N"] // 2) if d["bits"] == 4 else d["N"]

    def space(self, workload: Workload, target: TargetDescription) -> dict[str, list]:
        d = workload.dims
        kind = workload.info.get("kind")
        tasks = [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= max(1, d["N"] // 2)]
        if kind == "take":
            return {}  # the gather (vk.take) has no knob: tuning `tasks` timed one config under many names
        if kind != "matmul":
            return {"tasks": tasks}
        return {
            "units": [1, 2, 4] if d["bits"] == 4 else [1, 2, 4, 8],
            "tasks": tasks,
            "unroll": [1, 2, 4, 8],
            "prefetch": [0, 16, 64, 128, 256],  # software prefetch of the codes, in 64-byte steps ahead (0: off)
            "split": [1, 2],
            "hinib": [0, 1] if d["bits"] == 4 else [0],
            "sprefetch": [0, 1],  # scales (and zero/min) prefetched as far ahead as the codes
            # pquant (x quantized in a parallel loop of its own) and qtree (its reductions folded in
            # registers) and tquant (x quantized by each task) are configs and env switches, not searched
            # (tquant's gain is in the decode step around the GEMV, not in its own timing): pquant did not beat an A/A pair at
            # TinyLlama's shapes (benchmarks/results/gemv_qvnni_shared_copies_ab.csv), qtree=1 is the
            # default (a fixed saving per call); they would only quadruple the space. nta (prefetchnta for the
            # codes) neither: its gain shows in the whole decode step, not in one kernel's timing
        }

    def builtin_default(self, workload: Workload, target: TargetDescription) -> dict[str, Any]:
        d = workload.dims
        if workload.info.get("kind") != "matmul":
            return {"tasks": 16 if d["N"] >= 64 else 2}
        # Rows of >= 2048 bytes: one unit per iteration. Two units read two code streams whose
        # distance is a multiple of 1 KiB (K=2048: 2.4x slower at 11264x2048 and 2048x2048, 2 threads),
        # and fewer streams suit the prefetchers; short rows (SmolLM2's K=576/1536): two.
        long_rows = d["bits"] == 4 and vk.plan(d["K"], d["G"])["KP"] >= 2048
        units = (1 if long_rows else 2) if d["bits"] == 4 else 4
        m = max(1, d["B"] * d["MM"])
        while units > 1 and (units * (2 if d["bits"] == 4 else 1) * m > MAX_ACC or units > self._units(d)):
            units //= 2
        unroll = max(4, d["G"] // vk.STEP)
        # two accumulators per row while they fit the registers with the scale vectors
        split = 2 if units * (2 if d["bits"] == 4 else 1) * m * 3 <= MAX_REGS else 1
        hinib = 1 if d["bits"] == 4 else 0
        # Long rows of one activation row (decode): split=1, hinib=1. Timed with the TIR pipeline the
        # artifact is built with (accumulators in registers; stack_alloca.compile_kernel), hinib read
        # x1.06-1.19 paired per pass and x1.01-1.03 per-call p10 over plain at all five TinyLlama shapes,
        # 2 threads on two cores (benchmarks/results/gemv_qvnni_long_rows_hinib_2t.csv); whole decode,
        # mirrored, x1.072; over its steady two-core turns 117.8 vs 115.3 tok/s, 82% vs 79% of the probe
        # (decode_ab_tinyllama-q4_0_long_rows_hinib.csv). split=2 read less than hinib alone.
        # The plain choice before (split=1, hinib=0) rested on kernel timings built without that pipeline
        # (gemv_qvnni_long_rows.csv: accumulators in TVM's workspace pool, stored every step) and on
        # artifact A/Bs within their load-order noise (decode_kernels_tinyllama-q4_0_long_rows_*.csv).
        # PERFX_VNNI_GEMV_LONG_ROWS=plain | split: the earlier defaults (A/B switch); the tuner searches both knobs.
        # Several activation rows (batched decode, small prefill buckets; units may drop to 1 there for
        # the accumulators) keep split/hinib: not measured.
        long_mode = build_switch("PERFX_VNNI_GEMV_LONG_ROWS", "hinib")
        if long_rows and m == 1 and long_mode in ("plain", "hinib"):
            split, hinib = 1, int(long_mode == "hinib")
        if build_switch("PERFX_VNNI_GEMV_BASE") == "1":  # A/B baseline: the kernel before split/hinib
            return {"units": units, "tasks": 16, "unroll": unroll, "prefetch": 0}
        # Codes prefetched 128 steps (8 KiB) ahead: the hardware prefetchers alone keep too few lines in
        # flight while the core also computes; one thread read ~75% of the probe's one-thread bandwidth
        # without it. At TinyLlama's shapes, 2 threads, per-call best and 10th percentile GB/s rose
        # 6-27% (benchmarks/gemv_qvnni_shapes_bw.py); 16 steps (1 KiB) did not help.
        prefetch = int(build_switch("PERFX_VNNI_GEMV_PREFETCH", "128"))  # A/B: 0 = hardware only
        # Scale (and zero/min) chunks prefetched as far ahead as the codes, for N <= 4096: at TinyLlama's
        # qkv / o / down, 2 threads, paired x1.02-1.08 and call p10 x1.02-1.06 over two runs (load 0.6
        # and 1.6), reverting it lost 3-8% (call p10, shared weight copies); at gate_up (N=11264) and
        # lm_head (N=32000) it lost 3-4% (call p10, vs an A/A pair within 2%): off there
        # (benchmarks/results/gemv_qvnni_shared_copies_ab.csv, gemv_qvnni_sprefetch_large_ab.csv).
        sprefetch = int(build_switch("PERFX_VNNI_GEMV_SPREFETCH", "1" if d["N"] <= 4096 else "0"))
        # x quantized on the calling thread: a parallel loop of its own (pquant=2) lost 3% at qkv and o,
        # a second pool launch costing more than the quantization it splits (same CSVs)
        pquant = int(build_switch("PERFX_VNNI_GEMV_PQUANT", "0"))  # A/B switch
        # x's per-group max and code sum folded in registers (qtree=1): the N=2 GEMV (launch + x's
        # quantization + one row pair) took 4-15% less than with 15-step chains at K=576..5632
        # (benchmarks/results/gemv_qvnni_overheads.csv, prologue_K vs prologue_K_qtree); the tree
        # through a buffer it replaced had timed no better than an A/A pair (store-forwarding stalls)
        qtree = int(build_switch("PERFX_VNNI_GEMV_QTREE", "1"))  # A/B switch
        # Long rows of one activation row prefetch their codes non-temporally (prefetchnta): TinyLlama's
        # whole decode, mirrored A/B, x1.079 on one thread (80-81% -> 87-89% of the probe) and x1.044 on
        # two (steady turns on one core's two threads: 74.4 -> 77.8 tok/s, 86% -> 90%; the run had no
        # two-core turn), decode_ab_tinyllama-q4_0_prefetchnta*.csv. Per kernel it read within 2% of prefetcht0 on two
        # threads and -4%..+4% on one (gemv_qvnni_nta_2t.csv, _1t.csv): the gain is in the decode step
        # around the GEMVs, which per-kernel timing cannot see, so nta is a default and an A/B switch,
        # not searched. Short rows: not measured.
        nta = int(build_switch("PERFX_VNNI_GEMV_NTA", "1" if long_rows and m == 1 else "0"))
        # Without nta, the codes are prefetched into L1 (3, prefetcht0). Target files may override both
        # per CPU vendor (targets/x86-avx512.json "vendor_templates", applied to `host`): on an Intel
        # Xeon (2 vCPUs, 30 GB/s probe), per pass over DRAM-resident copies, prefetchnta streamed
        # TinyLlama's GEMVs at 12.8-14.5 GB/s, prefetcht0 at 21.6-26.1 and prefetcht1 (2, into L2) at
        # 23.6-28.7 (x1.67-2.16 paired over nta); SmolLM2's short rows at 11.8-12.7 / 19.8-20.9 /
        # 19.6-22.1 (benchmarks/results/intel-xeon/gemv_qvnni_shapes_bw_prefetch.csv).
        ploc = int(build_switch("PERFX_VNNI_GEMV_PLOC", "3"))
        # One activation row (decode): one task per core, each quantizing x for itself after the fork,
        # its first weight lines requested before (tquant=1). The serial quantization on the calling
        # thread and the stream's first misses left the critical path: TinyLlama's whole decode step,
        # replayed in alternation on two cores, 200 rounds: 7.73 -> 7.63 ms over the one-split attention
        # alone (decode_step_ab_tinyllama-q4_0_attention_tquant.csv); end to end with it, fresh processes,
        # x1.025 on two cores (13 pairs) and x1.002 on one core's two threads (15 pairs; decode_tquant_ab.csv,
        # decode_tquant_ab_shared_run.csv). Several rows (batched decode) keep 16 tasks and the
        # quantization on the calling thread: not measured.
        tquant = int(build_switch("PERFX_VNNI_GEMV_TQUANT", "1" if m == 1 and not pquant else "0"))  # A/B switch
        tasks = max(1, int(target.cores or 1)) if tquant else 16
        return {"units": units, "tasks": tasks, "unroll": unroll, "prefetch": prefetch, "split": split,
                "hinib": hinib, "sprefetch": sprefetch, "pquant": pquant, "qtree": qtree, "nta": nta,
                "tquant": tquant, "ploc": ploc}

    def default_config(self, workload: Workload, target: TargetDescription) -> dict[str, Any]:
        config = super().default_config(workload, target)
        # the A/B switches win over a target file's defaults too
        for knob, env in (("nta", "PERFX_VNNI_GEMV_NTA"), ("ploc", "PERFX_VNNI_GEMV_PLOC")):
            if knob in config and (value := build_switch(env)):
                config[knob] = int(value)
        return config

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
        if units * (2 if d["bits"] == 4 else 1) * d["B"] * d["MM"] > MAX_ACC:
            return f"units={units} x {d['B'] * d['MM']} activation rows needs more than {MAX_ACC} accumulators"
        split = int(config.get("split", 1))
        if split not in (1, 2) or (split > 1 and units * (2 if d["bits"] == 4 else 1) * d["B"] * d["MM"] * 3 > MAX_REGS):
            return f"split={split} must be 1 or 2, and 2 only while 3 vectors per row fit {MAX_REGS} registers"
        if int(config.get("nta", 0)) not in (0, 1):
            return "nta is 0 or 1"
        if int(config.get("ploc", 3)) not in (0, 1, 2, 3):
            return "ploc (the codes' prefetch locality) is 0..3"
        if int(config.get("tquant", 0)) not in (0, 1) or (config.get("tquant") and int(config.get("pquant", 0))):
            return "tquant is 0 or 1, and 1 only with pquant 0 (x is quantized by each task)"
        if int(config.get("sprefetch", 0)) not in (0, 1) or int(config.get("qtree", 0)) not in (0, 1) \
                or int(config.get("pquant", 0)) < 0:
            return "sprefetch and qtree are 0 or 1, pquant >= 0"
        if int(config.get("hinib", 0)) not in (0, 1) or (config.get("hinib") and d["bits"] != 4):
            return "hinib is 0 or 1, and 1 only for int4 codes"
        if workload.info.get("prologue") and int(config.get("pquant", 0)):
            return "a fused prologue makes x on the quantizing thread(s): pquant must be 0"
        if workload.info.get("epilogue") and d["N"] // 2 < units * 2:
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
        kind = info.get("kind")
        if kind == "take":
            kernel = vk.take(*args)
        elif kind == "dequant":
            kernel = vk.dequant(*args, int(config["tasks"]), int(info.get("nb", 0)))
        else:
            # a record tuned before `ploc` existed (or one that does not search it) gets the target's
            # default: the locality is the machine's, not the shape's
            ploc = int(config["ploc"]) if "ploc" in config else int(self.default_config(workload, target).get("ploc", 3))
            kernel = vk.gemv(*args, (d["B"], d["MM"]), int(config["units"]), int(config["tasks"]),
                             int(config["unroll"]), int(config.get("prefetch", 0)), int(config.get("split", 1)),
                             bool(config.get("hinib", 0)), int(config.get("sprefetch", 0)),
                             int(config.get("pquant", 0)), int(config.get("qtree", 0)), int(config.get("nta", 0)),
                             int(config.get("tquant", 0)), str(info.get("prologue", "")), float(info.get("eps", 0.0)),
                             str(info.get("epilogue", "")), ploc)
        return _like(kernel, func)


TEMPLATE = GemvQVnniCPU()
