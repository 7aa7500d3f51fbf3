"""Helpers for the structural pass tests (dlight's test shape: a small ``before`` module, the pass, the
hand-written ``expected`` module, ``tvm.ir.assert_structural_equal``).

Hand-written TIR kernels a pass adds (norms, quantized GEMVs, texture kernels) are big generated
PrimFuncs: an expected module names each such kernel with a stub PrimFunc (``T.evaluate(0)``) in its
TVMScript (so it is parsed with ``check_well_formed=False``), and :func:`with_kernels` swaps the stub for the
kernel generator's own output at the expected shapes and configuration, then checks the module is well
formed. The Relax functions (what the pass rewrites and how) are compared as written, the kernels by
identity to their generator: a change in what a pass matches or emits fails these tests, a change inside a
kernel generator does not (the kernels' numbers are checked by their own tests). Before modules that hold
earlier passes' kernels are built the same way.

Every pass is called through its entry point ``apply(mod, weights, ctx)`` with a context built here (no pass
discovery, no pipeline), on a fixed target file and the default activations (f32) unless a test says so.
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import tvm
from tvm import relax

from perfx_compiler.kernels.tir_queries import OPAQUE
from perfx_compiler.targets import TargetDescription, load_target

CPU = "x86-avx512"  # a fixed target file (never ``host``): the expected modules must not depend on the machine


def context(target: str | TargetDescription = CPU, desc: Any = None, **options: Any) -> SimpleNamespace:
    """What a pass's ``apply`` reads: ``ctx.target``, ``ctx.options`` (only the fields given, over the
    resolved defaults of the pipeline: f32 weights and matmul inputs) and ``ctx.desc``."""
    opts = {"quantization": "f32", "precision": "f32", "progress": False, **options}
    tdesc = load_target(target) if isinstance(target, str) else target
    return SimpleNamespace(target=tdesc, options=SimpleNamespace(**opts), desc=desc)


def run_pass(pass_module: ModuleType, mod: tvm.IRModule, weights: dict[str, Any],
             ctx: SimpleNamespace | None = None) -> tuple[tvm.IRModule, dict[str, Any]]:
    """``pass_module.apply`` on ``mod`` (which it must not modify in place: checked)."""
    before = mod.script(show_meta=True)
    out, new_weights = pass_module.apply(mod, dict(weights), ctx if ctx is not None else context())
    assert mod.script(show_meta=True) == before, f"{pass_module.__name__} modified its input module"
    return out, new_weights


def opaque(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """A kernel as ``rewrite_functions`` adds it: opaque to FuseOps (op_pattern kOpaque)."""
    return func.with_attr("op_pattern", OPAQUE)


def with_kernels(mod: tvm.IRModule, **kernels: tvm.tirx.PrimFunc) -> tvm.IRModule:
    """``mod`` with each named stub PrimFunc replaced by the given kernel (a fresh GlobalVar typed by the
    kernel's signature, as ``BlockBuilder.add_func`` makes it; every call is re-pointed to it); the result
    must be well formed (no stub left, every call's arity right)."""
    bb = relax.BlockBuilder()
    fresh = {name: bb.add_func(func, name) for name, func in kernels.items()}
    missing = set(kernels) - {gv.name_hint for gv in mod.get_global_vars()}
    assert not missing, f"no stub named {sorted(missing)} in the expected module"

    @relax.expr_functor.mutator
    class Repoint(relax.PyExprMutator):
        def visit_global_var_(self, gv: relax.GlobalVar) -> relax.Expr:
            return fresh.get(gv.name_hint, gv)

    funcs: dict[tvm.ir.GlobalVar, tvm.ir.BaseFunc] = {}
    for gv, func in mod.functions_items():
        if gv.name_hint in kernels:
            funcs[fresh[gv.name_hint]] = kernels[gv.name_hint]
        elif isinstance(func, relax.Function):
            funcs[gv] = Repoint().visit_expr(func)
        else:
            funcs[gv] = func
    out = tvm.IRModule(funcs, attrs=mod.attrs)
    relax.analysis.well_formed(out)  # raises on a stub left, a call of the wrong arity
    return out


def assert_unchanged(pass_module: ModuleType, mod: tvm.IRModule, weights: dict[str, Any],
                     ctx: SimpleNamespace | None = None) -> None:
    """The pass leaves ``mod`` and the weight table as they are."""
    out, new_weights = run_pass(pass_module, mod, weights, ctx)
    tvm.ir.assert_structural_equal(out, mod)
    assert list(new_weights) == list(weights)
    for name, arr in weights.items():
        assert new_weights[name] is arr or np.array_equal(np.asarray(new_weights[name]), np.asarray(arr)), name


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    """A float32 standard-normal array (seeded: the expected modules do not depend on the values)."""
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
