"""Runtime overhead of a decode step, measured without a profiler hook: kernels alone vs the whole step.

For each artifact (several are alternated, so one run is also an A/B), one decode step is traced once
through the VM's instrumentation hook to record the kernel calls it makes, in order, with their
argument tensors (the VM's own buffers). Then, per round, at the same sequence position:

* ``kernels_ms``  the recorded kernels run back to back from that precompiled list by a small C++
                   loop (built here with ``tvm_ffi.cpp.load_inline``): kernel time and nothing else
                   (no VM, no Python, no allocation), reading the same weights and KV cache;
* ``vm_ms``       one call of the VM's decode function, made as ``Engine.decode`` makes it (on arguments
                   bound once), minus the Python around it;
* ``step_ms``     ``Engine.decode(token)`` + ``argmax`` of the logits, i.e. a greedy token as
                   ``perfx-bench`` times it (Python, argument passing, logits copy, sampling);
* ``step_callpath_ms`` the same step made the way Engine.decode made it before binding its
                   arguments once (the whole argument list per call, logits copied), for comparison.

``overhead = 1 - kernels_ms / step_ms`` (everything that is not a kernel); it splits into
``vm_interp = vm_ms - kernels_ms`` (VM dispatch, builtins such as alloc_tensor) and
``outside_vm = step_ms - vm_ms``. ``vm_interp_paired_ms`` measures the VM's share more robustly: one
replay pass and one VM call back to back, ``--steps`` times, the median of their differences. Each
figure is the median of ``--steps`` steps in a round; the CSV holds every round (with the load average
and the VM builtin calls per step) and the medians over rounds (derived columns: medians of the
per-round values). The machine is shared: compare within one run, where the rounds are alternated.

Fork/join: ``parallel_launches`` counts the thread-pool launches of one step (the library's
``__TVMBackendParallelLaunch`` pointer wrapped by a counter); ``launch_us`` times one launch of an empty
2-task kernel (minus its serial twin) each round, on the pool the Engine uses (PerfX's thread team, or TVM's
pool under ``PERFX_THREAD_POOL=tvm``; column ``thread_pool``); ``forkjoin_frac`` = launches x launch_us / step_ms,
an estimate of the share of ``kernels_ms`` that is pool overhead (threads > 1 only).

    python benchmarks/decode_overhead.py ART [ART2 ...] [--labels a,b] [--rounds 9] [--steps 100]
                                         [--threads 2] [--position 32] [--out CSV]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"

def _replay_cc() -> str:
    """The timing loops over the runtime's unpacked call list (decode_replay.CALLS_CC)."""
    from perfx_compiler.runtime.decode_replay import CALLS_CC

    return CALLS_CC + r"""
#include <time.h>

static double now(bool cpu) {
  timespec ts;
  clock_gettime(cpu ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// Runs the whole list `reps` times; returns each pass's seconds
// (wall clock, or this thread's CPU time with `cpu`).
Array<double> replay(Array<Array<Any>> calls, int64_t reps, bool cpu) {
  Calls c(calls);
  Array<double> out;
  Any rv;
  for (int64_t r = 0; r < reps; ++r) {
    double t0 = now(cpu);
    for (size_t i = 0; i < c.size(); ++i) c.run(i, &rv);
    out.push_back(now(cpu) - t0);
  }
  return out;
}

// The same list, each call timed on its own (wall clock): reps x n seconds, pass-major.
Array<double> replay_each(Array<Array<Any>> calls, int64_t reps) {
  Calls c(calls);
  Array<double> out;
  Any rv;
  for (int64_t r = 0; r < reps; ++r) {
    for (size_t i = 0; i < c.size(); ++i) {
      double t0 = now(false);
      c.run(i, &rv);
      out.push_back(now(false) - t0);
    }
  }
  return out;
}
"""


def build_replay_module() -> Any:
    """The C++ replay loops (``replay``: whole passes; ``replay_each``: every call), compiled once
    (tvm_ffi caches the library)."""
    import tvm_ffi.cpp

    try:
        return tvm_ffi.cpp.load_inline("perfx_decode_replay", cpp_sources=_replay_cc(),
                                       functions=["replay", "replay_each"], extra_cflags=["-O2"])
    except Exception as err:  # noqa: BLE001 - a missing C++ toolchain is the usual cause
        sys.exit(f"cannot build the C++ replay loop ({type(err).__name__}: {err}); needs g++")


def build_replay() -> Any:
    return build_replay_module().replay


