"""A TVM RPC server for aarch64 run under qemu-user: the arm64 targets' stand-in for a phone or board.

    python -m perfx_compiler.targets_exec.qemu_rpc --tracker 127.0.0.1:9190 --key qemu-arm64

PyPI's aarch64 wheels carry ``libtvm_runtime.so`` (with TVM's RPC server loop) but no aarch64
Python to run ``tvm.exec.rpc_server`` in, so the server is split the way TVM's own Python server
already is: its parent process registers with the tracker, accepts a client and checks the key
(``tvm.rpc.server._listen_loop``, reused as is), and each session then runs in a child. Here the
child is ``native/rpc_session.cc``, cross-compiled against the aarch64 runtime and started under
``qemu-aarch64`` on the connected socket: uploads, module loads, tensor copies and
``time_evaluator`` all execute in the aarch64 runtime (timings under qemu mean nothing; the round
trip is what this server is for).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from perfx_compiler.targets_exec.qemu import ARCHES, NATIVE, qemu_missing
from perfx_compiler.targets_exec.toolchains import CACHE, aarch64_runtime_dir

log = logging.getLogger(__name__)
SESSION_SRC = NATIVE / "rpc_session.cc"


def build_session_binary(work: Path | None = None) -> Path:
    """Cross-compile native/rpc_session.cc (cached next to the aarch64 runtime, keyed by the source's mtime)."""
    why = qemu_missing("aarch64")
    if why is not None:
        raise RuntimeError(why)
    libdir = aarch64_runtime_dir()
    assert libdir is not None
    folder = work or (CACHE / "aarch64-runtime" / "bin")
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / f"rpc_session-{int(SESSION_SRC.stat().st_mtime)}"
    if exe.exists():
        return exe
    include = libdir.parent / "include"
    tmp = folder / f".{exe.name}.{os.getpid()}"
    cmd = [
        ARCHES["aarch64"][0], "-std=c++17", "-O1", f"-I{include}", str(SESSION_SRC), f"-L{libdir}",
        "-Wl,--no-as-needed", "-ltvm_ffi", "-ltvm_runtime", "-o", str(tmp),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    os.replace(tmp, exe)  # atomic: two servers starting at once may both build
    return exe


def _serve_under_qemu(exe: Path, session_timeout: float | None) -> Any:
    """The replacement of tvm.rpc.server._serving: one session, in qemu-aarch64, on the accepted socket."""
    env = dict(os.environ, LD_LIBRARY_PATH=str(aarch64_runtime_dir()))

    def serving(sock: socket.socket, addr: Any, opts: dict[str, Any], load_library: Any) -> None:
        work = tempfile.mkdtemp(prefix="perfx-qemu-rpc-")
        cmd = ["qemu-aarch64", "-L", ARCHES["aarch64"][2], str(exe), str(sock.fileno()), work]
        log.info("session from %s in %s", addr, work)
        proc = subprocess.Popen(cmd, pass_fds=(sock.fileno(),), env=env)
        try:
            proc.wait(timeout=opts.get("timeout") or session_timeout)
        except subprocess.TimeoutExpired:
            log.warning("session from %s timed out; killed", addr)
            proc.kill()
            proc.wait()
        finally:
            sock.close()
            shutil.rmtree(work, ignore_errors=True)

    return serving


def serve(tracker: tuple[str, int], key: str, host: str = "127.0.0.1", port: int = 9091,
          port_end: int = 9199, session_timeout: float | None = None) -> None:
    """Register with ``tracker`` under ``key`` and serve sessions one at a time, until killed."""
    from tvm.rpc import server as tvm_server

    exe = build_session_binary()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    for p in range(port, port_end):
        try:
            sock.bind((host, p))
            break
        except OSError:
            continue
    else:
        raise RuntimeError(f"cannot bind to any port in [{port}, {port_end})")
    sock.listen(1)
    bound = sock.getsockname()[1]
    print(f"qemu-aarch64 RPC server on {host}:{bound}, key {key}, tracker {tracker[0]}:{tracker[1]}", flush=True)
    # TVM's listen loop (tracker registration, key re-issue, handshake) with the session step swapped
    # for one that runs in the aarch64 runtime: this process is ours alone, nothing else sees the patch.
    tvm_server._serving = _serve_under_qemu(exe, session_timeout)
    tvm_server._listen_loop(sock, bound, key, tracker, None, host)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m perfx_compiler.targets_exec.qemu_rpc",
                                description="TVM RPC server running its sessions in qemu-aarch64.")
    p.add_argument("--tracker", required=True, metavar="HOST:PORT")
    p.add_argument("--key", default="qemu-arm64")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9091)
    p.add_argument("--port-end", type=int, default=9199)
    args = p.parse_args(argv)
    host, _, port = args.tracker.rpartition(":")
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    why = qemu_missing("aarch64")
    if why is not None:
        print(f"qemu_rpc: error: {why}", file=sys.stderr)
        return 2
    serve((host, int(port)), args.key, args.host, args.port, args.port_end)
    return 0


if __name__ == "__main__":
    sys.exit(main())
