"""Machine probes for benchmarks: read bandwidth (the decode ceiling), core placement, CPU use.

The probes are a small C/OpenMP file compiled at run time with the system C compiler
(``gcc -O3 -fopenmp -march=native``) into a cache directory and called through ctypes:
numpy's single-threaded reductions reach well under the machine's read bandwidth.

* ``read_bandwidth(threads)`` / ``BandwidthProbe``: GB/s of a multi-threaded sequential sum over a
  1 GiB float array (32x the 32 MiB L3 here, so every pass streams from DRAM; AVX-512/AVX2 loads
  through the compiler's vectorizer, 8 independent accumulators, software prefetch 8 KiB ahead;
  static split, one contiguous half per thread, as the engines' GEMVs split rows). Best of ``reps`` passes: the ceiling is the
  fastest the machine read in that window. The buffer is advised to transparent huge pages so the
  ceiling is not lowered by TLB misses the engines might avoid. ``BandwidthProbe`` keeps the buffer
  between measurements so a probe next to every benchmark turn costs ~0.1 s, not a 1 GiB first touch.
* ``pingpong_ns()``: one-way latency of a cache line bouncing between two threads pinned to
  CPUs 0 and 1. On the shared 2-vCPU machines it tells the two placements apart: "shared"
  (same L3, ~50-70 ns) vs "split" (~110-400 ns). See /work/shared/notes/peers.md.
* ``CpuWatch``: CPU time used by *other* processes during a run, to flag disturbed timings.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

SHARED_MAX_NS = 90.0  # ping-pong one-way latency below this: both vCPUs share an L3 ("shared")

_C_SOURCE = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <omp.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

float *px_alloc(size_t n, int huge) {
    float *p = NULL;
    if (posix_memalign((void **)&p, 2u << 20, n * sizeof(float))) return NULL;
#ifdef MADV_HUGEPAGE
    if (huge) madvise(p, n * sizeof(float), MADV_HUGEPAGE);  /* best effort: THP may be off */
#endif
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) p[i] = (float)(i & 1023) * 1e-3f;  /* first touch by the readers */
    return p;
}

void px_free(float *p) { free(p); }

/* Best-of-`reps` seconds for one full read of p[0..n) with `threads` threads (`pf`: software prefetch);
   *sink keeps the sum alive. */
double px_read(const float *p, size_t n, int threads, int reps, int pf, double *sink) {
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double total = 0.0;
        double t0 = now();
        #pragma omp parallel num_threads(threads) reduction(+:total)
        {
            float acc[8][16];
            memset(acc, 0, sizeof(acc));
            #pragma omp for schedule(static) nowait
            for (size_t i = 0; i < n / 128; i++) {
                const float *q = p + i * 128;
                /* software prefetch 8 KiB ahead (past the end is harmless: prefetches do not fault):
                   without it this read was 2-7% slower (90th percentile of 8 MiB windows, 2 threads),
                   i.e. a lower ceiling than a kernel that prefetches can reach */
                if (pf) {
                    __builtin_prefetch(q + 2048, 0, 3);
                    __builtin_prefetch(q + 2048 + 64, 0, 3);
                }
                for (int u = 0; u < 8; u++)
                    for (int l = 0; l < 16; l++) acc[u][l] += q[u * 16 + l];
            }
            float s = 0.f;
            for (int u = 0; u < 8; u++)
                for (int l = 0; l < 16; l++) s += acc[u][l];
            total += s;
        }
        double dt = now() - t0;
        if (dt < best) best = dt;
        *sink += total;
    }
    return best;
}

static _Atomic int flag __attribute__((aligned(64)));
static int rounds_n;

static void pin(int cpu) {
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    pthread_setaffinity_np(pthread_self(), sizeof(s), &s);
}

static void *pong(void *arg) {
    pin(*(int *)arg);
    for (int i = 0; i < rounds_n; i++) {
        while (atomic_load_explicit(&flag, memory_order_acquire) != 1) {}
        atomic_store_explicit(&flag, 0, memory_order_release);
    }
    return NULL;
}

/* Median-free simple probe: one-way ns of a cache line bouncing between cpu_a and cpu_b. */
double px_pingpong(int cpu_a, int cpu_b, int rounds) {
    pthread_t th;
    rounds_n = rounds;
    atomic_store(&flag, 0);
    int b = cpu_b;
    if (pthread_create(&th, NULL, pong, &b)) return -1.0;
    cpu_set_t old;
    pthread_getaffinity_np(pthread_self(), sizeof(old), &old);
    pin(cpu_a);
    double t0 = now();
    for (int i = 0; i < rounds; i++) {
        atomic_store_explicit(&flag, 1, memory_order_release);
        while (atomic_load_explicit(&flag, memory_order_acquire) != 0) {}
    }
    double dt = now() - t0;
    pthread_join(th, NULL);
    pthread_setaffinity_np(pthread_self(), sizeof(old), &old);
    return dt / rounds / 2.0 * 1e9;
}
"""

