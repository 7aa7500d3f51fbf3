"""riscv64-rvv: every kernel of the cross-compiled model runs under qemu-riscv64 (RVV 1.0) through the
runtime-free C harness and matches the host; whole decode steps, kernel by kernel under qemu, match the
x86 build's logits (no riscv64 TVM runtime exists, so the Relax call sequence is walked here)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from targets_common import MAX_CONTEXT, TOKENS

pytestmark = pytest.mark.targets
SIZES = {"n": 1, "bsz": 1, "batch": 2, "pages": 8}


@pytest.fixture(scope="module")
def riscv_module(tiny_gguf: Path):
    from perfx_compiler.targets_exec.reference import lowered_module
    from perfx_compiler.targets_exec.riscv import riscv_missing

    why = riscv_missing()
    if why:
        pytest.skip(why)
    return lowered_module(str(tiny_gguf), "riscv64-rvv", max_context=MAX_CONTEXT)


def test_every_kernel_under_qemu_riscv64(riscv_module, tiny_gguf: Path, tmp_path: Path) -> None:
    from perfx_compiler.targets_exec.kernels import func_param_info, random_args
    from perfx_compiler.targets_exec.reference import host_reference, lowered_module
    from perfx_compiler.targets_exec.riscv import build_harness, export_kernels, run_kernels_qemu, vector_instructions

    state, funcs = riscv_module
    _, cpu_funcs = lowered_module(str(tiny_gguf), "x86-avx2", max_context=MAX_CONTEXT, schedule=False)
    lib = export_kernels(funcs, state.target.tvm(), tmp_path / "kernels.so")
    assert int.from_bytes(lib.read_bytes()[18:20], "little") == 243  # EM_RISCV
    rvv = vector_instructions(lib)
    assert rvv.get("vfmacc.vv", 0) + rvv.get("vfmacc.vf", 0) > 0, f"no RVV FMAs in the kernels: {rvv}"
    calls = []
    for seq in (1, 3):
        for i, (name, func) in enumerate(funcs.items()):
            args = random_args(func, {**SIZES, "seq": seq}, seed=i)
            for k, (pname, _, _) in enumerate(func_param_info(func)):
                if pname == "PAST":
                    args[k][:] = 7  # attention: 7 cached positions before the chunk
            calls.append((name, args))
    results = run_kernels_qemu(build_harness(tmp_path), lib, calls, tmp_path / "run")
    for (name, args), got in zip(calls, results, strict=True):
        ref = host_reference(
            cpu_funcs.get(name, funcs[name]), [a.copy() if isinstance(a, np.ndarray) else a for a in args]
        )
        for g, r in zip(got, ref, strict=True):
            if isinstance(g, np.ndarray) and g.size:
                tol = 1e-4 * max(1.0, float(np.abs(r).max()))
                err = np.abs(g.astype(np.float64) - r).max()
                assert err <= tol, f"riscv64 {name}: max error {err}"
    assert any(n.startswith("cached_attention") for n in funcs)
    print(f"riscv64: {len(calls)} kernel calls ({len(funcs)} kernels x seq 1, 3) under qemu match the host; "
          f"{sum(rvv.values())} RVV instructions in the library")  # fmt: skip


def test_decode_kernel_by_kernel_under_qemu(riscv_module, tmp_path: Path, host_logits) -> None:
    from perfx_compiler.targets_exec.riscv import run_decode_steps_qemu

    state, _ = riscv_module
    got = np.stack(run_decode_steps_qemu(state, TOKENS, tmp_path))
    err = np.abs(got - host_logits).max()
    assert err < 1e-4, f"riscv64: decode logits differ from x86 by {err}"
    assert (got.argmax(-1) == host_logits.argmax(-1)).all()
