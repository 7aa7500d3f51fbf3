"""Run the riscv64 target's compiled kernels under ``qemu-riscv64`` without a TVM runtime.

No riscv64 TVM runtime exists on PyPI, so the whole model cannot run here; its kernels can.
Every PrimFunc of the scheduled riscv64 module is compiled (LLVM, RV64GCV) into one shared library,
which exports ``__tvm_ffi_<name>`` per kernel. ``native/kernel_harness.c`` (cross-compiled with
``riscv64-linux-gnu-gcc``) loads it, fills the runtime slots a TVM runtime would (a serial
parallel-loop launcher that runs every task in turn, malloc-backed workspaces), stubs the error
hook, and calls each kernel on DLTensors read from files, writing every tensor back. It runs under
``qemu-riscv64 -cpu rv64,v=true`` (RVV 1.0; the vector code traps without ``v=true``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

NATIVE = Path(__file__).resolve().parent / "native"
CC = "riscv64-linux-gnu-gcc"
CXX = "riscv64-linux-gnu-g++"
QEMU = "qemu-riscv64"
SYSROOT = "/usr/riscv64-linux-gnu"
DL_CODES = {"i": 0, "u": 1, "f": 2, "b": 1}  # DLPack type codes (bool as uint8)


def riscv_missing() -> str | None:
    """None when the riscv64 cross compilers, qemu-riscv64 and the sysroot are present, else why not."""
    for tool in (CC, CXX, QEMU):
        if shutil.which(tool) is None:
            return f"{tool} not found; run tests/setup.sh"
    if not Path(SYSROOT).is_dir():
        return f"riscv64 sysroot {SYSROOT} missing (libc6-riscv64-cross)"
    return None


def build_harness(work: Path) -> Path:
    """Cross-compile native/kernel_harness.c (exports the error hook to the kernel library: -rdynamic)."""
    import tvm_ffi.libinfo

    work.mkdir(parents=True, exist_ok=True)
    exe = work / "kernel_harness"
    cmd = [
        CC, "-std=c11", "-O1", "-D_POSIX_C_SOURCE=200112L", f"-I{tvm_ffi.libinfo.find_include_path()}",
        str(NATIVE / "kernel_harness.c"), "-rdynamic", "-ldl", "-o", str(exe),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return exe


def export_kernels(funcs: dict[str, Any], target: Any, path: Path) -> Path:
    """Compile every PrimFunc of ``funcs`` (name -> scheduled PrimFunc) for ``target`` into one riscv64
    shared library exporting ``__tvm_ffi_<name>``."""
    import tvm
    from tvm.support import cc

    mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
    ex = tvm.compile(mod, target=target)
    path.parent.mkdir(parents=True, exist_ok=True)
    ex.export_library(str(path), fcompile=cc.cross_compiler(CXX))
    return path


def vector_instructions(lib: Path) -> dict[str, int]:
    """RVV instruction counts by mnemonic in ``lib``'s disassembly (``llvm-objdump --mattr=+v``: Debian's
    GNU objdump 2.40 shows LLVM 22's vector code as ``.4byte``). Empty when no disassembler decodes it."""
    tool = next((t for t in ("llvm-objdump", "llvm-objdump-19", "llvm-objdump-14") if shutil.which(t)), None)
    cmd = [tool, "-d", "--no-show-raw-insn", "--mattr=+v", str(lib)] if tool else []
    if not cmd:
        cmd = ["riscv64-linux-gnu-objdump", "-d", "--no-show-raw-insn", str(lib)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    counts: dict[str, int] = {}
    for mnemonic in re.findall(r"(?m)^\s+[0-9a-f]+:\s+(v[a-z0-9.]+)\s", proc.stdout):
        counts[mnemonic] = counts.get(mnemonic, 0) + 1
    return counts


def _dl_type(dtype: np.dtype) -> tuple[int, int]:
    return DL_CODES[dtype.kind], dtype.itemsize * 8


def run_kernels_qemu(
    harness: Path,
    lib: Path,
    calls: list[tuple[str, list[Any]]],
    work: Path,
    cpu: str = "rv64,v=true",
    timeout: int = 600,
) -> list[list[Any]]:
    """Run ``calls`` ((kernel name, arguments: numpy arrays or Python scalars), ...) in one qemu process;
    return, per call, the arguments after it (arrays read back, scalars unchanged)."""
    work.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    outs: list[list[Any]] = []
    for c, (name, args) in enumerate(calls):
        lines.append(f"call {name} {len(args)}")
        slots: list[Any] = []
        for a, value in enumerate(args):
            if isinstance(value, np.ndarray):
                arr = np.array(value, order="C")  # ascontiguousarray would make 0-d arrays 1-d
                src, dst = work / f"c{c}_a{a}.in", work / f"c{c}_a{a}.out"
                arr.tofile(src)
                code, bits = _dl_type(arr.dtype)
                dims = " ".join(str(d) for d in arr.shape)
                lines.append(f"t {code} {bits} {arr.ndim} {dims} {src} {dst}")
                slots.append((dst, arr.shape, arr.dtype))
            elif isinstance(value, float):
                lines.append(f"f {value!r}")
                slots.append(value)
            else:
                lines.append(f"i {int(value)}")
                slots.append(value)
        outs.append(slots)
    plan = work / "plan.txt"
    plan.write_text("\n".join(lines) + "\n")
    cmd = [QEMU, "-cpu", cpu, "-L", SYSROOT, str(harness), str(lib), str(plan)]
    env = dict(os.environ, PERFX_NUM_TASK=os.environ.get("PERFX_NUM_TASK", "4"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"kernel_harness under {QEMU} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    results: list[list[Any]] = []
    for slots in outs:
        row: list[Any] = []
        for s in slots:
            if isinstance(s, tuple):
                dst, shape, dtype = s
                row.append(np.fromfile(dst, dtype=dtype).reshape(shape))
            else:
                row.append(s)
        results.append(row)
    return results


class QemuKernelLauncher:
    """The launcher interface of ``relax_exec`` for riscv64 kernels: arrays stay numpy arrays on this
    machine, and each kernel call is one harness run under qemu whose results are copied back into the
    arguments (in-place outputs included)."""

    def __init__(self, harness: Path, lib: Path, work: Path) -> None:
        self.harness, self.lib, self.work = harness, lib, work
        self.calls = 0

    def to_device(self, arr: np.ndarray) -> np.ndarray:
        return np.array(arr, order="C")

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        return np.zeros(shape, dtype)

    def to_host(self, arr: np.ndarray) -> np.ndarray:
        return arr.copy()

    def view(self, arr: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return arr.reshape(shape)

    def run(self, name: str, values: list[Any]) -> None:
        (after,) = run_kernels_qemu(self.harness, self.lib, [(name, values)], self.work / f"call{self.calls}")
        self.calls += 1
        for v, a in zip(values, after, strict=True):
            if isinstance(v, np.ndarray):
                v[...] = a


def run_decode_steps_qemu(state: Any, tokens: list[int], work: Path) -> list[np.ndarray]:
    """Decode ``tokens`` one by one with every kernel of the riscv64 build run under qemu (the Relax
    function's call sequence is walked on this machine: no riscv64 TVM runtime exists)."""
    from perfx_compiler.targets_exec.relax_exec import RelaxKernelRunner, run_decode_steps

    class ByName(RelaxKernelRunner):
        def compiled(self, name: str) -> Any:  # the harness calls the library's __tvm_ffi_<name>
            return name

    funcs = called_prim_funcs(state.mod, "decode")
    lib = export_kernels(funcs, state.target.tvm(), work / "kernels.so")
    launcher = QemuKernelLauncher(build_harness(work), lib, work)
    runner = ByName(state.mod, state.target.tvm(), launcher)
    return run_decode_steps(state, launcher, tokens, state.weights, runner=runner)


def called_prim_funcs(mod: Any, fn_name: str) -> dict[str, Any]:
    """name -> PrimFunc of every kernel the Relax function ``fn_name`` calls."""
    from tvm import relax, tirx

    names: set[str] = set()

    def visit(expr: Any) -> None:
        if isinstance(expr, relax.GlobalVar) and isinstance(mod[expr], tirx.PrimFunc):
            names.add(expr.name_hint)

    relax.analysis.post_order_visit(mod[fn_name].body, visit)
    return {n: mod[n] for n in sorted(names)}