_LIB: ctypes.CDLL | None = None


def _cache_dir() -> Path:
    base = os.environ.get("PERFX_BENCH_CACHE") or os.path.join(tempfile.gettempdir(), "perfx-bench-cache")
    return Path(base)


def _compiler_flags() -> list[str]:
    flags = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
    if platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64"):
        flags.append("-march=native")
    return flags


def load_probe_library() -> ctypes.CDLL:
    """Compile (once per source/flags) and load the probe library."""
    global _LIB
    if _LIB is not None:
        return _LIB
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) on PATH: the bandwidth and placement probes need one")
    flags = _compiler_flags()
    key = hashlib.sha256((_C_SOURCE + " ".join(flags) + cc).encode()).hexdigest()[:16]
    out = _cache_dir() / f"perfx_probe_{key}.so"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "probe.c"
            src.write_text(_C_SOURCE)
            tmp_so = Path(tmp) / "probe.so"
            res = subprocess.run([cc, *flags, str(src), "-o", str(tmp_so), "-lpthread"], capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"compiling the probe library failed: {res.stderr.strip()[-500:]}")
            shutil.move(str(tmp_so), str(out))
    lib = ctypes.CDLL(str(out))
    lib.px_alloc.restype = ctypes.c_void_p
    lib.px_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int]
    lib.px_free.argtypes = [ctypes.c_void_p]
    lib.px_read.restype = ctypes.c_double
    lib.px_read.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_double),
    ]
    lib.px_pingpong.restype = ctypes.c_double
    lib.px_pingpong.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    _LIB = lib
    return lib


