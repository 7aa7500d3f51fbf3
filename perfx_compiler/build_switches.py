"""The ``PERFX_*`` environment variables that change a compiled artifact, listed once.

These are A/B switches of past experiments (issue #23 will retire most of them). While they exist,
every compile-side read goes through :func:`build_switch`, which refuses a name missing from
:data:`BUILD_SWITCHES`, so this list cannot fall behind the code. The values in effect
(:func:`build_switches`) are recorded in ``perfx-config.json`` (``"build_switches"``) and are part
of the ``LLM`` compile cache key (runtime/api.py) and of ``perfx-bench``'s build stamp
(bench/models.py): an artifact built under a switch is never reused without it.

Every other ``PERFX_*`` variable the code reads is in :data:`OTHER_VARIABLES`, with why it does not
change what is compiled (a test fails on a variable in neither list).

Imports nothing but ``os``: the thin runtime computes the cache key with it.
"""

from __future__ import annotations

import os

# name -> where it is read and what it changes
BUILD_SWITCHES: dict[str, str] = {
    # graph passes
    "PERFX_BATCH_GEMV": "passes/_qlinear.py: 0 = dequantize + GEMM for few-row batched linears",
    "PERFX_VNNI_GEMM": "passes/_qlinear.py: 0 = dequantize + float GEMM for int8-activation prefill",
    "PERFX_GEMV_SWIGLU_EPILOGUE": "passes/fuse_gemv_prologue.py: 0 = swiglu as down's prologue",
    # VM lowering
    "PERFX_REUSE_VIEWS": "pipeline.py: 0 = alloc_tensor + kill per use instead of one view per buffer",
    # schedule template defaults
    "PERFX_ATTN_DECODE_PREFETCH": "schedules/attention_cpu.py: keys ahead the decode kernel prefetches",
    "PERFX_ATTN_DECODE_SPLITS": "schedules/attention_cpu.py: decode attention splits per kv head",
    "PERFX_GEMV_UNPACK_ONCE": "schedules/gemv_int4_cpu.py: 0 = per-row kernel for several rows",
    "PERFX_VNNI_GEMV_BASE": "schedules/gemv_qvnni_cpu.py: 1 = the kernel before split/hinib",
    "PERFX_VNNI_GEMV_LONG_ROWS": "schedules/gemv_qvnni_cpu.py: long-row mode (hinib | plain | split)",
    "PERFX_VNNI_GEMV_NTA": "schedules/gemv_qvnni_cpu.py: non-temporal code prefetch",
    "PERFX_VNNI_GEMV_PLOC": "schedules/gemv_qvnni_cpu.py: prefetch locality",
    "PERFX_VNNI_GEMV_PQUANT": "schedules/gemv_qvnni_cpu.py: x quantized in its own parallel loop",
    "PERFX_VNNI_GEMV_PREFETCH": "schedules/gemv_qvnni_cpu.py: code prefetch distance (0 = hardware only)",
    "PERFX_VNNI_GEMV_QTREE": "schedules/gemv_qvnni_cpu.py: x's group max/sum folded in registers",
    "PERFX_VNNI_GEMV_SPREFETCH": "schedules/gemv_qvnni_cpu.py: scale chunks prefetched with the codes",
    "PERFX_VNNI_GEMV_TQUANT": "schedules/gemv_qvnni_cpu.py: x quantized per task after the fork",
    # what the build reads besides the model
    "PERFX_TUNING_LOGS": "tune/records.py: tuning-record root ('none': template defaults only)",
    "PERFX_TARGETS_DIR": "targets.py: where target files (codegen settings, template defaults) come from",
    "PERFX_NO_CUBIN": "device_export.py: 1 = CUDA artifacts without the nvcc-built cubin",
}

# PERFX_* variables that do not change a compiled artifact: name -> why
OTHER_VARIABLES: dict[str, str] = {
    "PERFX_DECODE_REPLAY": "runtime: C++ decode loop or the VM, same kernels",
    "PERFX_THREAD_POOL": "runtime: which thread pool runs the kernels' parallel loops",
    "PERFX_SPIN_US": "runtime: how long idle pool threads spin",
    "PERFX_WEIGHTS_THP": "runtime: how the weight arena is allocated",
    "PERFX_LAZY_WEIGHTS": "loader: whether GGUF tensors are read lazily (same values)",
    "PERFX_CACHE_DIR": "where LLM() caches artifacts",
    "PERFX_BENCH_CACHE": "where perfx-bench caches its probe library",
    "PERFX_TARGETS_CACHE": "where cross toolchains are cached",
    "PERFX_API_KEY": "perfx-serve's bearer token",
    "PERFX_BENCH_DECODE_LOOP": "perfx-bench: which decode loop times the artifact",
    "PERFX_NUM_TASK": "RISC-V kernel harness: threads when running under qemu",
}


def build_switch(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)`` for a listed build switch; an unlisted name is a bug
    (its value would change artifacts without reaching the manifest or the cache keys)."""
    if name not in BUILD_SWITCHES:
        raise KeyError(f"{name} is not in perfx_compiler.build_switches.BUILD_SWITCHES; list it there")
    return os.environ.get(name, default)


def build_switches(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The build switches set in ``environ`` (default: this process's), name -> value, sorted."""
    env = os.environ if environ is None else environ
    return {name: env[name] for name in sorted(BUILD_SWITCHES) if name in env}
