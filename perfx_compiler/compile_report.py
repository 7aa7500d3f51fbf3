"""What ``perfx-compile --report`` prints: every kernel with its schedule template, and kernel-launch
counts per exported function before/after fusion.

A helper over any phase's module (not a pass). After phase 2 every kernel launch is
a ``call_tir``/``call_tir_inplace``; before lowering, each remaining Relax operator call becomes
at least one kernel, so it is counted as one too.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import tvm
from tvm import relax

from perfx_compiler.passes._relax_util import exported

# Operators that never launch a kernel (shape/tuple plumbing, in-place views).
_FREE_OPS = {"relax.shape_of", "relax.shape_to_tensor", "relax.reshape", "relax.null_value"}
_TIR_CALLS = {"relax.call_tir", "relax.call_tir_inplace", "relax.call_dps_packed"}


def _calls(func: relax.Function) -> list[str]:
    """Names of the kernels a function launches, in binding order."""
    out: list[str] = []
    for block in func.body.blocks:
        for b in block.bindings:
            v = b.value
            if not isinstance(v, relax.Call) or not isinstance(v.op, tvm.ir.Op):
                continue
            name = str(v.op.name)
            if name in _TIR_CALLS:
                callee = v.args[0]
                out.append(getattr(callee, "name_hint", str(callee)))
            elif name not in _FREE_OPS:
                out.append(name)
    return out


def kernel_counts(mod: tvm.IRModule) -> dict[str, int]:
    """Kernel launches per call of each exported function (``decode``: per generated token)."""
    return {fn: len(_calls(mod[fn])) for fn in exported(mod)}


def kernel_breakdown(mod: tvm.IRModule, fn: str = "decode") -> dict[str, int]:
    """Launch count per kernel (callee name or operator) of one function."""
    return dict(Counter(_calls(mod[fn])))


def matmul_count(mod: tvm.IRModule, fn: str = "decode") -> int:
    """Linear layers (float or quantized) one call of ``fn`` runs."""
    n = 0
    for name in _calls(mod[fn]):
        if "matmul" in name.lower() or name.startswith("q4_") or name.startswith("q8_"):
            n += 1
    return n


def summary(mod: tvm.IRModule) -> dict[str, Any]:
    """Everything above for ``decode``, as one JSON-friendly dict."""
    return {"kernels": kernel_counts(mod), "decode_matmuls": matmul_count(mod), "decode": kernel_breakdown(mod)}


# --- fusion variants (``perfx-compile --report``, ``benchmarks/fusion_report.py``) -------------------
FUSION_PREFIXES = ("fuse_", "merge_")  # graph fusions; every other pass (formats, layout) stays on


def fusion_variants() -> list[tuple[str, list[str]]]:
    """(label, pass list) from no fusion pass to all of them, adding one fusion at a time in pipeline
    order; the non-fusion passes (quantization, precision, weight layout) are in every variant."""
    from perfx_compiler.pipeline import GRAPH_PASSES

    default = list(GRAPH_PASSES)
    fusions = [n for n in default if n.startswith(FUSION_PREFIXES)]
    on: set[str] = set()
    out = [("unfused", [n for n in default if n not in fusions])]
    for f in fusions:
        on.add(f)
        out.append((f"+ {f}", [n for n in default if n not in fusions or n in on]))
    return out


def variant_counts(desc: Any, target: str = "host", **options: Any) -> list[dict[str, Any]]:
    """Kernel launches per call of decode / prefill for each fusion variant, counted in the module
    after phase 2 (lower: legalized and fused, every launch a call_tir) of a real compile."""
    from perfx_compiler.pipeline import lower_model

    rows = []
    for label, passes in fusion_variants():
        mod, _ = lower_model(desc, target, passes=passes, **{"batching": False, **options})
        counts = kernel_counts(mod)
        rows.append({"variant": label, "passes": passes, "decode": counts["decode"], "prefill": counts["prefill"]})
    return rows


def format_counts(rows: list[dict[str, Any]], title: str) -> str:
    lines = [title, f"  {'variant':<28} {'decode':>7} {'prefill':>8} {'change':>7}"]
    prev = None
    for i, r in enumerate(rows):
        label = r["variant"] + ("  (= default)" if i == len(rows) - 1 else "")
        change = "" if prev is None else f"{r['decode'] - prev:+d}"
        lines.append(f"  {label:<28} {r['decode']:>7} {r['prefill']:>8} {change:>7}")
        prev = r["decode"]
    first, last = rows[0]["decode"], rows[-1]["decode"]
    lines.append(f"  decode kernels: {first} -> {last} ({100 * (last - first) / max(first, 1):+.0f}%) with all fusions")
    return "\n".join(lines)


def decode_ms(artifact: Any, steps: int = 32) -> float:
    """Median wall time of one decode step of a compiled artifact on this machine (after a 16-token
    prefill and 4 warm-up steps)."""
    import time

    import numpy as np

    from perfx_compiler.runtime.engine import Engine

    eng = Engine(artifact)
    logits = eng.prefill([i % eng.vocab_size for i in range(1, 17)])
    times = []
    for i in range(steps + 4):
        tok = int(np.argmax(logits))
        t = time.perf_counter()
        logits = eng.decode(tok)
        if i >= 4:
            times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def schedule_table(rows: list[dict[str, Any]], title: str = "kernels and their schedules") -> str:
    """One line per kernel (PrimFunc): the template that scheduled it and where its configuration
    came from (record: a tuning record; default: the template's default; pre-scheduled: a
    hand-written kernel; gpu_adapt: moved to the device by the generic net), from the manifest's
    ``schedules`` list. Kernels nothing scheduled (best effort) come first, marked."""
    rows = sorted(rows, key=lambda r: (r.get("template") is not None, r["kernel"]))
    width = max([len(r["kernel"]) for r in rows] + [6])
    counts = Counter(r.get("template") or "UNSCHEDULED" for r in rows)
    lines = [f"{title} ({len(rows)}: " + ", ".join(f"{n} {t}" for t, n in counts.most_common()) + "):",
             f"  {'kernel':<{width}} {'template':<18} config from"]
    for r in rows:
        template = r.get("template") or "UNSCHEDULED"
        why = f"  [tried: {'; '.join(r['failures'])}]" if r.get("failures") else ""
        lines.append(f"  {r['kernel']:<{width}} {template:<18} {r.get('source', '')}{why}")
    return "\n".join(lines)


def artifact_schedule_table(artifact: Any) -> str:
    """:func:`schedule_table` of a compiled artifact's manifest."""
    import json
    from pathlib import Path

    manifest = json.loads((Path(artifact) / "perfx-config.json").read_text())
    rows = manifest.get("schedules")
    if not rows:
        return f"kernels and their schedules: not recorded in {artifact} (compiled before they were)"
    return schedule_table(rows, f"kernels and their schedules in {artifact}")


def compile_report(model: str, target: str, artifact: Any, **options: Any) -> str:
    """What ``perfx-compile --report`` prints: every kernel of the artifact with its template, decode/prefill kernel launches per fusion variant
    (each lowered for real), this artifact's decode step time when it runs here, and where the
    per-variant decode times are measured."""
    from perfx_compiler.model.loader import load_model
    from perfx_compiler.targets import load_target

    desc = load_model(model, max_context=options.get("max_context"))
    rows = variant_counts(desc, target, **options)
    q = options.get("quantization", "auto")
    text = [artifact_schedule_table(artifact),
            format_counts(rows, f"kernel launches per decode step / prefill call ({model}, target {target}, "
                                f"quantization {q}; counted in the lowered Relax module of each variant):")]
    if load_target(target).name == load_target("host").name:
        text.append(f"decode step of {artifact} (all fusions): {decode_ms(artifact):.2f} ms (median of 32 steps)")
    else:
        text.append(f"decode step of {artifact}: not timed (target {target} does not run on this machine)")
    text.append("decode time of each variant: python benchmarks/fusion_report.py "
                "(benchmarks/results/fusion_report.csv + .png)")
    return "\n".join(text)