class BandwidthProbe:
    """A read-bandwidth probe that keeps its buffer: ``measure()`` next to every benchmark turn.

    ``threads`` should be the engines' thread count; ``size_bytes`` >> the last-level cache.
    """

    def __init__(self, threads: int = 2, size_bytes: int = 1 << 30, huge: bool = True):
        self.lib = load_probe_library()
        self.threads = int(threads)
        self.n = size_bytes // 4 // 128 * 128
        self._ptr = self.lib.px_alloc(self.n, int(huge))
        if not self._ptr:
            raise MemoryError(f"cannot allocate {size_bytes} bytes for the bandwidth probe")

    def measure(self, reps: int = 3, threads: int | None = None, prefetch: bool = True) -> float:
        """GB/s (10^9 bytes/s) of the fastest of ``reps`` full reads of the buffer (``prefetch=False``:
        hardware prefetch only, the lower figure; kept for comparison, docs/decisions/decode-step-runtime.md)."""
        if not self._ptr:
            raise RuntimeError("the bandwidth probe was closed")
        sink = ctypes.c_double(0.0)
        secs = self.lib.px_read(self._ptr, self.n, int(threads or self.threads), int(reps), int(prefetch),
                                ctypes.byref(sink))
        return self.n * 4 / secs / 1e9

    def chunk_gbs(self, chunk_bytes: int, count: int, threads: int | None = None, prefetch: bool = True) -> list[float]:
        """GB/s of ``count`` single reads of ``chunk_bytes`` windows, walking through the buffer (each
        window is cold: the buffer is far larger than the LLC). Their best / upper percentiles are a
        ceiling for kernels timed per call on a busy machine, where a 1 GiB pass is rarely undisturbed."""
        if not self._ptr:
            raise RuntimeError("the bandwidth probe was closed")
        n = max(128, chunk_bytes // 4 // 128 * 128)
        windows = max(1, self.n // n)
        sink = ctypes.c_double(0.0)
        out = []
        for i in range(count):
            ptr = self._ptr + (i % windows) * n * 4
            secs = self.lib.px_read(ptr, n, int(threads or self.threads), 1, int(prefetch), ctypes.byref(sink))
            out.append(n * 4 / secs / 1e9)
        return out

    def close(self) -> None:
        if self._ptr:
            self.lib.px_free(self._ptr)
            self._ptr = None

    def __enter__(self) -> BandwidthProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_bandwidth(threads: int = 2, size_bytes: int = 1 << 30, reps: int = 5) -> float:
    """Read bandwidth in GB/s (10^9 bytes/s): best of ``reps`` full reads of a ``size_bytes`` array."""
    with BandwidthProbe(threads, size_bytes) as probe:
        return probe.measure(reps)


def pingpong_ns(rounds: int = 20000, repeats: int = 5, settle_s: float = 0.0) -> float:
    """Median one-way cache-line latency (ns) between CPUs 0 and 1; nan on a 1-CPU machine."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cpus) < 2:
        return float("nan")
    if settle_s > 0:
        time.sleep(settle_s)  # let spinning worker threads of the last run go to sleep
    lib = load_probe_library()
    vals = sorted(lib.px_pingpong(cpus[0], cpus[1], rounds) for _ in range(repeats))
    return float(vals[len(vals) // 2])


def placement(ns: float) -> str:
    """'shared' / 'split' from a ping-pong latency (see module docstring); 'n/a' without a second CPU."""
    if ns != ns:  # nan
        return "n/a"
    return "shared" if ns < SHARED_MAX_NS else "split"


def cpu_model() -> str:
    from perfx_compiler.targets import cpuinfo

    return cpuinfo("model name") or platform.processor() or platform.machine()


@dataclass
class MachineInfo:
    cpu: str
    cores: int
    bandwidth_1t_gbs: float
    bandwidth_gbs: float  # with the benchmark's thread count
    threads: int
    pingpong_ns: float

    @property
    def placement(self) -> str:
        return placement(self.pingpong_ns)

    def line(self) -> str:
        return (
            f"machine: {self.cpu}, {self.cores} cores; read bandwidth {self.bandwidth_gbs:.1f} GB/s with {self.threads} "
            f"threads ({self.bandwidth_1t_gbs:.1f} GB/s with 1); ping-pong {self.pingpong_ns:.0f} ns ({self.placement})"
        )


def probe_machine(threads: int = 2, size_bytes: int = 1 << 30) -> MachineInfo:
    """Bandwidth (1 and ``threads`` threads) and placement, measured now."""
    ns = pingpong_ns()
    with BandwidthProbe(threads, size_bytes) as probe:
        bw1 = probe.measure(5, threads=1)
        bw = probe.measure(5) if threads != 1 else bw1
    return MachineInfo(cpu_model(), os.cpu_count() or 1, bw1, bw, threads, ns)


class CpuWatch:
    """CPU seconds used by processes other than ours (and our children) between start() and stop().

    ``other_cpu_frac``: that time over the wall time, in CPUs (0.2 = a fifth of a core busy elsewhere).
    """

    def __init__(self, own_pids: list[int] | None = None):
        self.own_pids = set(own_pids or [])
        self.other_cpu_frac = 0.0
        self._t0 = 0.0
        self._sys0 = 0.0
        self._own0 = 0.0

    def _own_cpu(self) -> float:
        total = 0.0
        me = psutil.Process()
        procs = [me, *me.children(recursive=True)]
        seen = {p.pid for p in procs}
        for pid in self.own_pids - seen:
            try:
                procs.append(psutil.Process(pid))
            except psutil.Error:
                pass
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)

    def start(self) -> CpuWatch:
        self._t0 = time.perf_counter()
        self._sys0 = self._busy()
        self._own0 = self._own_cpu()
        return self

    def stop(self) -> float:
        wall = max(time.perf_counter() - self._t0, 1e-9)
        other = (self._busy() - self._sys0) - (self._own_cpu() - self._own0)
        self.other_cpu_frac = max(other, 0.0) / wall
        return self.other_cpu_frac
