"""The two sides of ``benchmarks/kernels.py ggml`` on the same GGUF blocks.

ggml's CPU mul_mat through ctypes: the ``libggml-base`` / ``libggml-cpu`` shared libraries that
llama-cpp-python ships (``<site-packages>/llama_cpp/lib``), public C API only (ggml.h, ggml-cpu.h,
ggml-backend.h, ggml-alloc.h of llama-cpp-python 0.3.36's vendored llama.cpp).

One :class:`MulMat` is ``y[m, n] = x[m, k] @ W[n, k].T`` with W raw GGUF blocks: ``ggml_init`` with
its own memory, ``ggml_new_tensor_2d(type, k, n)`` holding the block bytes, an f32 activation
tensor, ``ggml_mul_mat``, ``ggml_new_graph_custom`` + ``ggml_build_forward_expand``, then
``ggml_graph_plan`` once and ``ggml_graph_compute`` per call with a work buffer of our own
(``ggml_graph_compute_with_ctx`` would carve a new work buffer out of the context on every call).
The plan has no threadpool, as llama.cpp's CPU backend runs without one attached: this build uses
OpenMP, whose thread team persists between calls. ggml quantizes x to Q8_K (K-quants) or Q8_0
inside the call, as in llama.cpp.

``repack=True`` puts W in ggml's ``CPU_REPACK`` buffer type (``ggml_backend_alloc_ctx_tensors_from_buft``,
then ``ggml_backend_tensor_set`` interleaves the blocks 8 rows at a time): llama.cpp loads a model's
weights there when a repacked kernel exists for the type on this CPU, which on x86 with AVX2 is
Q4_0 and Q4_K (of the types benchmarked; ggml-cpu/repack.cpp, ``ggml_repack_get_optimal_repack_type``),
so for those types the repacked kernel is the one llama.cpp runs.

PerfX's side (:func:`perfx_kernel`): the blocks packed by ``formats/vnni.py`` (``formats.ggml.unpack``
then ``subscaled_vnni_packed`` for K-quants, ``gguf_blocks.packed_from_blocks(vnni=True)`` for Q8_0 /
Q4_0), the GEMV (``schedules/gemv_qvnni_cpu.py``) or GEMM (``schedules/gemm_qvnni_cpu.py``) built with
the shape's record from ``tuning_logs/<target>/`` when there is one, else the template's default.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import time
from ctypes import POINTER, c_bool, c_char_p, c_int, c_int64, c_size_t, c_void_p
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

GGML_TYPES = {"F32": 0, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12,
              "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23}  # ggml.h's enum ggml_type
# weights per block, bytes per block, byte offsets of the block's float16 d (and dmin / m)
BLOCKS = {"Q4_0": (32, 18, (0,)), "Q4_1": (32, 20, (0, 2)), "Q5_0": (32, 22, (0,)), "Q5_1": (32, 24, (0, 2)),
          "Q8_0": (32, 34, (0,)), "Q2_K": (256, 84, (80, 82)), "Q3_K": (256, 110, (108,)),
          "Q4_K": (256, 144, (0, 2)), "Q5_K": (256, 176, (0, 2)), "Q6_K": (256, 210, (208,)),
          "IQ4_NL": (32, 18, (0,)), "IQ4_XS": (256, 136, (0,))}
# What llama.cpp loads into its CPU_REPACK buffer on x86 (ggml-cpu/repack.cpp, rows a multiple of 8):
# Q4_0, Q4_K and IQ4_NL with AVX2, Q2_K with AVX-512
REPACKED = ("Q4_0", "Q4_K", "IQ4_NL")
REPACKED_AVX512 = ("Q2_K",)


def repacked(qtype: str) -> bool:
    """Whether llama.cpp runs ``qtype`` from repacked weights on this CPU."""
    return qtype in REPACKED or (qtype in REPACKED_AVX512 and "avx512" in features())


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", c_size_t), ("mem_buffer", c_void_p), ("no_alloc", c_bool)]


class _CPlan(ctypes.Structure):  # ggml-cpu.h: struct ggml_cplan
    _fields_ = [("work_size", c_size_t), ("work_data", c_void_p), ("n_threads", c_int), ("threadpool", c_void_p),
                ("abort_callback", c_void_p), ("abort_callback_data", c_void_p), ("use_ref", c_bool)]


def lib_dir() -> Path:
    spec = importlib.util.find_spec("llama_cpp")  # not imported: that would load libllama too
    if spec is None or spec.origin is None:
        raise RuntimeError("llama-cpp-python is not installed: pip install .[bench]")
    return Path(spec.origin).parent / "lib"


@functools.cache
def ggml() -> SimpleNamespace:
    """The C functions used here, typed, as attributes without the ``ggml_`` prefix."""
    d = lib_dir()
    base = ctypes.CDLL(str(d / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(d / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    P, S = c_void_p, c_size_t
    sigs = {
        base: {"ggml_init": (P, [_InitParams]), "ggml_free": (None, [P]), "ggml_tensor_overhead": (S, []),
               "ggml_graph_overhead_custom": (S, [S, c_bool]), "ggml_row_size": (S, [c_int, c_int64]),
               "ggml_new_tensor_2d": (P, [P, c_int, c_int64, c_int64]), "ggml_get_data": (P, [P]),
               "ggml_mul_mat": (P, [P, P, P]), "ggml_new_graph_custom": (P, [P, S, c_bool]),
               "ggml_build_forward_expand": (None, [P, P]), "ggml_backend_reg_dev_get": (P, [P, S]),
               "ggml_backend_reg_get_proc_address": (P, [P, c_char_p]), "ggml_backend_buft_name": (c_char_p, [P]),
               "ggml_backend_alloc_ctx_tensors_from_buft": (P, [P, P]),
               "ggml_backend_tensor_set": (None, [P, P, S, S]), "ggml_backend_buffer_free": (None, [P]),
               # (type, src f32, dst, start, nrows, n_per_row, imatrix): llama.cpp's quantizer per row range
               "ggml_quantize_chunk": (S, [c_int, P, P, c_int64, c_int64, c_int64, P])},
        cpu: {"ggml_cpu_init": (None, []), "ggml_graph_plan": (_CPlan, [P, c_int, P]),
              "ggml_graph_compute": (c_int, [P, POINTER(_CPlan)]), "ggml_backend_cpu_reg": (P, []),
              **{f"ggml_cpu_has_{f}": (c_int, []) for f in ("avx2", "avx512", "avx512_vnni", "amx_int8")}},
    }
    ns = SimpleNamespace()
    for lib, fns in sigs.items():
        for name, (res, args) in fns.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
            setattr(ns, name.removeprefix("ggml_"), fn)
    ns.cpu_init()
    return ns


def features() -> str:
    """The CPU features this ggml build uses (compiled in and present), e.g. ``avx2+avx512+avx512_vnni``."""
    g = ggml()
    return "+".join(f for f in ("avx2", "avx512", "avx512_vnni", "amx_int8") if getattr(g, f"cpu_has_{f}")())


@functools.cache
def _repack_buft() -> int:
    g = ggml()
    reg = g.backend_cpu_reg()
    fn = g.backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    bufts = ctypes.CFUNCTYPE(POINTER(c_void_p), c_void_p)(fn)(g.backend_reg_dev_get(reg, 0))
    i = 0
    while bufts[i]:
        if g.backend_buft_name(bufts[i]) == b"CPU_REPACK":
            return bufts[i]
        i += 1
    raise RuntimeError("this ggml build has no CPU_REPACK buffer type")


def random_blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, row bytes] of random GGUF blocks: every code, scale and min byte uniform (each field
    is valid over all its values), the float16 d (dmin) small and finite. The kernels' work does not
    depend on the values."""
    qk, nbytes, f16 = BLOCKS[qtype]
    b = rng.integers(0, 256, (n, k // qk, nbytes), dtype=np.uint8)
    for at in f16:
        d = ((rng.random((n, k // qk)) + 0.5) * (2e-3 if qk == 256 else 2e-2)).astype("<f2")
        b[:, :, at : at + 2] = d.view(np.uint8).reshape(n, k // qk, 2)
    return b.reshape(n, -1)


class MulMat:
    """``y = x @ W.T`` by ggml's CPU mul_mat on raw blocks; ``copies`` copies of W, each in its own
    graph, taken in turn by successive calls (so that a decode GEMV reads its weights from DRAM,
    as in a model's step)."""

    def __init__(self, qtype: str, raw: np.ndarray, n: int, k: int, m: int, copies: int = 1,
                 threads: int = 2, repack: bool = False) -> None:
        g = self._g = ggml()
        t = GGML_TYPES[qtype]
        if raw.nbytes != n * g.row_size(t, k):
            raise ValueError(f"{qtype} [{n}, {k}] takes {n * g.row_size(t, k)} bytes, got {raw.nbytes}")
        raw = np.ascontiguousarray(raw)
        over, graph = g.tensor_overhead(), g.graph_overhead_custom(8, False)
        data = 0 if repack else copies * (raw.nbytes + 64)
        mem = over * (3 * copies + 2) + copies * graph + data + (m * k + copies * m * n) * 4 + (1 << 20)
        self._ctx = g.init(_InitParams(mem, None, False))
        self._wctx = self._buf = None
        if repack:  # the weight tensors in a no_alloc context, allocated in the CPU_REPACK buffer
            self._wctx = g.init(_InitParams(over * (copies + 1), None, True))
        ws = [g.new_tensor_2d(self._wctx or self._ctx, t, k, n) for _ in range(copies)]
        if repack:
            self._buf = g.backend_alloc_ctx_tensors_from_buft(self._wctx, _repack_buft())
            for w in ws:
                g.backend_tensor_set(w, raw.ctypes.data, 0, raw.nbytes)
        else:
            for w in ws:
                ctypes.memmove(g.get_data(w), raw.ctypes.data, raw.nbytes)
        self._x = g.new_tensor_2d(self._ctx, GGML_TYPES["F32"], k, m)
        self._graphs: list[tuple[Any, _CPlan, Any]] = []
        for w in ws:
            y = g.mul_mat(self._ctx, w, self._x)
            gf = g.new_graph_custom(self._ctx, 8, False)
            g.build_forward_expand(gf, y)
            self._graphs.append((gf, g.graph_plan(gf, threads, None), y))
        work = max(p.work_size for _, p, _ in self._graphs)
        self._work = np.empty(work + 128, np.uint8)
        for _, p, _ in self._graphs:
            p.work_data = (self._work.ctypes.data + 63) // 64 * 64
        self.shape, self.pos = (m, n, k), 0

    def set_x(self, x: np.ndarray) -> None:
        m, _, k = self.shape
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(m, k)
        ctypes.memmove(self._g.get_data(self._x), x.ctypes.data, x.nbytes)

    def __call__(self) -> None:
        self.pos = (self.pos + 1) % len(self._graphs)
        gf, plan, _ = self._graphs[self.pos]
        if self._g.graph_compute(gf, ctypes.byref(plan)) != 0:
            raise RuntimeError("ggml_graph_compute failed")

    def output(self) -> np.ndarray:
        """The last call's y [m, n] (a copy)."""
        m, n, _ = self.shape
        ptr = self._g.get_data(self._graphs[self.pos][2])
        return np.ctypeslib.as_array((ctypes.c_float * (m * n)).from_address(ptr)).reshape(m, n).copy()

    def close(self) -> None:
        if self._buf:
            self._g.backend_buffer_free(self._buf)
        for ctx in (self._wctx, self._ctx):
            if ctx:
                self._g.free(ctx)
        self._buf = self._wctx = self._ctx = None


def perfx_kernel(qtype: str, raw: np.ndarray, n: int, k: int, m: int, target: Any, db: Any) -> tuple[Any, Any, str]:
    """(VNNI weights, built kernel, label): the GEMV for one row, the GEMM (symbolic M, as a model
    compiles prefill) for more; the tuned record of the shape when tuning_logs has one."""
    from perfx_compiler.formats import ggml as ggml_formats
    from perfx_compiler.formats.gguf_blocks import BLOCK_BYTES, packed_from_blocks
    from perfx_compiler.formats.vnni import subscaled_vnni_packed
    from perfx_compiler.schedule_template import find_template
    from perfx_compiler.tune.measure import build_func

    pk = packed_from_blocks(qtype, raw, (n, k), vnni=True) if qtype in BLOCK_BYTES \
        else subscaled_vnni_packed(ggml_formats.unpack(qtype, raw, (n, k)), qtype)
    func = pk.compute("matmul", (1, 1) if m == 1 else (1, None))
    template, wl = find_template(func, target)
    assert template.name == ("gemv_qvnni_cpu" if m == 1 else "gemm_qvnni_cpu"), (qtype, m, template.name)
    rec = None if db is None else (db.best(wl.key, wl.target_key) if m == 1
                                   else db.best(wl.key, wl.target_key, bucket=m, nearest=True))
    config = rec.config if rec is not None else template.default_config(wl, target)
    rt = build_func(template.apply(func, wl, config, target), target)
    return pk, rt, f"{template.name} {'tuned' if rec else 'default'} {config}"


def perfx_call(pk: Any, rt: Any, x: np.ndarray, n: int, copies: int) -> tuple[Any, Any]:
    """(one call on the next weight copy, the last output [m, n])."""
    import tvm

    dev, (m, k) = tvm.cpu(), x.shape
    xt, yt = tvm.runtime.tensor(x.reshape(1, m, k), dev), tvm.runtime.tensor(np.zeros((1, m, n), np.float32), dev)
    arrays = [[tvm.runtime.tensor(a, dev) for _, a in pk.arrays] for _ in range(copies)]  # copies
    fn, pos = rt["main"], [0]

    def call() -> None:
        pos[0] = (pos[0] + 1) % copies
        fn(xt, *arrays[pos[0]], yt)
    return call, lambda: yt.numpy().reshape(m, n)


def l3_bytes(default: int = 32 << 20) -> int:
    """This CPU's L3 as Linux reports it (the Xeon VM: 480 MiB), else ``default``."""
    try:
        size = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return default
    return int(size[:-1]) << {"K": 10, "M": 20, "G": 30}[size[-1]] if size[-1] in "KMG" else int(size)


def burst(call: Any, budget_s: float) -> float:
    """Mean seconds per call over a burst of about ``budget_s`` (3..400 calls)."""
    time.sleep(0.25)  # the other variant's threads (OpenMP's, TVM's) stop spinning first
    t0 = time.perf_counter()
    call()
    calls = max(3, min(400, int(budget_s / max(time.perf_counter() - t0, 1e-7))))
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - t0) / calls


def machine_name() -> str:
    """The results folder of this machine: ``intel-xeon``, ``amd-epyc``, else the CPU model's first words."""
    from perfx_compiler.bench.machine import cpu_model

    words = cpu_model().lower().replace("(r)", "").replace("(tm)", "").split()
    for vendor, family in (("intel", "xeon"), ("amd", "epyc")):
        if family in words:
            return f"{vendor}-{family}"
    return "-".join(words[:2]) or "unknown"
