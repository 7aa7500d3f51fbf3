"""TVM's runtime through tvm_ffi and ``libtvm_runtime.so`` alone, without the ``tvm`` Python package.

A deployed engine needs four things from TVM: load ``model.so``, the Relax VM's module functions, tensors
and copies. The ``tvm`` package imports its IR, TIR and RPC modules even runtime-only (138 modules, +35 MiB
resident over tvm_ffi), which issue #26 counts against peak RSS (weights + KV cache + 10%). Here the runtime
library is loaded with ``ctypes`` and every call goes through its registered global functions, which
``tvm.runtime`` itself wraps. A device other than the CPU imports ``tvm.runtime`` too (runtime-only): the
package's backend loaders register the CUDA / OpenCL / Vulkan device APIs.

Tensors returned here are ``tvm_ffi`` tensors (``tvm.runtime.Tensor`` ones where the package is imported):
the functions below take either.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from perfx_compiler.tvm_import import torch_hidden

with torch_hidden():  # (tvm_ffi imports torch when it is installed: ~200 MB)
    import tvm_ffi
    from tvm_ffi.libinfo import load_lib_ctypes

POOLED_ALLOCATOR = 2  # the VM's allocator kinds (tvm.runtime.vm.VirtualMachine): 1 naive, 2 pooled
CPU = 1  # kDLCPU

_loaded: dict[str, Any] = {}


def _load_runtime_library() -> None:
    """``libtvm_runtime.so`` of the installed TVM, loaded global (model.so links against its symbols),
    once; where ``tvm`` is already imported its own load is the same library."""
    if "lib" in _loaded:
        return
    paths = [Path(os.environ["TVM_LIBRARY_PATH"])] if os.environ.get("TVM_LIBRARY_PATH") else []
    spec = importlib.util.find_spec("tvm")  # (finds the package without running its __init__)
    if spec is not None and spec.submodule_search_locations:
        paths += [Path(p) / "lib" for p in spec.submodule_search_locations]
    _loaded["lib"] = load_lib_ctypes("apache-tvm", "tvm_runtime", "RTLD_GLOBAL", extra_lib_paths=paths)


def _device_backends() -> None:
    """A non-CPU device: the ``tvm`` package's runtime import, whose backends load the device libraries."""
    if "tvm" in sys.modules:
        return
    os.environ["TVM_USE_RUNTIME_LIB"] = "1"  # for this import only: a child compile must load the compiler
    try:
        with torch_hidden():
            import tvm.runtime  # noqa: F401
    finally:
        del os.environ["TVM_USE_RUNTIME_LIB"]


def _fn(name: str) -> Any:
    if name not in _loaded:
        _loaded[name] = tvm_ffi.get_global_func(name)
    return _loaded[name]


def device(name: str) -> Any:
    """The device ``name`` ("cpu", "cuda", "opencl:1", ...), with the runtime loaded for it."""
    _load_runtime_library()
    dev = tvm_ffi.device(name)
    if dev.dlpack_device_type() != CPU:
        _device_backends()
    return dev


def load_module(path: str | Path) -> Any:
    """A compiled library (``model.so``)."""
    _load_runtime_library()
    return tvm_ffi.load_module(str(path))


def empty(shape: Sequence[int], dtype: Any, dev: Any, mem_scope: str | None = None) -> Any:
    """An uninitialized tensor on ``dev`` (``mem_scope``: e.g. ``global.texture``)."""
    return _fn("runtime.TVMTensorAllocWithScope")(tvm_ffi.Shape([int(d) for d in shape]), str(np.dtype(dtype)),
                                                  dev, mem_scope)


def copy_from(tensor: Any, arr: np.ndarray) -> None:
    """Copy the host array ``arr`` (same shape and dtype) into ``tensor``."""
    arr = np.ascontiguousarray(arr)
    _fn("runtime.TVMTensorCopyFromBytes")(tensor, arr.ctypes.data_as(ctypes.c_void_p), arr.nbytes)


def tensor(arr: np.ndarray, dev: Any) -> Any:
    """A new tensor on ``dev`` holding a copy of ``arr``."""
    out = empty(arr.shape, arr.dtype, dev)
    copy_from(out, arr)
    return out


def from_dlpack(arr: Any) -> Any:
    """A tensor sharing ``arr``'s memory (no copy)."""
    return tvm_ffi.from_dlpack(arr)


def to_numpy(t: Any) -> np.ndarray:
    """A host copy of the tensor ``t``."""
    if t.device.dlpack_device_type() == CPU:
        return np.from_dlpack(t).copy()
    out = np.empty(tuple(t.shape), dtype=str(t.dtype))
    _fn("runtime.TVMTensorCopyToBytes")(t, out.ctypes.data_as(ctypes.c_void_p), out.nbytes)
    return out


class VirtualMachine:
    """The Relax VM of a loaded library on one device (and the CPU, for shape functions), pooled
    allocator: what ``tvm.runtime.vm.VirtualMachine`` sets up, with the calls the engine makes."""

    def __init__(self, lib: Any, dev: Any) -> None:
        self.module = lib["vm_load_executable"]()
        init = [dev.dlpack_device_type(), dev.index, POOLED_ALLOCATOR]
        if dev.dlpack_device_type() != CPU:
            init += [CPU, 0, POOLED_ALLOCATOR]
        self.module["vm_initialization"](*init)
        self._set_input = self.module["set_input"]
        self.invoke_stateful = self.module["invoke_stateful"]
        self.get_output = self.module["get_output"]
        self.set_instrument = self.module["set_instrument"]

    def __getitem__(self, name: str) -> Any:
        return self.module[name]

    def set_input(self, func_name: str, *args: Any) -> None:
        """Bind ``args`` (tensors) as ``func_name``'s arguments for :meth:`invoke_stateful`."""
        self._set_input(func_name, *args)


def clear_pool() -> None:
    """Free the VM allocators' pooled buffers that no tensor holds."""
    _fn("vm.builtin.memory_manager.clear")()
