"""Schedule templates, one per module, tried in the order of ``TEMPLATES`` (dlight's shape: the first
template whose ``match`` accepts a PrimFunc schedules it; the others decline).

Adding a template means adding a module here that defines ``TEMPLATE`` (a ``ScheduleTemplate``
instance) and one line in ``TEMPLATES`` at the place it should be tried. A template module missing
from the list fails tests/schedules/test_template_list.py. Modules whose names start with ``_`` are
helpers, not templates.
"""

from __future__ import annotations

import importlib
from typing import Any

import perfx_compiler.tvm_compiler  # noqa: F401  (before tvm.relax: one line if TVM was loaded runtime-only)
from perfx_compiler.tvmscript_speedups import install as _install_tvmscript_speedups

_install_tvmscript_speedups()  # the templates' kernels are TVMScript (perfx_compiler/tvmscript_speedups.py)

# Tried first to last; a template earlier in the list sees a PrimFunc before the ones after it.
TEMPLATES: list[str] = [
    "attention_cpu",  # before the generic templates (the fallback would take the function as it is)
    "gemm_qvnni_cpu",  # before gemv_qvnni_cpu, which rejects rows it cannot hold
    "gemv_qvnni_cpu",  # before gemv_int4_cpu / gemv_int8_cpu (which decline this layout anyway)
    "gemv_half_cpu",  # the quantized and half GEMVs before the float templates, which do not
    "gemv_int4_cpu",  # understand their functions anyway
    "gemv_int8_cpu",
    "gemv_cpu",
    "gemm_half_cpu",  # before gemm_cpu (which declines half B anyway)
    "gemm_cpu",
    "gpu_matmul",  # the GPU templates (dlight rules) decline CPU targets, the CPU templates GPU ones
    "gpu_gemv",
    "gpu_low_batch_gemv",
    "gpu_reduction",
    "gpu_general_reduction",
    "reduction_cpu",
    "elementwise_cpu",
    "gpu_fallback",  # the fallbacks last: they take any function
    "fallback_cpu",
]


def discover(reload: bool = False) -> list[Any]:
    """The ``TEMPLATE`` of every module in ``TEMPLATES``, in that order."""
    found = []
    for name in TEMPLATES:
        module = importlib.import_module(f"{__name__}.{name}")
        if reload:
            module = importlib.reload(module)
        found.append(module.TEMPLATE)
    return found
