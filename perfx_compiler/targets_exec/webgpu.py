"""A thin WebGPU launcher for PerfX kernels (wgpu-py), used to run the vulkan target's WGSL on lavapipe.

The PyPI TVM wheel has no SPIR-V codegen and no WebGPU runtime; the vulkan target compiles to WGSL
(TVM's webgpu codegen), which ``wgpu`` runs on any Vulkan device (Mesa's lavapipe here). This
launcher replays a compiled PrimFunc's host launches the way TVM's web runtime
(``web/src/webgpu.ts``) does:

* each kernel is its own WGSL program (``// Function: <name>`` chunks of the module source);
* ``@group(0) @binding(i)`` is the i-th buffer argument of the launch (kernel parameters sorted by
  name), then one uniform struct of the scalar arguments followed by ``packGridDimX: u32`` (the
  blockIdx.x extent), padded to 16 bytes;
* dispatch ``(gx, gy, gz)``; a blockIdx.x extent of 65536 or more is halved into blockIdx.z
  (``packGridDimX`` keeps the full extent).

Limits are the WebGPU defaults the target file promises (256 invocations and 16 KiB of workgroup
storage), with the adapter's storage-buffer count and sizes. Arrays stay on the device
(:class:`DeviceArray`), so a decode step uploads weights once.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from perfx_compiler.targets_exec.kernels import CompiledPrimFunc

MAX_GRID_X = 65535
_BINDING_RE = re.compile(r"@group\(0\) @binding\((\d+)\) var<(storage|uniform)(?:, (read|read_write))?> (\w+)")
_POD_RE = re.compile(r"struct PODArgs \{(.*?)\}", re.S)


@dataclass
class DeviceArray:
    buffer: Any  # wgpu.GPUBuffer
    shape: tuple[int, ...]
    dtype: np.dtype


@dataclass
class WGSLKernel:
    name: str
    source: str
    bindings: list[tuple[int, str, str]]  # (binding, "storage"|"uniform", "read"|"read_write"|"")
    pod_fields: list[tuple[str, str]]  # (name, wgsl type) of the uniform struct, packGridDimX last


def webgpu_available() -> str | None:
    """None when wgpu finds an adapter (lavapipe on a CPU-only machine), else the reason."""
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
    try:
        import wgpu
    except ImportError as err:
        return f"wgpu missing ({err}); run tests/setup.sh"
    try:
        adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    except Exception as err:  # noqa: BLE001 - no Vulkan loader / ICD
        return f"no WebGPU adapter ({err}); install mesa-vulkan-drivers libvulkan1"
    if adapter is None:
        return "no WebGPU adapter; install mesa-vulkan-drivers libvulkan1"
    return None


def split_wgsl(source: str) -> dict[str, WGSLKernel]:
    """The per-kernel WGSL programs of a module's ``inspect_source()`` (chunks may repeat: keep the first
    with code)."""
    out: dict[str, WGSLKernel] = {}
    for part in re.split(r"(?m)^(?=// Function: )", source):
        m = re.match(r"// Function: (\S+)", part)
        if m is None or "@compute" not in part or m.group(1) in out:
            continue
        bindings = [(int(b), kind, mode or "") for b, kind, mode, _ in _BINDING_RE.findall(part)]
        pod = _POD_RE.search(part)
        fields: list[tuple[str, str]] = []
        if pod is not None:
            for line in pod.group(1).split(","):
                if ":" in line:
                    name, ty = (x.strip() for x in line.split(":", 1))
                    fields.append((name, ty))
        out[m.group(1)] = WGSLKernel(m.group(1), part, sorted(bindings), fields)
    return out


class WebGPULauncher:
    """Runs compiled PrimFuncs (WGSL) on the first wgpu adapter (lavapipe here)."""

    def __init__(self, max_invocations: int = 256, max_workgroup_storage: int = 16384) -> None:
        os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
        import wgpu

        self.wgpu = wgpu
        self.adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
        lim = self.adapter.limits
        limits = {
            "max-storage-buffers-per-shader-stage": lim["max-storage-buffers-per-shader-stage"],
            "max-storage-buffer-binding-size": lim["max-storage-buffer-binding-size"],
            "max-buffer-size": lim["max-buffer-size"],
            "max-compute-invocations-per-workgroup": min(max_invocations, lim["max-compute-invocations-per-workgroup"]),
            "max-compute-workgroup-storage-size": min(max_workgroup_storage, lim["max-compute-workgroup-storage-size"]),
        }
        # f16 buffers (quantized weights' scales) need WGSL's `enable f16`, i.e. the shader-f16 feature
        features = [f for f in ("shader-f16",) if f in self.adapter.features]
        self.device = self.adapter.request_device_sync(required_features=features, required_limits=limits)
        self.usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        self._kernels: dict[str, dict[str, WGSLKernel]] = {}
        self._pipelines: dict[tuple[str, str], tuple[Any, Any]] = {}
        self.launches = 0

    # -- memory ---------------------------------------------------------------------------------
    def to_device(self, arr: np.ndarray) -> DeviceArray:
        arr = np.ascontiguousarray(arr)
        nbytes = max(-(-arr.nbytes // 4) * 4, 4)
        buf = self.device.create_buffer(size=nbytes, usage=self.usage)
        if arr.nbytes:
            data = arr.tobytes()
            self.device.queue.write_buffer(buf, 0, data + b"\0" * (nbytes - len(data)))
        return DeviceArray(buf, arr.shape, arr.dtype)

    def empty(self, shape: tuple[int, ...], dtype: Any) -> DeviceArray:
        dtype = np.dtype(dtype)
        nbytes = max(-(-int(np.prod(shape)) * dtype.itemsize // 4) * 4, 4)
        return DeviceArray(self.device.create_buffer(size=nbytes, usage=self.usage), tuple(shape), dtype)

    def to_host(self, dev: DeviceArray) -> np.ndarray:
        n = int(np.prod(dev.shape))
        if n == 0:
            return np.empty(dev.shape, dev.dtype)
        raw = self.device.queue.read_buffer(dev.buffer)
        return np.frombuffer(bytes(raw), dtype=dev.dtype, count=n).reshape(dev.shape).copy()

    def view(self, dev: DeviceArray, shape: tuple[int, ...]) -> DeviceArray:
        return DeviceArray(dev.buffer, tuple(shape), dev.dtype)

    # -- kernels --------------------------------------------------------------------------------
    def kernels(self, cf: CompiledPrimFunc) -> dict[str, WGSLKernel]:
        found = self._kernels.get(cf.source)
        if found is None:
            if "enable f16" in cf.source and "shader-f16" not in self.adapter.features:
                raise RuntimeError(f"{cf.name}: fp16 kernel but the adapter has no shader-f16")
            found = split_wgsl(cf.source)
            self._kernels[cf.source] = found
        return found

    def _pipeline(self, kernel: WGSLKernel) -> tuple[Any, Any]:
        key = (kernel.source, kernel.name)
        if key not in self._pipelines:
            wgpu = self.wgpu
            entries = []
            for binding, kind, mode in kernel.bindings:
                if kind == "uniform":
                    layout = {"buffer": {"type": wgpu.BufferBindingType.uniform}}
                elif mode == "read":
                    layout = {"buffer": {"type": wgpu.BufferBindingType.read_only_storage}}
                else:
                    layout = {"buffer": {"type": wgpu.BufferBindingType.storage}}
                entries.append({"binding": binding, "visibility": wgpu.ShaderStage.COMPUTE, **layout})
            bgl = self.device.create_bind_group_layout(entries=entries)
            layout = self.device.create_pipeline_layout(bind_group_layouts=[bgl])
            module = self.device.create_shader_module(code=kernel.source)
            pipeline = self.device.create_compute_pipeline(
                layout=layout, compute={"module": module, "entry_point": kernel.name}
            )
            self._pipelines[key] = (pipeline, bgl)
        return self._pipelines[key]

    def _pod(self, kernel: WGSLKernel, scalars: list[tuple[Any, str]], grid_x: int) -> bytes:
        fields = kernel.pod_fields
        if len(fields) != len(scalars) + 1 or fields[-1][0] != "packGridDimX":
            raise RuntimeError(f"{kernel.name}: uniform struct {fields} does not match scalar args {scalars}")
        data = b""
        for (_, ty), (value, _) in zip(fields[:-1], scalars, strict=True):
            data += struct.pack({"i32": "<i", "u32": "<I", "f32": "<f"}[ty], value if ty == "f32" else int(value))
        data += struct.pack("<I", grid_x)
        return data + b"\0" * ((-len(data)) % 16)

    def run(self, cf: CompiledPrimFunc, values: list[Any]) -> None:
        """Launch ``cf`` on ``values`` (DeviceArray for buffers, ints for scalar parameters)."""
        kernels = self.kernels(cf)
        encoder = self.device.create_command_encoder()
        for launch in cf.plan(values):
            if 0 in launch.grid:
                continue
            kernel = kernels[launch.kernel]
            pipeline, bgl = self._pipeline(kernel)
            buffers = [values[a[1]].buffer for a in launch.args if a[0] == "buffer"]
            scalars = [(a[1], a[2]) for a in launch.args if a[0] == "scalar"]
            storage = [b for b in kernel.bindings if b[1] == "storage"]
            if len(storage) != len(buffers):
                raise RuntimeError(f"{launch.kernel}: {len(storage)} storage bindings, {len(buffers)} buffer args")
            entries = [
                {"binding": b[0], "resource": {"buffer": buf, "offset": 0, "size": buf.size}}
                for b, buf in zip(storage, buffers, strict=True)
            ]
            gx, gy, gz = launch.grid
            uniform = [b for b in kernel.bindings if b[1] == "uniform"]
            if uniform:
                pod = self.device.create_buffer_with_data(
                    data=self._pod(kernel, scalars, gx), usage=self.wgpu.BufferUsage.UNIFORM
                )
                entries.append({"binding": uniform[0][0], "resource": {"buffer": pod, "offset": 0, "size": pod.size}})
            if gz != 1:
                raise RuntimeError(f"{launch.kernel}: blockIdx.z is reserved by the WebGPU launch convention")
            while gx > MAX_GRID_X:  # as TVM's web runtime: spread blockIdx.x over blockIdx.z
                gx, gz = (gx + 1) // 2, gz * 2
            group = self.device.create_bind_group(layout=bgl, entries=entries)
            cpass = encoder.begin_compute_pass()
            cpass.set_pipeline(pipeline)
            cpass.set_bind_group(0, group)
            cpass.dispatch_workgroups(gx, gy, gz)
            cpass.end()
            self.launches += 1
        self.device.queue.submit([encoder.finish()])

    def run_numpy(self, cf: CompiledPrimFunc, arrays: list[Any]) -> list[Any]:
        """Copy numpy arguments in, run, copy every buffer back (in-place outputs included)."""
        values = [self.to_device(a) if isinstance(a, np.ndarray) else a for a in arrays]
        self.run(cf, values)
        return [self.to_host(v) if isinstance(v, DeviceArray) else v for v in values]