def count_parallel_launches(lib_path: Path, step: Any) -> int:
    """Parallel regions (thread-pool fork/joins) one ``step()`` launches: the kernels of ``lib_path``
    reach TVM's pool through their library's ``__TVMBackendParallelLaunch`` pointer, which is
    wrapped by a counter for this one call. -1 where the library has no such pointer."""
    import ctypes

    try:
        lib = ctypes.CDLL(str(lib_path), mode=os.RTLD_NOLOAD | os.RTLD_NOW)
        ptr = ctypes.c_void_p.in_dll(lib, "__TVMBackendParallelLaunch")
    except (OSError, ValueError):
        return -1
    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)
    orig_addr = ptr.value
    original = proto(orig_addr)
    count = [0]

    def counting(flambda: int, cdata: int, num_task: int) -> int:
        count[0] += 1
        return original(flambda, cdata, num_task)

    wrapper = proto(counting)
    ptr.value = ctypes.cast(wrapper, ctypes.c_void_p).value
    try:
        step()
    finally:
        ptr.value = orig_addr
    return count[0]


class LaunchProbe:
    """The cost of one fork/join of the pool the artifacts' kernels use: an empty 2-task parallel kernel
    minus the same loop run serially, called back to back from the C++ replay loop. The kernel is
    exported with the thread team linked in and routed through it as the Engine routes an artifact
    (perfx_compiler/runtime/thread_team.py), or through TVM's pool under PERFX_THREAD_POOL=tvm."""

    def __init__(self) -> None:
        import tempfile

        import tvm
        from tvm.script import tirx as T

        from perfx_compiler.runtime import thread_team

        @T.prim_func
        def par(a: T.Buffer((2, 16), "float32")):
            for i in T.parallel(2):
                for j in range(16):
                    a[i, j] = a[i, j] + T.float32(1)

        @T.prim_func
        def ser(a: T.Buffer((2, 16), "float32")):
            for i in range(2):
                for j in range(16):
                    a[i, j] = a[i, j] + T.float32(1)

        self._dir = tempfile.TemporaryDirectory(prefix="perfx-launch-probe-")
        self.fns = []
        for name, f in (("par", par), ("ser", ser)):
            path = Path(self._dir.name) / f"{name}.so"
            tvm.tirx.build(f, target="llvm").export_library(str(path), **thread_team.link_options())
            lib = tvm.runtime.load_module(str(path))
            if name == "par":
                self.pool = thread_team.install(path)
            self.fns.append(lib["main"])
        self.buf = tvm.runtime.tensor(np.zeros((2, 16), "float32"))

    def time_us(self, replay: Any, calls: int = 2000) -> float:
        par, ser = ([[f, self.buf]] * calls for f in self.fns)
        t_par = statistics.median(list(replay(par, 5, False)))
        t_ser = statistics.median(list(replay(ser, 5, False)))
        return (t_par - t_ser) / calls * 1e6


class Subject:
    """One artifact: its engine, a token to feed, and the kernel calls of one decode step."""

    def __init__(self, label: str, art: str, prompt: list[int], position: int):
        from perfx_compiler.runtime import decode_replay
        from perfx_compiler.runtime.engine import Engine

        self.label, self.art = label, art
        self.engine = Engine(art, verify=False)
        e = self.engine
        e.reset()
        self.token = int(np.argmax(e.prefill(prompt[:position])))
        self.position = e.position  # every timed step runs at this position (same attention length)
        e.keep_vm_decode("traced")  # this script times the VM's own path against its kernels
        tr = decode_replay.trace(e.vm, lambda: e.decode(self.token))
        self.calls, self.names, self.builtins = tr.calls, tr.names, len(tr.builtins)  # names: kernel symbols
        e.position = self.position
        self.launches = count_parallel_launches(Path(art) / "model.so", lambda: e.decode(self.token))
        e.position = self.position
        # the VM's decode function, called as Engine.decode calls it: on arguments bound once
        # (set_input) when the engine does that, else with the whole argument list
        name = getattr(e, "_decode_name", None)
        if name is not None:
            invoke = e._invoke_stateful
            self.vm_fn, self.vm_args = (lambda: invoke(name)), []
        else:
            self.vm_fn, self.vm_args = e._decode, [e._one_token_dev, e._pos_dev, *e._tail]

    def time_kernels(self, replay: Any, steps: int, cpu: bool) -> float:
        return statistics.median(list(replay(self.calls, steps, cpu)))

    def time_vm(self, steps: int, cpu: bool) -> float:
        fn, args, clock = self.vm_fn, self.vm_args, _clock(cpu)
        ts = []
        for _ in range(steps):
            t = clock()
            fn(*args)
            ts.append(clock() - t)
        return statistics.median(ts)

    def time_vm_minus_kernels(self, replay: Any, steps: int, cpu: bool) -> float:
        """Median over ``steps`` of (one VM call - one kernel replay pass), the two run back to back:
        the VM's own time per step, with slow drift (other processes) hitting both sides alike."""
        fn, args, clock = self.vm_fn, self.vm_args, _clock(cpu)
        diffs = []
        for _ in range(steps):
            k = replay(self.calls, 1, cpu)[0]
            t = clock()
            fn(*args)
            diffs.append(clock() - t - k)
        return statistics.median(diffs)

    def time_step(self, steps: int, cpu: bool) -> float:
        e, tok, clock = self.engine, self.token, _clock(cpu)
        ts = []
        for _ in range(steps):
            e.position = self.position
            t = clock()
            int(np.argmax(e.decode(tok)))
            ts.append(clock() - t)
        e.position = self.position
        return statistics.median(ts)

    def time_step_callpath(self, steps: int, cpu: bool) -> float:
        """The greedy step as Engine.decode made it before arguments were bound once: the VM
        function called with its whole argument list (~490 tensors), the logits copied out."""
        e, clock = self.engine, _clock(cpu)
        fn = e._decode
        ids, pos = np.array([[self.token]], dtype=e.index_dtype), np.array([self.position], dtype=e.index_dtype)
        ts = []
        for _ in range(steps):
            t = clock()
            e._pos_dev.copyfrom(pos)
            e._one_token_dev.copyfrom(ids)
            out = fn(e._one_token_dev, e._pos_dev, *e._tail)
            int(np.argmax(out[0].numpy()[0][0]))
            ts.append(clock() - t)
        return statistics.median(ts)


