"""Graph passes (phase 1): one pass per file, run in the order of ``perfx_compiler.pipeline.GRAPH_PASSES``.

A pass module defines ``NAME`` (its module name) and ``apply(mod, weights, ctx) -> (mod, weights)``.
``weights`` maps each weight parameter's name (the Relax parameter name) to its numpy array, in
parameter order; a pass that changes the parameters (merging Q/K/V, packing int4) changes both the
functions' signatures and this dict. :func:`graph_pass` makes a module one ``tvm.transform`` module
pass over a shared :class:`GraphState`. Adding a pass means adding a file here and one line in
``GRAPH_PASSES``; a pass module missing from that list fails tests/passes/test_pass_list.py.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import tvm

import perfx_compiler.tvm_compiler  # noqa: F401  (before tvm.relax: one line if TVM was loaded runtime-only)
from perfx_compiler.tvmscript_speedups import install as _install_tvmscript_speedups

_install_tvmscript_speedups()  # the fused-pass kernels are TVMScript (perfx_compiler/tvmscript_speedups.py)


@dataclass
class PassContext:
    target: Any  # TargetDescription
    options: Any  # CompileOptions
    desc: Any = None  # ModelDescription (config, quantized GGUF blocks for passthrough)
    # A compile's weights file (package.WeightFile): a pass hands it each final packed array (``stage``), which
    # comes back mapped from disk, off the heap, or has a large one placed there to fill a part at a time
    # (``reserve``). None where nothing is written (lower_model, tests).
    weight_file: Any = None


@dataclass
class GraphState:
    """What the graph passes share besides the module: the weight table they rewrite and their context."""

    weights: dict[str, Any]
    ctx: PassContext
    error: BaseException | None = None  # raised inside a pass; re-raised as it was by raise_error()

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error


def load(name: str) -> ModuleType:
    """The pass module ``name`` of this package."""
    return importlib.import_module(f"{__name__}.{name}")


def pass_modules() -> list[str]:
    """Names of every module of this package that defines a graph pass (an ``apply``)."""
    names = [info.name for info in pkgutil.iter_modules(__path__) if not info.name.startswith("_")]
    return [n for n in names if hasattr(load(n), "apply")]


def graph_pass(name: str, state: GraphState) -> tvm.transform.Pass:
    """The pass module ``name`` as a ``tvm.transform`` module pass reading and writing ``state.weights``.

    An exception crosses TVM's C++ pass manager as a generic ``RuntimeError`` (a user error would lose
    its ``PerfXError`` type and become a crash report), so it is kept in ``state.error`` instead, the
    passes after it leave the module as it is, and the caller re-raises it with ``state.raise_error()``.
    """
    module = load(name)

    def transform(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if state.error is not None:
            return mod
        try:
            mod, state.weights = module.apply(mod, state.weights, state.ctx)
        except BaseException as err:  # noqa: B036 - re-raised unchanged by raise_error()
            state.error = err
        return mod

    return tvm.transform.module_pass(transform, opt_level=0, name=name)
