"""The spinning thread team (``native/thread_team.c``): built into a CPU artifact, started at load.

Compile side: ``team_object()`` compiles the C file once per source version into an object that
``package.py`` links into ``model.so`` (``export_library(**link_options())``). Load side: ``install()``
starts the team inside that library and points the library's ``__TVMBackendParallelLaunch`` at it,
so every parallel loop of its kernels forks and joins through the team instead of TVM's pool.

Why: a decode step is ~110 short parallel loops; with the two vCPUs on different cores TVM's pool
costs microseconds per fork/join, ~5% of a TinyLlama decode step (docs/decisions/decode-step-runtime.md).

``PERFX_THREAD_POOL=tvm`` keeps TVM's pool (A/B runs); ``PERFX_SPIN_US`` sets how long an idle worker
spins before it sleeps (default 2000 us). Artifacts built without the team, cross-compiled ones and
libraries whose kernels use TVM's in-kernel barrier keep TVM's pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "native" / "thread_team.c"
DEFAULT_SPIN_US = 2000
TEAM = "perfx-team"


def team_object() -> Path | None:
    """An object file of the team for the host compiler, cached by source hash; None without a C compiler."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.warning("no C compiler: the artifact keeps TVM's thread pool")
        return None
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    cache = Path(tempfile.gettempdir()) / f"perfx-team-{os.getuid()}"
    obj = cache / f"thread_team-{digest}.o"
    if obj.is_file():
        return obj
    cache.mkdir(parents=True, exist_ok=True)
    tmp = obj.with_suffix(f".{os.getpid()}.o")
    cmd = [compiler, "-O2", "-fPIC", "-fvisibility=hidden", "-c", str(SOURCE), "-o", str(tmp)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as err:  # e.g. CC names a program that is not there
        log.warning("cannot run %s (%s): the artifact keeps TVM's thread pool", compiler, err)
        return None
    if proc.returncode != 0:
        log.warning("compiling the thread team failed (%s): the artifact keeps TVM's thread pool",
                    proc.stderr.strip().splitlines()[-1:] or proc.returncode)
        return None
    tmp.replace(obj)  # atomic: concurrent compiles never see a half-written object
    return obj


def link_options() -> dict[str, list[str]]:
    """``export_library`` keyword arguments that link the team into a host-compiled library ({} without
    a C compiler: the library then keeps TVM's pool)."""
    obj = team_object()
    return {"addons": [str(obj)]} if obj else {}


def team_threads() -> int:
    """The team's size: the thread count TVM's pool would use (the runtime sets TVM_NUM_THREADS)."""
    try:
        return max(1, int(os.environ.get("TVM_NUM_THREADS", "")))
    except ValueError:
        return os.cpu_count() or 1


def install(lib_path: str | Path) -> str:
    """Route the parallel loops of the loaded library ``lib_path`` through its team.

    Returns the pool the kernels now use: ``"perfx-team"`` or ``"tvm"`` (and why not the team)."""
    if os.environ.get("PERFX_THREAD_POOL", "").lower() == "tvm":
        return "tvm (PERFX_THREAD_POOL=tvm)"
    threads = team_threads()
    if threads < 2:
        return "tvm (1 thread)"
    try:
        lib = ctypes.CDLL(str(lib_path), mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    except OSError:
        return "tvm (library not loaded)"
    try:
        start, launch = lib.perfx_team_start, lib.perfx_team_launch
        slot = ctypes.c_void_p.in_dll(lib, "__TVMBackendParallelLaunch")
    except (AttributeError, ValueError):
        return "tvm (artifact built without the team)"
    try:
        ctypes.c_void_p.in_dll(lib, "__TVMBackendParallelBarrier")
        return "tvm (kernels use TVM's in-kernel barrier)"  # the team has no barrier of its own
    except ValueError:
        pass
    team_launch = ctypes.cast(launch, ctypes.c_void_p).value
    if slot.value == team_launch:  # the same library loaded again (a second Engine)
        return TEAM
    try:
        spin_us = int(os.environ.get("PERFX_SPIN_US", DEFAULT_SPIN_US))
    except ValueError:
        spin_us = DEFAULT_SPIN_US
    start.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    if start(threads, max(0, spin_us), slot.value) != 0:
        return "tvm (the team did not start)"
    slot.value = team_launch
    return TEAM


def launches(lib_path: str | Path) -> int:
    """Parallel launches the team of the loaded library ``lib_path`` ran (-1 without a team)."""
    try:
        lib = ctypes.CDLL(str(lib_path), mode=os.RTLD_NOLOAD | os.RTLD_NOW)
        fn = lib.perfx_team_launches
    except (OSError, AttributeError):
        return -1
    fn.restype = ctypes.c_int64
    return int(fn())
