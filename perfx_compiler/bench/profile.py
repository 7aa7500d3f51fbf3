"""Per-kernel profile of a PerfX artifact: time share and roofline position of every kernel.

TVM 0.27's Relax VM has no ``profile=True`` mode any more; it has an instrumentation hook
(``VirtualMachine.set_instrument``) called before and after every call instruction, which is
what this module times with. The hook costs a few microseconds of Python per call, so shares
of tiny kernels are overstated; ``overhead`` in the report is the instrumented step time
minus the plain step time measured right before.

Bytes and FLOPs per call are estimated from the arguments (the artifact carries no TIR):
* a 2-D argument with the shape of one of the artifact's weights is a weight, read whole;
  if it is the first argument the kernel is a lookup (embedding) and reads one row per token;
* KV-cache arguments are read up to the current length; RoPE tables one row per token;
* a kernel with a weight ``[N, ...]`` after a float activation ``[..., K]`` does 2*rows*N*K FLOPs
  (a "matmul" kernel whose 2-D argument ``[N, K]`` is not a stored weight, e.g. the dequantized
  scratch of a prefill, too); attention does 4 * seq * (ctx - (seq-1)/2) * heads * head_dim
  (causal); anything else one FLOP per output element.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class KernelStat:
    phase: str
    kernel: str
    calls: int = 0
    seconds: float = 0.0
    bytes: float = 0.0
    flops: float = 0.0
    shapes: str = ""

    @property
    def gbs(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def gflops(self) -> float:
        return self.flops / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class PhaseProfile:
    phase: str  # "decode", "prefill128", ...
    steps: int
    plain_step_s: float  # uninstrumented time per step
    kernels: list[KernelStat] = field(default_factory=list)

    @property
    def kernel_step_s(self) -> float:
        return sum(k.seconds for k in self.kernels) / max(self.steps, 1)


def _shape(a: Any) -> tuple[int, ...] | None:
    s = getattr(a, "shape", None)
    if s is None:
        return None
    try:
        return tuple(int(d) for d in s)
    except (TypeError, ValueError):
        return None


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    bits = np.dtype(dtype).itemsize * 8 if dtype not in ("int4", "uint4") else 4
    return math.prod(shape) * bits // 8


class _Estimator:
    def __init__(self, manifest: dict[str, Any]):
        self.weight_shapes = {tuple(w["shape"]) for w in manifest["weights"] if len(w["shape"]) == 2}
        self.rope_shapes = {tuple(w["shape"]) for w in manifest["weights"] if w["name"].startswith("rope_")}
        self.weight_shapes -= self.rope_shapes
        self.cache_shape = tuple(manifest["kv_cache"]["shape"])
        m = manifest["model"]
        self.max_ctx = int(m["max_context"])
        self.heads, self.head_dim = int(m["num_heads"]), int(m["head_dim"])

    def estimate(self, name: str, args: Sequence[Any], seq: int, ctx: int) -> tuple[float, float]:
        """(bytes, flops) of one call with ``seq`` new tokens after which the sequence holds ``ctx``."""
        shapes = [(_shape(a), str(getattr(a, "dtype", ""))) for a in args]
        arrays = [(s, d) for s, d in shapes if s is not None]
        if not arrays:
            return 0.0, 0.0
        nbytes = 0.0
        weight: tuple[int, ...] | None = None
        lookup = False
        for i, (s, d) in enumerate(arrays):
            size = _nbytes(s, d)
            if s == self.cache_shape:
                size = size * ctx / self.max_ctx
            elif s in self.rope_shapes:
                size = size * seq / self.max_ctx
            elif len(s) == 2 and s in self.weight_shapes:
                if i == 0:
                    lookup = True
                    size = size * seq / s[0]
                else:
                    weight = s
            nbytes += size
        out = arrays[-1][0]
        act = arrays[0][0]
        if weight is None and not lookup and "matmul" in name and act:
            # a float matmul over a dequantized scratch weight [N, K] (prefill of a quantized model)
            for s2, _ in arrays[1:-1]:
                if len(s2) == 2 and s2[1] == act[-1] and s2 != self.cache_shape:
                    weight = s2
                    break
        if "attention" in name:
            # causal: query i sees ctx - seq + i + 1 keys, on average ctx - (seq - 1) / 2
            flops = 4.0 * seq * (ctx - (seq - 1) / 2) * self.heads * self.head_dim
        elif weight is not None and not lookup and len(act) >= 1:
            k = act[-1]
            rows = math.prod(act[:-1]) if len(act) > 1 else 1
            flops = 2.0 * rows * weight[0] * k
        else:
            flops = float(math.prod(out))
        return nbytes, flops


def profile_engine(
    engine: Any,
    prompt: Sequence[int],
    decode_steps: int = 16,
    prefill_lens: Sequence[int] = (128, 512),
    seed: int = 0,
    reps: int = 3,
) -> list[PhaseProfile]:
    """Profile decode (after ``prompt``) and prefill of each length on a PerfX ``Engine``.

    Each phase runs twice plain (the step time) and ``reps`` times instrumented; a kernel's
    time is its median over the instrumented runs (a preempted run does not skew it).
    """
    est = _Estimator(engine.manifest)
    engine.keep_vm_decode("profiled")  # the per-kernel times come from the VM's instrument hook
    vm = engine.vm
    rng = np.random.default_rng(seed)
    vocab = engine.vocab_size
    state: dict[str, Any] = {"t0": 0.0, "on": False, "phase": "", "seq": 1, "ctx": 1, "stats": {}}

    def instrument(func: Any, sym: str, before: bool, ret: Any, *args: Any) -> int:
        if not state["on"]:
            return 0
        if before:
            state["t0"] = time.perf_counter()
            return 0
        dt = time.perf_counter() - state["t0"]
        key = str(sym)
        st = state["stats"].get(key)
        if st is None:
            st = state["stats"][key] = KernelStat(state["phase"], key)
            st.shapes = " ".join(str(list(s)) for s in (_shape(a) for a in args) if s is not None)[:200]
        st.calls += 1
        st.seconds += dt
        b, f = est.estimate(key, args, state["seq"], state["ctx"])
        st.bytes += b
        st.flops += f
        return 0

    def run_phase(phase: str, fn: Any, steps: int, seq: int) -> PhaseProfile:
        plain = [fn() for _ in range(2)]
        runs: list[dict[str, KernelStat]] = []
        state.update(phase=phase, seq=seq)
        vm.set_instrument(instrument)
        try:
            for _ in range(reps):
                state["stats"] = {}
                fn()
                runs.append(state["stats"])
        finally:
            state["on"] = False
            vm.set_instrument(None)
        merged = []
        for key, st in runs[0].items():
            times = sorted(r[key].seconds for r in runs if key in r)
            st.seconds = times[len(times) // 2]
            merged.append(st)
        prof = PhaseProfile(phase, steps, min(plain) / steps)
        prof.kernels = sorted(merged, key=lambda k: -k.seconds)
        return prof

    out: list[PhaseProfile] = []
    n_prompt = len(prompt)

    def decode_run() -> float:
        engine.reset()
        engine.prefill(prompt)
        tok = int(rng.integers(100, max(101, min(vocab, 20000))))
        t = time.perf_counter()
        state["on"] = True
        for i in range(decode_steps):
            state["ctx"] = n_prompt + i + 1
            tok = int(np.argmax(engine.decode(tok)))
        state["on"] = False
        return time.perf_counter() - t

    out.append(run_phase("decode", decode_run, decode_steps, 1))
    for n in prefill_lens:
        if n > engine.max_context:
            continue
        ids = rng.integers(100, max(101, min(vocab, 20000)), size=n).tolist()

        def prefill_run(ids: list[int] = ids) -> float:
            engine.reset()
            state["ctx"] = len(ids)
            t = time.perf_counter()
            state["on"] = True
            engine.prefill(ids)
            state["on"] = False
            return time.perf_counter() - t

        out.append(run_phase(f"prefill{n}", prefill_run, 1, n))
    return out


def profile_rows(
    profiles: Sequence[PhaseProfile], bandwidth_gbs: float, target: dict[str, float]
) -> list[dict[str, Any]]:
    """CSV rows: one per (phase, kernel), with shares and roofline fractions."""
    rows = []
    for p in profiles:
        total = sum(k.seconds for k in p.kernels) or 1.0
        for k in p.kernels:
            ai = k.flops / k.bytes if k.bytes else 0.0
            roof = min(target.get("peak_gflops_fp32", 0.0), ai * bandwidth_gbs) if ai else 0.0
            rows.append(
                {
                    "phase": p.phase,
                    "kernel": k.kernel,
                    "calls_per_step": round(k.calls / p.steps, 2),
                    "us_per_step": round(k.seconds / p.steps * 1e6, 1),
                    "share": round(k.seconds / total, 4),
                    "gb_s": round(k.gbs, 2),
                    "gflop_s": round(k.gflops, 2),
                    "flop_per_byte": round(ai, 3),
                    "roofline_gflop_s": round(roof, 1),
                    "frac_of_roofline": round(k.gflops / roof, 3) if roof else "",
                    "frac_of_measured_bw": round(k.gbs / bandwidth_gbs, 3) if bandwidth_gbs else "",
                    "plain_step_ms": round(p.plain_step_s * 1e3, 3),
                    "instrumented_kernel_ms": round(p.kernel_step_s * 1e3, 3),
                    "shapes": k.shapes,
                }
            )
    return rows


def print_profile(
    profiles: Sequence[PhaseProfile], bandwidth_gbs: float, target: dict[str, float], top: int = 12
) -> None:
    """Each phase's top kernels: share, GB/s and GFLOP/s against the ceilings."""
    bw_t, peak = target.get("memory_bandwidth_gbs", 0.0), target.get("peak_gflops_fp32", 0.0)
    for p in profiles:
        total = sum(k.seconds for k in p.kernels) or 1.0
        print(
            f"\n[{p.phase}] plain {p.plain_step_s * 1e3:.2f} ms/step, kernels (instrumented) "
            f"{p.kernel_step_s * 1e3:.2f} ms/step; ceilings: measured {bandwidth_gbs:.1f} GB/s, "
            f"target {bw_t:.0f} GB/s / {peak:.0f} GFLOP/s"
        )
        print(f"  {'share':>6} {'us/step':>9} {'calls':>6} {'GB/s':>7} {'GFLOP/s':>8} {'%bw':>5}  kernel")
        for k in p.kernels[:top]:
            pct = 100 * k.gbs / bandwidth_gbs if bandwidth_gbs else 0.0
            print(
                f"  {100 * k.seconds / total:5.1f}% {k.seconds / p.steps * 1e6:9.1f} {k.calls / p.steps:6.1f} "
                f"{k.gbs:7.2f} {k.gflops:8.2f} {pct:4.0f}%  {k.kernel}"
            )


