"""One decode step of an artifact as a list of kernel calls, replayed from C++ for timing.

The step is traced once through the VM's instrumentation hook (``runtime.decode_replay.trace``: every
kernel call in order, with the VM's own argument tensors: weights, KV cache, activations); the calls
are then run back to back by a small C++ loop (``tvm_ffi.cpp.load_inline``, needs g++), without the
VM, Python or allocation in the timed region. ``benchmarks/ab.py --level step|kernel`` is built on it.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

_TIMING_CC = r"""
#include <time.h>

static double now() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// Runs the whole list `reps` times; returns each pass's seconds.
Array<double> replay(Array<Array<Any>> calls, int64_t reps) {
  Calls c(calls);
  Array<double> out;
  Any rv;
  for (int64_t r = 0; r < reps; ++r) {
    double t0 = now();
    for (size_t i = 0; i < c.size(); ++i) c.run(i, &rv);
    out.push_back(now() - t0);
  }
  return out;
}

// The same list, each call timed on its own: reps x n seconds, pass-major.
Array<double> replay_each(Array<Array<Any>> calls, int64_t reps) {
  Calls c(calls);
  Array<double> out;
  Any rv;
  for (int64_t r = 0; r < reps; ++r) {
    for (size_t i = 0; i < c.size(); ++i) {
      double t0 = now();
      c.run(i, &rv);
      out.push_back(now() - t0);
    }
  }
  return out;
}
"""


def build_replay_module() -> Any:
    """The C++ replay loops (``replay(calls, reps)``: whole passes; ``replay_each``: every call timed),
    compiled once (tvm_ffi caches the library)."""
    import tvm_ffi.cpp

    from perfx_compiler.runtime.decode_replay import CALLS_CC

    try:
        return tvm_ffi.cpp.load_inline("perfx_bench_replay", cpp_sources=CALLS_CC + _TIMING_CC,
                                       functions=["replay", "replay_each"], extra_cflags=["-O2"])
    except Exception as err:  # noqa: BLE001 - a missing C++ toolchain is the usual cause
        sys.exit(f"cannot build the C++ replay loop ({type(err).__name__}: {err}); needs g++")


def nbytes(a: Any) -> int:
    """Bytes of a tensor argument (0 for scalars and other arguments)."""
    shape = getattr(a, "shape", None)
    if shape is None:
        return 0
    return int(np.prod([int(s) for s in shape])) * np.dtype(str(a.dtype)).itemsize


def _ptr(a: Any) -> int | None:
    """A tensor argument's data address (None for scalars and other arguments)."""
    data_ptr = getattr(a, "data_ptr", None)
    return data_ptr() if callable(data_ptr) else None


class TracedStep:
    """One artifact loaded in this process: its engine, one token fed at ``position`` (after the first
    ``position`` ids of ``prompt``, taken modulo the vocabulary), and the kernel calls of that decode
    step (``calls``; their kernel symbols in ``names``, the weight bytes each reads in ``weight_bytes``)."""

    def __init__(self, label: str, art: str | Path, prompt: list[int], position: int):
        from perfx_compiler.bench.engines import streamed_weight_names
        from perfx_compiler.runtime import decode_replay
        from perfx_compiler.runtime.engine import Engine

        self.label, self.art = label, str(art)
        self.engine = e = Engine(self.art, verify=False)
        e.reset()
        ids = [int(t) % e.vocab_size for t in prompt[:position]]  # any prompt fits any vocabulary
        self.token = int(np.argmax(e.prefill(ids)))
        self.position = e.position  # every timed step runs at this position (same attention length)
        e.keep_vm_decode("traced")  # the hook sees only the VM's calls
        tr = decode_replay.trace(e.vm, lambda: e.decode(self.token))
        e.position = self.position
        self.calls, self.names = tr.calls, tr.names
        # weights: the arguments that are the weights a decode step streams (codes, scales and mins: a
        # K-quant's small int8 scale arrays too), as perfx-bench counts them; not the KV cache (sized by
        # capacity, read by position) nor an untied embedding table (a gather reads one row)
        streamed = streamed_weight_names(e.manifest)
        weights = {_ptr(w) for m, w in zip(e.manifest["weights"], e._weights, strict=True) if m["name"] in streamed}
        self.weight_bytes = [0 if "take" in name else sum(nbytes(a) for a in c[1:] if _ptr(a) in weights)
                             for c, name in zip(tr.calls, tr.names, strict=True)]  # (a gather reads one row)

    def time_engine_step(self, steps: int) -> float:
        """Median seconds of ``Engine.decode`` + argmax (a greedy token) at the traced position."""
        e, tok = self.engine, self.token
        ts = []
        for _ in range(steps):
            e.position = self.position
            t = time.perf_counter()
            int(np.argmax(e.decode(tok)))
            ts.append(time.perf_counter() - t)
        e.position = self.position
        return statistics.median(ts)

    def per_kernel(self, replay_each: Any, steps: int) -> tuple[dict[str, float], dict[str, float]]:
        """Per kernel symbol (seconds): the median over ``steps`` of its summed call time in a step, and
        the sum over its calls of each call's 10th-percentile time (on a shared machine the fastest
        calls are the undisturbed ones). Key ``__step__``: the whole step."""
        n = len(self.calls)
        t = np.asarray(list(replay_each(self.calls, steps)), dtype=np.float64).reshape(steps, n)
        p10 = np.percentile(t, 10, axis=0)
        med: dict[str, float] = {}
        low: dict[str, float] = {}
        for sym in dict.fromkeys(self.names):
            idx = [i for i, s in enumerate(self.names) if s == sym]
            med[sym] = float(np.median(t[:, idx].sum(axis=1)))
            low[sym] = float(p10[idx].sum())
        med["__step__"] = float(np.median(t.sum(axis=1)))
        low["__step__"] = float(p10.sum())
        return med, low