def _clock(cpu: bool) -> Any:
    # CPU time of this thread: with one thread every kernel runs on it, and time spent descheduled
    # (other processes on a shared machine) is not counted. Wall clock otherwise.
    return time.thread_time if cpu else time.perf_counter


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifacts", nargs="+")
    p.add_argument("--labels", default=None, help="comma-separated, one per artifact")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=100, help="steps per measurement (median taken)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--position", type=int, default=32, help="prompt length before the timed step")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: the calling thread's CPU time (robust under load; needs --threads 1)")
    p.add_argument("--out", default=str(RESULTS / "decode_overhead.csv"))
    args = p.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)  # before the runtime creates its thread pool
    if args.clock == "cpu" and args.threads != 1:
        sys.exit("decode_overhead: --clock cpu counts only the calling thread; use it with --threads 1")
    cpu = args.clock == "cpu"
    labels = args.labels.split(",") if args.labels else [Path(a).name for a in args.artifacts]
    if len(labels) != len(args.artifacts):
        sys.exit("decode_overhead: give one label per artifact")
    replay = build_replay()
    try:
        probe: LaunchProbe | None = LaunchProbe()
    except Exception as err:  # noqa: BLE001 - a runtime-only TVM cannot build the probe kernels
        print(f"decode_overhead: no fork/join probe ({type(err).__name__}: {err})", flush=True)
        probe = None
    if probe is not None:
        print(f"fork/join probe on: {probe.pool}", flush=True)
    prompt = list(range(100, 100 + args.position))
    subjects = [Subject(lab, art, prompt, args.position) for lab, art in zip(labels, args.artifacts, strict=True)]
    for s in subjects:
        print(f"{s.label}: {len(s.calls)} kernel calls ({s.launches} parallel regions), {s.builtins} VM builtin "
              "calls per decode step", flush=True)
        s.time_kernels(replay, 10, cpu), s.time_vm(10, cpu), s.time_step(10, cpu)  # warm-up
    rows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = subjects if r % 2 == 0 else subjects[::-1]
        for s in order:
            # three measurements in a rotating order, so slow drift does not favour one
            meas = [("kernels", lambda s=s: s.time_kernels(replay, args.steps, cpu)),
                    ("vm", lambda s=s: s.time_vm(args.steps, cpu)),
                    ("step", lambda s=s: s.time_step(args.steps, cpu)),
                    ("step_callpath", lambda s=s: s.time_step_callpath(args.steps, cpu)),
                    ("vm_paired", lambda s=s: s.time_vm_minus_kernels(replay, args.steps, cpu))]
            k = r % len(meas)
            got = {name: fn() for name, fn in meas[k:] + meas[:k]}
            launch_us = probe.time_us(replay) if probe is not None and args.threads > 1 else float("nan")
            row = {"round": r, "variant": s.label, "artifact": s.art, "thread_pool": s.engine.thread_pool,
                   "threads": args.threads, "clock": args.clock,
                   "position": s.position, "kernel_calls": len(s.calls), "vm_builtin_calls": s.builtins,
                   "parallel_launches": s.launches, "launch_us": launch_us,
                   "kernels_ms": got["kernels"] * 1e3, "vm_ms": got["vm"] * 1e3, "step_ms": got["step"] * 1e3,
                   "step_callpath_ms": got["step_callpath"] * 1e3, "vm_interp_paired_ms": got["vm_paired"] * 1e3,
                   "load_avg_1m": os.getloadavg()[0]}
            rows.append(_derive(row))
            print(_fmt(rows[-1]), flush=True)
    for s in subjects:
        mine = [x for x in rows if x["variant"] == s.label]
        keys = ("kernels_ms", "vm_ms", "step_ms", "step_callpath_ms", "vm_interp_paired_ms", "launch_us",
                "load_avg_1m")
        med = {k: statistics.median(x[k] for x in mine) for k in keys}
        row = _derive({**mine[0], "round": "median", **med})
        # derived columns: the median of the per-round values (each round's pair ran close together),
        # not the difference of medians taken over different rounds
        for k in ("vm_interp_ms", "outside_vm_ms", "overhead_frac", "forkjoin_frac"):
            row[k] = statistics.median(x[k] for x in mine)
        rows.append(row)
        print("median " + _fmt(rows[-1]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for row in rows:
            w.writerow({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
    _plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Per variant, the medians: kernel time, VM time outside kernels (paired), the rest of the step."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import figure

    med = [r for r in rows if r["round"] == "median"]
    with figure(path, 1, 2, figsize=(11, 4)) as (fig, axes):
        names = [r["variant"] for r in med]
        kern = [r["kernels_ms"] for r in med]
        vm = [max(0.0, r["vm_interp_paired_ms"]) for r in med]
        rest = [max(0.0, r["step_ms"] - r["kernels_ms"] - v) for r, v in zip(med, vm, strict=True)]
        axes[0].bar(names, kern, label="kernels (replayed back to back)")
        axes[0].bar(names, vm, bottom=kern, label="VM outside kernels (paired)")
        axes[0].bar(names, rest, bottom=[k + v for k, v in zip(kern, vm, strict=True)], label="rest of the step")
        axes[0].set_ylabel("ms per decode step (median of rounds)")
        axes[0].legend(fontsize=8)
        for r in med:
            mine = [x for x in rows if x["variant"] == r["variant"] and x["round"] != "median"]
            axes[1].plot([x["round"] for x in mine], [1e3 * x["vm_interp_paired_ms"] for x in mine], "o-",
                         label=f"{r['variant']} ({r['vm_builtin_calls']} VM builtin calls/step)")
        axes[1].set_xlabel("round (alternated)")
        axes[1].set_ylabel("VM time outside kernels, us (paired)")
        axes[1].grid(alpha=0.3)
        axes[1].legend(fontsize=8)
        load = statistics.median(r["load_avg_1m"] for r in med)
        fig.suptitle(f"decode step overhead, {med[0]['threads']} thread(s), {med[0]['clock']} clock, "
                     f"load {load:.1f}", fontsize=10)


def _derive(row: dict[str, Any]) -> dict[str, Any]:
    k, v, s = row["kernels_ms"], row["vm_ms"], row["step_ms"]
    row["vm_interp_ms"] = v - k
    row["outside_vm_ms"] = s - v
    row["overhead_frac"] = 1.0 - k / s if s > 0 else float("nan")
    row["tok_s"] = 1e3 / s if s > 0 else float("nan")
    # estimated share of the step spent forking/joining the pool (inside kernels_ms): launches x probe
    row["forkjoin_frac"] = row["parallel_launches"] * row["launch_us"] * 1e-3 / s if s > 0 else float("nan")
    return row


def _fmt(row: dict[str, Any]) -> str:
    return (f"{row['variant']} r{row['round']}: kernels {row['kernels_ms']:.3f} ms, vm {row['vm_ms']:.3f}, "
            f"step {row['step_ms']:.3f} -> overhead {row['overhead_frac'] * 100:.1f}% "
            f"(vm {row['vm_interp_ms'] * 1e3:.0f} us, paired {row['vm_interp_paired_ms'] * 1e3:.0f} us, "
            f"outside {row['outside_vm_ms'] * 1e3:.0f} us), fork/join {row['parallel_launches']} x "
            f"{row['launch_us']:.2f} us = {row['forkjoin_frac'] * 100:.1f}%, load {row['load_avg_1m']:.2f}")


if __name__ == "__main__":
    main()