def plot_roofline(
    profiles: Sequence[PhaseProfile], bandwidth_gbs: float, target: dict[str, float], path: str | Path, title: str = ""
) -> Path:
    """Log-log roofline: kernels as points (area ~ time share), target and measured ceilings as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    xs = np.logspace(-2, 3, 200)
    peak = target.get("peak_gflops_fp32", 0.0) or 1e3
    bw_t = target.get("memory_bandwidth_gbs", 0.0)
    if bandwidth_gbs:
        ax.plot(xs, np.minimum(peak, xs * bandwidth_gbs), "k-", lw=1.5, label=f"measured {bandwidth_gbs:.1f} GB/s")
    if bw_t:
        ax.plot(xs, np.minimum(peak, xs * bw_t), "k--", lw=1, label=f"target {bw_t:.0f} GB/s, {peak:.0f} GFLOP/s")
    markers = {"decode": "o"}
    for p in profiles:
        total = sum(k.seconds for k in p.kernels) or 1.0
        pts = [(k.flops / k.bytes, k.gflops, k.seconds / total, k.kernel) for k in p.kernels if k.bytes and k.flops]
        if not pts:
            continue
        x, y, s, names = zip(*pts, strict=True)
        ax.scatter(x, y, s=[max(8.0, 600 * v) for v in s], alpha=0.6, marker=markers.get(p.phase, "s"), label=p.phase)
        for xi, yi, si, n in zip(x, y, s, names, strict=True):
            if si > 0.08:
                ax.annotate(n[:28], (xi, yi), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte, estimated)")
    ax.set_ylabel("GFLOP/s")
    ax.set_title(title or "PerfX kernels roofline")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
