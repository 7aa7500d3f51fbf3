"""llama.cpp's own HTTP server (``llama-server``) as a serving peer: built with CMake from the llama.cpp
sources in the llama-cpp-python source distribution that ``tests/setup.sh`` unpacks (the same llama.cpp
as the Python binding the other benchmarks use), started on loopback with parallel slots and continuous
batching, stopped on exit."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from perfx_compiler.errors import PerfXError

LLAMA_CPP_VERSION = "0.3.36"  # tests/setup.sh's LLAMA_CPP_VERSION: one llama.cpp for binding and server


def _cache() -> Path:
    return Path(os.environ.get("PERFX_TEST_CACHE") or Path.home() / ".cache" / "perfx-test")


def llama_cpp_source() -> Path:
    """The llama.cpp tree inside the unpacked llama-cpp-python sdist."""
    src = _cache() / f"llama_cpp_python-{LLAMA_CPP_VERSION}" / "vendor" / "llama.cpp"
    if not (src / "CMakeLists.txt").is_file():
        raise PerfXError(f"no llama.cpp sources at {src}; run `bash tests/setup.sh` first (it unpacks them)")
    return src


def cmake_cpu_args() -> list[str]:
    """ggml's CPU flags: native, except on a CPU with AMX, whose tile state some VMs do not grant (ggml's
    AMX kernels then die of SIGSEGV): there the AVX-512 set without AMX, as tests/setup.sh builds the binding."""
    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
    if "amx_tile" not in flags:
        return []
    args = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON".split()
    if "avx512f" in flags:
        args += ("-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON "
                 "-DGGML_AVX_VNNI=ON").split()
    return args


def build_llama_server(jobs: int | None = None, log: Path | None = None) -> Path:
    """The ``llama-server`` binary, built on first use (several minutes on 2 cores) into the test cache."""
    out = _cache() / f"llama-server-{LLAMA_CPP_VERSION}"
    binary = out / "bin" / "llama-server"
    if binary.is_file():
        return binary
    if shutil.which("cmake") is None:
        raise PerfXError("building llama-server needs cmake; install it (apt-get install cmake)")
    src, build = llama_cpp_source(), out / "build"
    log = log or out / "build.log"
    out.mkdir(parents=True, exist_ok=True)
    configure = ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_SERVER=ON",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                 "-DBUILD_SHARED_LIBS=OFF", *cmake_cpu_args()]
    compile_ = ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs or os.cpu_count() or 2)]
    with open(log, "w") as f:
        for cmd in (configure, compile_):
            if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode != 0:
                raise PerfXError(f"building llama-server failed ({' '.join(cmd[:3])} ...); see {log}")
    built = build / "bin" / "llama-server"
    binary.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(built, binary)
    return binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def server_process(cmd: Sequence[str], url: str, name: str, log: Path | None = None,
                   timeout_s: float = 300.0) -> Iterator[str]:
    """Run an HTTP server command until its ``/health`` answers 200; yield ``url``; stop it on exit. A
    server that exits or stays unhealthy past ``timeout_s`` is one PerfXError line naming its log."""
    import httpx

    where = f"; see {log}" if log else ""
    logf = open(log or os.devnull, "w")
    proc = subprocess.Popen(list(cmd), stdout=logf, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise PerfXError(f"{name} exited with {proc.returncode} while starting{where}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise PerfXError(f"{name} did not become healthy within {timeout_s:.0f} s{where}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        logf.close()


@contextmanager
def llama_server(gguf: Path, *, slots: int, context_per_slot: int, threads: int = 2,
                 extra: Sequence[str] = (), log: Path | None = None, timeout_s: float = 300.0) -> Iterator[str]:
    """Run llama-server on ``gguf`` with ``slots`` parallel slots (continuous batching, the server's default)
    of ``context_per_slot`` tokens each; yields its base URL; the process is stopped on exit."""
    binary = build_llama_server()
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
           "-c", str(slots * context_per_slot), "-t", str(threads), "-tb", str(threads), "--cont-batching",
           "--no-webui", *extra]
    with server_process(cmd, f"http://127.0.0.1:{port}", "llama-server", log, timeout_s) as url:
        yield url
