"""A thin OpenCL launcher for PerfX kernels (pyopencl), used to run adreno/mali/intel-igpu code on PoCL.

The PyPI TVM wheel has no OpenCL runtime. This launcher takes the OpenCL C of a compiled PrimFunc
(:func:`perfx_compiler.targets_exec.kernels.compile_primfunc`), builds it with the platform's
compiler and replays the host function's launches: global size = grid x block, local size =
block, buffers bound by name in the kernel's parameter order, 64-bit scalars as ``long``.
Arrays stay on the device between calls (:class:`DeviceArray`), so a whole decode step runs with
weights uploaded once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from perfx_compiler.targets_exec.kernels import CompiledPrimFunc


@dataclass
class DeviceArray:
    buffer: Any  # pyopencl.Buffer
    shape: tuple[int, ...]
    dtype: np.dtype


@dataclass
class DeviceImage:
    """An RGBA float ``image2d_array_t`` holding an array [rows, texels, 4] (a ``global.texture`` buffer)."""

    image: Any  # pyopencl.Image
    shape: tuple[int, ...]
    dtype: np.dtype


def opencl_available() -> str | None:
    """None when a usable OpenCL device exists, else the reason."""
    try:
        import pyopencl as cl
    except ImportError as err:
        return f"pyopencl missing ({err}); run tests/setup.sh"
    try:
        platforms = cl.get_platforms()
    except Exception as err:  # noqa: BLE001 - no ICD loader / platform
        return f"no OpenCL platform ({err}); install pocl-opencl-icd"
    if not any(p.get_devices() for p in platforms):
        return "OpenCL platforms have no device"
    return None


class OpenCLLauncher:
    """Runs compiled PrimFuncs on the first OpenCL device (PoCL's CPU device here)."""

    def __init__(self) -> None:
        import pyopencl as cl

        self.cl = cl
        platform = cl.get_platforms()[0]
        self.device = platform.get_devices()[0]
        self.ctx = cl.Context([self.device])
        self.queue = cl.CommandQueue(self.ctx)
        self._programs: dict[str, Any] = {}
        self._kernels: dict[int, dict[str, Any]] = {}
        self.fp16 = "cl_khr_fp16" in self.device.extensions

    # -- memory ---------------------------------------------------------------------------------
    def to_device(self, arr: np.ndarray) -> DeviceArray:
        arr = np.ascontiguousarray(arr)
        flags = self.cl.mem_flags.READ_WRITE | self.cl.mem_flags.COPY_HOST_PTR
        buf = self.cl.Buffer(self.ctx, flags, hostbuf=arr if arr.nbytes else np.zeros(1, arr.dtype))
        return DeviceArray(buf, arr.shape, arr.dtype)

    def empty(self, shape: tuple[int, ...], dtype: Any) -> DeviceArray:
        dtype = np.dtype(dtype)
        nbytes = max(int(np.prod(shape)) * dtype.itemsize, dtype.itemsize)
        return DeviceArray(self.cl.Buffer(self.ctx, self.cl.mem_flags.READ_WRITE, nbytes), tuple(shape), dtype)

    def to_image(self, arr: np.ndarray) -> DeviceImage:
        """Upload [rows, texels, 4] or [layers, rows, texels, 4] as an RGBA image array (width texels,
        height rows): float32 -> RGBA32F, float16 -> RGBA16F (read as floats), uint32 -> RGBA32UI."""
        cl = self.cl
        arr = np.ascontiguousarray(arr)
        if arr.ndim == 3:
            arr = arr[None]
        if arr.ndim != 4 or arr.shape[-1] != 4:
            raise ValueError(f"texture arrays are [layers, rows, texels, 4], got {arr.shape}")
        kinds = {"float32": cl.channel_type.FLOAT, "float16": cl.channel_type.HALF_FLOAT,
                 "uint32": cl.channel_type.UNSIGNED_INT32}
        if str(arr.dtype) not in kinds:
            raise ValueError(f"no RGBA image format for {arr.dtype}")
        fmt = cl.ImageFormat(cl.channel_order.RGBA, kinds[str(arr.dtype)])
        flags = cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR
        shape = (arr.shape[2], arr.shape[1], arr.shape[0])
        image = cl.Image(self.ctx, flags, fmt, shape=shape, is_array=True, hostbuf=arr)
        return DeviceImage(image, arr.shape, arr.dtype)

    def to_host(self, dev: DeviceArray) -> np.ndarray:
        out = np.empty(dev.shape, dev.dtype)
        if out.nbytes:
            self.cl.enqueue_copy(self.queue, out, dev.buffer)
        self.queue.finish()
        return out

    def view(self, dev: DeviceArray, shape: tuple[int, ...]) -> DeviceArray:
        return DeviceArray(dev.buffer, tuple(shape), dev.dtype)

    # -- kernels --------------------------------------------------------------------------------
    def program(self, cf: CompiledPrimFunc) -> Any:
        prog = self._programs.get(cf.source)
        if prog is None:
            src = cf.source
            if "half" in src and not self.fp16:
                raise RuntimeError(f"{cf.name}: fp16 kernel but the OpenCL device has no cl_khr_fp16")
            prog = self.cl.Program(self.ctx, src).build()
            self._programs[cf.source] = prog
        return prog

    def _kernel(self, prog: Any, name: str) -> Any:
        kernels = self._kernels.get(id(prog))
        if kernels is None:
            kernels = {k.function_name: k for k in prog.all_kernels()}
            self._kernels[id(prog)] = kernels
        return kernels[name]

    def run(self, cf: CompiledPrimFunc, values: list[Any]) -> None:
        """Launch ``cf`` on ``values`` (DeviceArray for buffers, ints for scalar parameters)."""
        prog = self.program(cf)
        for launch in cf.plan(values):
            kernel = self._kernel(prog, launch.kernel)
            args = []
            for a in launch.args:
                if a[0] == "buffer":
                    v = values[a[1]]
                    args.append(v.image if isinstance(v, DeviceImage) else v.buffer)
                else:
                    args.append(np.dtype(a[2]).type(a[1]))
            kernel.set_args(*args)
            local = launch.block
            global_size = tuple(g * b for g, b in zip(launch.grid, launch.block, strict=True))
            if 0 in global_size:
                continue
            self.cl.enqueue_nd_range_kernel(self.queue, kernel, global_size, local)
        self.queue.finish()

    def run_numpy(self, cf: CompiledPrimFunc, arrays: list[Any]) -> list[Any]:
        """Copy numpy arguments in, run, copy every buffer back (in-place outputs included)."""
        textures = texture_params(cf)
        values = [
            (self.to_image(a) if i in textures else self.to_device(a)) if isinstance(a, np.ndarray) else a
            for i, a in enumerate(arrays)
        ]
        self.run(cf, values)
        return [self.to_host(v) if isinstance(v, DeviceArray) else v for v in values]


def texture_params(cf: CompiledPrimFunc) -> set[int]:
    """Indices of ``cf``'s parameters in scope ``global.texture`` (images), when its source reads images."""
    if not re.search(r"image2d(_array)?_t", cf.source):
        return set()
    return {i for i, p in enumerate(cf.func.params) if hasattr(p, "scope") and "texture" in str(p.scope())}
