"""Read bandwidth of a CPU device reached through TVM RPC: the ceiling that ``perfx-bench --rpc-tracker``
divides its achieved GB/s by, measured on the device as the local bench measures its own machine.

A kernel built here for the target sums a buffer far larger than a phone's or a board's last-level
cache: ``tasks`` parallel chunks, 16 float lanes each. The buffer is allocated on the device and
never uploaded (its contents do not matter for the bytes read). It is timed there with
``time_evaluator``, best of ``repeat``. GPU targets are not probed and keep the target description's
nominal figure.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from perfx_compiler.targets import TargetDescription

LANES = 16


def read_kernel(n_floats: int, tasks: int) -> Any:
    """PrimFunc ``main(a[n], out[tasks * 16])``: out holds each task's 16-lane partial sums of its chunk of a."""
    from tvm.script import tirx as T

    chunk = n_floats // tasks // LANES

    @T.prim_func(private=True)
    def read_bw(a_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        A = T.match_buffer(a_h, (n_floats,), "float32")
        OUT = T.match_buffer(o_h, (tasks * LANES,), "float32")
        for t in T.parallel(tasks):
            acc = T.decl_buffer((LANES,), "float32", scope="local")
            for ln in T.vectorized(LANES):
                acc[ln] = T.float32(0)
            for i in T.serial(chunk):
                for ln in T.vectorized(LANES):
                    acc[ln] = acc[ln] + A[(t * chunk + i) * LANES + ln]
            for ln in T.vectorized(LANES):
                OUT[t * LANES + ln] = acc[ln]

    return read_bw


def fill_kernel(n_floats: int, tasks: int) -> Any:
    """PrimFunc ``fill(a[n])``: writes every element, so the read finds real pages (an untouched
    allocation reads as the shared zero page, from the cache)."""
    from tvm.script import tirx as T

    chunk = n_floats // tasks // LANES

    @T.prim_func(private=True)
    def fill(a_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        A = T.match_buffer(a_h, (n_floats,), "float32")
        for t in T.parallel(tasks):
            for i in T.serial(chunk):
                for ln in T.vectorized(LANES):
                    A[(t * chunk + i) * LANES + ln] = T.float32(1)

    return fill


class DeviceReadProbe:
    """The read kernel built for ``target`` and loaded on the device once; each :meth:`gbs` call fills a
    fresh ``mib`` MiB buffer there, times the read and frees the buffer (not held while a model runs)."""

    def __init__(self, session: Any, device: Any, target: TargetDescription, mib: int = 256) -> None:
        import tvm
        from tvm.support import cc

        from perfx_compiler.stack_alloca import tir_pipeline_for

        self.device = device
        self.tasks = max(1, int(target.cores or 1))
        self.n = (mib << 20) // 4 // (self.tasks * LANES) * (self.tasks * LANES)
        mod = tvm.IRModule({"main": read_kernel(self.n, self.tasks).with_attr("global_symbol", "main"),
                            "fill": fill_kernel(self.n, self.tasks).with_attr("global_symbol", "fill")})
        lib = tvm.compile(mod, target.tvm(), tir_pipeline=tir_pipeline_for(target.family))
        # a fresh name per upload: rewriting a library the server has loaded crashes it
        name = f"perfx_read_bw_{self.n}_{time.time_ns()}.so"
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, name)
            kwargs = {"fcompile": cc.cross_compiler(target.cross_compiler)} if target.cross_compiler else {}
            lib.export_library(path, **kwargs)
            session.upload(path)
        self.remote = session.load_module(name)

    def gbs(self, repeat: int = 5) -> float:
        """GB/s of the fastest of ``repeat`` passes over the buffer."""
        import tvm

        a = tvm.runtime.empty((self.n,), "float32", self.device)
        out = tvm.runtime.empty((self.tasks * LANES,), "float32", self.device)
        self.remote["fill"](a)
        timer = self.remote.time_evaluator("main", self.device, number=1, repeat=repeat)
        return self.n * 4 / min(timer(a, out).results) / 1e9


def device_read_probe(session: Any, device: Any, target: TargetDescription, mib: int = 256) -> DeviceReadProbe | None:
    """The probe for a CPU target; None for GPU targets (not probed: they keep the nominal figure)."""
    return DeviceReadProbe(session, device, target, mib) if target.family == "cpu" else None
