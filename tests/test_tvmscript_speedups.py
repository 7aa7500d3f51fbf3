"""perfx_compiler/tvmscript_speedups.py (installed when the packages that hold TVMScript are imported)
changes how TVMScript finds frames, never what it parses: the lazy stack is inspect.stack() field for
field, and kernels built through macros and prim_func decorators are structurally equal with and
without the patch."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from perfx_compiler import tvmscript_speedups as speed
from perfx_compiler.kernels import memo

REPO = Path(__file__).resolve().parents[1]


def _both_stacks() -> tuple[list, list]:
    return speed._lazy_stack(), inspect.stack()


def test_lazy_stack_is_inspect_stack() -> None:
    lazy, real = _both_stacks()
    assert len(lazy) == len(real) > 3
    for i, (a, b) in enumerate(zip(lazy, real, strict=True)):
        assert a.frame is b.frame
        # read after _both_stacks returned: the line it was listed at, not where the frame is now
        assert (a.filename, a.lineno, a.function, a.code_context, a.index) == tuple(b)[1:]
        assert tuple(a) == tuple(b) and len(a) == len(b) and a[2] == b[2]
        if i:  # both calls sit on one line of _both_stacks: only that frame's columns differ
            assert a.positions == b.positions


@pytest.mark.parametrize("package", ["perfx_compiler.kernels", "perfx_compiler.passes", "schedules"])
def test_compiler_packages_install_the_patch(package: str) -> None:
    """A compile gets the patch: importing any package that builds TVMScript installs it."""
    code = (f"import {package}, tvm.tirx.script.parser.entry as e; "
            "from perfx_compiler import tvmscript_speedups as s; "
            "assert s.ORIGINALS and isinstance(e.inspect, s._InspectWithLazyStack)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(REPO))


def _kernels() -> list:
    """Fused-pass kernels (prim_func + macro) and a tiny int4/int8 model's scheduled module (the
    GEMV/GEMM templates' prim_funcs and macros)."""
    from perfx_compiler.kernels.rms_norm import rms_norm_kernel
    from perfx_compiler.kernels.swiglu import swiglu_kernel
    from perfx_compiler.pipeline import lower_model, phase_schedule
    from tests.passes.conftest import ALL_PASSES, tiny_desc

    _, state = lower_model(tiny_desc(tied=True, seed=5), "x86-avx512", passes=[*ALL_PASSES, "quantize_int8"],
                           quantization="q4_g32", activations="int8", batching=False)
    phase_schedule(state)
    return [rms_norm_kernel(576, 1e-5, True), rms_norm_kernel(64, 1e-6, False, 8), swiglu_kernel(1536), state.mod]


def test_kernels_parse_the_same_with_and_without_the_patch(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    import tvm_ffi
    from tvm.script.parser.core.parser import ScriptMacro

    speed.install()  # as importing the compiler's kernel packages does
    if not speed.ORIGINALS:
        pytest.skip("this TVM lays out its frame lookups differently: nothing was patched")
    monkeypatch.setenv(memo.CACHE_ENV, "none")  # (not from the disk cache either)
    memo.clear()  # each build parses (the kernels a builder remembers were parsed with the patch)
    patched = _kernels()
    for name, orig in speed.ORIGINALS.items():
        if name == "ScriptMacro._find_parser_def":
            monkeypatch.setattr(ScriptMacro, "_find_parser_def", orig)
        else:
            monkeypatch.setattr(importlib.import_module(name), "inspect", inspect)
    memo.clear()
    plain = _kernels()
    assert len(patched) == len(plain) >= 3
    for a, b in zip(patched, plain, strict=True):
        assert tvm_ffi.structural_equal(a, b)
