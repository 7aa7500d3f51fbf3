"""TVM with its compiler library, or one clear error.

``perfx_compiler.runtime`` loads TVM runtime-only when it is imported first (a deployed runtime needs no
compiler). TVM cannot add its compiler library to a process afterwards: its compiler modules would then
fail deep inside ``tvm.relax`` with an AttributeError. The compiler-side packages (``pipeline``,
``passes``, ``tune``, ``frontend``, ``schedules``) import this module before anything else of TVM's, so
that order gets one line saying what to do instead, whichever of them a script imports.
"""

from __future__ import annotations

from perfx_compiler.tvm_import import torch_hidden

with torch_hidden():  # tvm_ffi would import it: ~200 MB, ~1.5 s
    import tvm

if getattr(tvm.base, "_RUNTIME_ONLY", False):
    raise ImportError(
        "PerfX's compiler needs TVM's compiler library, but this process loaded TVM runtime-only "
        "(perfx_compiler.runtime was imported first): import perfx_compiler.pipeline before "
        "perfx_compiler.runtime, or compile in another process (perfx-compile)"
    )
