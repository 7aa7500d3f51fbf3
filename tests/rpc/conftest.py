"""A TVM RPC device farm on loopback for the tests: a tracker and servers (TVM's own
``tvm.exec.rpc_server``, or the qemu-aarch64 one), each its own process group, killed on teardown."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from perfx_compiler.tune.rpc import free_servers

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def matmul_groups(target, dims=((64, 96), (128, 64))):
    """Two small matmul workloads (K, N) at M=16: the kernels a model's projections give."""
    import tvm

    from perfx_compiler.tune.session import group_tasks
    from perfx_compiler.tune.workloads import extract_tasks, linear_module, matmul_func

    mod = tvm.IRModule()
    for i, (k, n) in enumerate(dims):
        mod[f"mm{i}"] = matmul_func(linear_module(None, k, n, None, True)).with_attr("global_symbol", f"mm{i}")
    return group_tasks(extract_tasks(mod, target, buckets=(16,)))


class Farm:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []
        self.env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        self.port = free_port()
        self.tracker = self._start([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", "127.0.0.1",
                                    "--port", str(self.port), "--port-end", str(self.port + 1), "--silent"], "tracker")
        self.addr = ("127.0.0.1", self.port)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(self.addr, timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("the RPC tracker did not start")

    def _start(self, cmd: list[str], name: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}-{len(self.procs)}.log", "w")  # noqa: SIM115 - kept open for the process
        proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def server(self, key: str, qemu: bool = False) -> subprocess.Popen:
        """Start one server of ``key`` and wait until the tracker lists it free."""
        port = free_port()
        before = free_servers(self.addr, key)
        mod = "perfx_compiler.targets_exec.qemu_rpc" if qemu else "tvm.exec.rpc_server"
        cmd = [sys.executable, "-m", mod, "--tracker", f"127.0.0.1:{self.port}", "--key", key,
               "--host", "127.0.0.1", "--port", str(port), "--port-end", str(port + 1)]
        proc = self._start(cmd, key)
        deadline = time.monotonic() + 120
        while free_servers(self.addr, key) <= before:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"RPC server {key} did not register: {(self.tmp / f'{key}-{len(self.procs) - 1}.log').read_text()[-2000:]}")
            time.sleep(0.3)
        return proc

    def kill(self, proc: subprocess.Popen) -> None:
        """The server and its session children (TVM serves each session in a child process)."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            self.kill(proc)


@pytest.fixture
def rpc_farm(tmp_path):
    farm = Farm(tmp_path)
    try:
        yield farm
    finally:
        farm.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny random Llama GGUF and its x86 host build (the reference a remote run must match)."""
    from perfx_compiler.model.testing import write_tiny_gguf
    from perfx_compiler.pipeline import compile_model

    folder = tmp_path_factory.mktemp("rpc-tiny")
    gguf, _ = write_tiny_gguf(folder / "tiny.gguf", context_length=128)
    host = compile_model(str(gguf), "host", folder / "host", progress=False, max_context=64)
    return gguf, host
