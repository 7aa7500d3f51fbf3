"""The ``PERFX_*`` environment variables PerfX reads, listed once: none of them changes a compiled
artifact.

What changes compiled code is a compile option (``CompileOptions`` / ``perfx-compile`` flags:
``--tuning-log``, ``--no-cubin``, ``--knob TEMPLATE.KEY=VALUE``, a target file named by its path),
recorded in ``perfx-config.json`` and part of ``LLM()``'s cache key and ``perfx-bench``'s build
stamp. The variables below only say where caches live, how the runtime runs the same kernels, or
how a benchmark times them; a test fails on a ``PERFX_*`` variable the code reads that is not here.
"""

from __future__ import annotations

# name -> where it is read and why it does not change a compiled artifact
VARIABLES: dict[str, str] = {
    "PERFX_DECODE_REPLAY": "runtime: C++ decode loop or the VM, same kernels",
    "PERFX_THREAD_POOL": "runtime: which thread pool runs the kernels' parallel loops",
    "PERFX_SPIN_US": "runtime: how long idle pool threads spin",
    "PERFX_LAZY_WEIGHTS": "loader: whether GGUF tensors are read lazily (same values)",
    "PERFX_CACHE_DIR": "where LLM() caches artifacts",
    "PERFX_KERNEL_CACHE": "where built kernels are kept between processes (the same PrimFuncs; none: not kept)",
    "PERFX_BENCH_CACHE": "where perfx-bench caches its probe library",
    "PERFX_TARGETS_CACHE": "where cross toolchains are cached",
    "PERFX_TEST_CACHE": "where tests/setup.sh unpacks the llama.cpp sources (llama-server for benchmarks is built there)",
    "PERFX_API_KEY": "perfx-serve's bearer token",
    "PERFX_NUM_TASK": "RISC-V kernel harness: threads when running under qemu",
}
