"""Per-kernel A/B of decode artifacts inside the model: each kernel timed where the decode step runs it.

A standalone GEMV bench reads its weights cold but its activation row, output and code paths in
whatever state its own loop left them; inside a decode step a kernel follows RMSNorm, attention or
another GEMV. This script times every kernel call of one decode step *in the step's sequence*:

* one decode step of each artifact is traced through the VM's instrumentation hook (kernel, symbol,
  argument tensors), as ``decode_overhead.py`` does;
* per round (artifact order reversed every round), the recorded calls are replayed back to back by a
  small C++ loop ``--steps`` times, with each call timed on its own (monotonic clock); the model's
  weights (hundreds of MB) are far bigger than the L3, so every GEMV reads its weights from DRAM as
  in a real decode step, while x comes warm from the kernel before;
* per kernel symbol: the median over steps of the summed time of its calls in a step; per round and
  artifact; then the median over rounds, and the per-round paired ratio to the first artifact.

Kernels are matched across artifacts by symbol name (both artifacts of one model, one knob apart,
have the same symbols). GEMV weight GB/s use the bytes of the weight arguments (2-D+ tensors whose
byte size is >= 1 MiB, the codes/scales a decode GEMV reads; the KV cache of attention is reported as
bytes too but is not a weight).

    python benchmarks/decode_kernel_ab.py /tmp/a /tmp/b --labels split_hinib,plain --name tinyllama-q4_0_long_rows
        [--rounds 8] [--steps 30] [--threads 2] [--position 32] [--shared-args]

``--shared-args``: the second artifact's kernels are called on the first artifact's tensors, so both
read the same weight memory (placement alone moved A/A pairs by 5-8%); pass one artifact twice for
an A/A check of either mode.

Writes benchmarks/results/decode_kernels_<name>.csv (rows per round, then medians).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
from _common import RESULTS, write_csv


def build_replay() -> Any:
    """decode_overhead.py's C++ replay loop, every call timed on its own."""
    from decode_overhead import build_replay_module

    return build_replay_module().replay_each


def _nbytes(a: Any) -> int:
    shape = getattr(a, "shape", None)
    if shape is None:
        return 0
    return int(np.prod([int(s) for s in shape])) * np.dtype(str(a.dtype)).itemsize


class Traced:
    """One artifact's decode step as a list of kernel calls (symbol, function, arguments)."""

    def __init__(self, label: str, art: str, prompt: list[int]):
        from perfx_compiler.runtime import decode_replay
        from perfx_compiler.runtime.engine import Engine

        self.label, self.art = label, art
        self.engine = e = Engine(art, verify=False)
        e.reset()
        tok = int(np.argmax(e.prefill(prompt)))
        e.keep_vm_decode("traced")  # the hook sees only the VM's calls
        tr = decode_replay.trace(e.vm, lambda: e.decode(tok))
        self.calls, self.syms = tr.calls, tr.names
        # weights: the big arguments (a decode GEMV's codes / scales); outputs and x are small
        self.weight_bytes = [sum(b for b in map(_nbytes, c[1:]) if b >= (1 << 20)) for c in tr.calls]

    def per_symbol(self, replay: Any, steps: int) -> tuple[dict[str, float], dict[str, float]]:
        """Per symbol (seconds): the median over steps of its summed call time in a step, and the sum
        over its calls of each call's 10th-percentile time over the steps (on a shared machine the
        fastest calls are the undisturbed ones)."""
        n = len(self.calls)
        t = np.asarray(list(replay(self.calls, steps)), dtype=np.float64).reshape(steps, n)
        p10 = np.percentile(t, 10, axis=0)
        med: dict[str, float] = {}
        low: dict[str, float] = {}
        for sym in dict.fromkeys(self.syms):
            idx = [i for i, s in enumerate(self.syms) if s == sym]
            med[sym] = float(np.median(t[:, idx].sum(axis=1)))
            low[sym] = float(p10[idx].sum())
        med["__step__"] = float(np.median(t.sum(axis=1)))
        low["__step__"] = float(p10.sum())
        return med, low


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifacts", nargs="+")
    p.add_argument("--labels", default=None)
    p.add_argument("--name", required=True)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--position", type=int, default=32)
    p.add_argument("--shared-args", action="store_true",
                   help="run every artifact's kernels on the first artifact's tensors (same memory)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)  # before the runtime creates its pool
    labels = args.labels.split(",") if args.labels else [Path(a).name for a in args.artifacts]
    if len(labels) != len(args.artifacts):
        sys.exit("decode_kernel_ab: give one label per artifact")
    replay = build_replay()
    prompt = list(range(100, 100 + args.position))
    subs = [Traced(lab, art, prompt) for lab, art in zip(labels, args.artifacts, strict=True)]
    syms = list(dict.fromkeys(subs[0].syms))
    for s in subs[1:]:
        if list(dict.fromkeys(s.syms)) != syms:
            sys.exit(f"decode_kernel_ab: {s.label} calls other kernels than {subs[0].label}")
    if args.shared_args:
        # every artifact's kernels run on the FIRST artifact's tensors (weights, KV cache, activations):
        # the A/B is then the kernel code alone -- two artifacts' own weight copies sit at other
        # addresses, and an A/A pair of copies differed by 5-8% (gemv_qvnni_aa_separate_copies.csv)
        for s in subs[1:]:
            s.calls = [[mine[0], *first[1:]] for mine, first in zip(s.calls, subs[0].calls, strict=True)]
    count = {sym: subs[0].syms.count(sym) for sym in syms}
    wbytes = {sym: sum(b for s, b in zip(subs[0].syms, subs[0].weight_bytes, strict=True) if s == sym)
              for sym in syms}
    for s in subs:
        s.per_symbol(replay, 3)  # warm-up
    per: dict[str, list[dict[str, float]]] = {s.label: [] for s in subs}
    low: dict[str, list[dict[str, float]]] = {s.label: [] for s in subs}
    rows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for s in (subs if r % 2 == 0 else subs[::-1]):
            got, got10 = s.per_symbol(replay, args.steps)
            per[s.label].append(got)
            low[s.label].append(got10)
            load = os.getloadavg()[0]
            for sym in [*syms, "__step__"]:
                rows.append({"round": r, "variant": s.label, "kernel": sym, "calls": count.get(sym, len(s.calls)),
                             "us": round(got[sym] * 1e6, 2), "us_call_p10": round(got10[sym] * 1e6, 2),
                             "weight_mb": round(wbytes.get(sym, 0) / 1e6, 2),
                             "gbs": round(wbytes.get(sym, 0) / got[sym] / 1e9, 2) if wbytes.get(sym) else "",
                             "gbs_call_p10": round(wbytes.get(sym, 0) / got10[sym] / 1e9, 2) if wbytes.get(sym) else "",
                             "ratio_vs_first": "", "ratio_p10_vs_first": "", "load_avg_1m": round(load, 2),
                             "threads": args.threads, "shared_args": args.shared_args})
            print(f"round {r} {s.label}: step {got['__step__'] * 1e3:.2f} ms (kernels only), load {load:.2f}",
                  flush=True)
    base = subs[0].label
    for s in subs:
        for sym in [*syms, "__step__"]:
            med = statistics.median(g[sym] for g in per[s.label])
            m10 = statistics.median(g[sym] for g in low[s.label])
            ratio = statistics.median(b[sym] / g[sym] for b, g in zip(per[base], per[s.label], strict=True))
            r10 = statistics.median(b[sym] / g[sym] for b, g in zip(low[base], low[s.label], strict=True))
            rows.append({"round": "median", "variant": s.label, "kernel": sym, "calls": count.get(sym, ""),
                         "us": round(med * 1e6, 2), "us_call_p10": round(m10 * 1e6, 2),
                         "weight_mb": round(wbytes.get(sym, 0) / 1e6, 2),
                         "gbs": round(wbytes.get(sym, 0) / med / 1e9, 2) if wbytes.get(sym) else "",
                         "gbs_call_p10": round(wbytes.get(sym, 0) / m10 / 1e9, 2) if wbytes.get(sym) else "",
                         "ratio_vs_first": round(ratio, 4), "ratio_p10_vs_first": round(r10, 4),
                         "load_avg_1m": round(statistics.median(x["load_avg_1m"] for x in rows
                                                                if x["variant"] == s.label), 2),
                         "threads": args.threads, "shared_args": args.shared_args})
    out = Path(args.out) if args.out else RESULTS / f"decode_kernels_{args.name}.csv"
    write_csv(out, rows)
    med = [x for x in rows if x["round"] == "median"]
    big = sorted({x["kernel"] for x in med}, key=lambda k: -max(x["us"] for x in med if x["kernel"] == k))
    for k in big[:16]:
        print(f"{k[:40]:<40} " + "  ".join(
            f"{x['variant']} {x['us']:7.1f} us x{x['ratio_vs_first']:.3f}, call p10 {x['us_call_p10']:7.1f} us "
            f"{x['gbs_call_p10'] or '':>6} GB/s x{x['ratio_p10_vs_first']:.3f}"
            for x in med if x["kernel"] == k))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
