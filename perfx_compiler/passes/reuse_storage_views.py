"""Build-phase Relax pass (not a graph pass; ``pipeline.phase_build`` runs it after
``StaticPlanBlockMemory``): one tensor view per planned buffer, not one per use.

Static memory planning gives a decode step a handful of storages (SmolLM2: 6), but every
intermediate still gets its own ``R.memory.alloc_tensor(storage, offset, shape, dtype)``, and each
becomes a ``vm.builtin.alloc_tensor`` call (a new Tensor object) plus a ``null_value`` kill at its
last use: ~300 of each per SmolLM2 decode step for ~15 distinct views. Two allocations with the
same storage, offset, shape and dtype are the same memory by construction (the planner gave them
disjoint lifetimes), so the later ones can be the first one's variable: same bytes, same kernels,
same order. Their ``kill_tensor`` calls go (KillAfterLastUse adds one after the merged variable's
last use). Tuples that nothing reads (the multi-output kernels' ``(out, cache_k, cache_v)``, left
by CallTIRRewrite) are dropped too: each was a ``vm.builtin.make_tuple`` per layer.
"""

from __future__ import annotations

from typing import Any

import tvm
from tvm import relax

_ALLOC_TENSOR = "relax.memory.alloc_tensor"
_KILL_TENSOR = "relax.memory.kill_tensor"


def _op(expr: Any) -> str | None:
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
        return str(expr.op.name)
    return None


def _static(expr: Any) -> Any:
    """A hashable form of a constant offset / shape / dtype / device argument; None if symbolic."""
    if isinstance(expr, relax.ShapeExpr):
        vals = [_static(v) for v in expr.values]
        return None if any(v is None for v in vals) else ("shape", *vals)
    if isinstance(expr, tvm.tirx.IntImm):  # a PrimValue argument, in TVM 0.27's IR
        return int(expr.value)
    if isinstance(expr, tvm.ir.expr.GenericConst):  # the dtype argument
        return ("const", str(expr.value))
    return None


def _view_key(value: Any) -> tuple[Any, ...] | None:
    """(storage, offset, shape, dtype, device) of a static alloc_tensor on a planned storage."""
    if _op(value) != _ALLOC_TENSOR or not isinstance(value.args[0], relax.Var):
        return None
    rest = [_static(a) for a in value.args[1:]]
    if any(r is None for r in rest):
        return None
    return (value.args[0], *rest)


def _bindings(func: relax.Function) -> list[Any]:
    return [b for block in func.body.blocks for b in block.bindings]


@relax.expr_functor.mutator
class _Reuse(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, merged: set[Any], dead: set[Any], fields: dict[Any, Any]):
        super().__init__(mod)
        self.merged = merged  # vars of views that share their key with another view
        self.dead = dead  # tuple vars nothing reads, and the t[i] bindings below
        self.fields = fields  # var bound to t[i] of a tuple built here -> that field
        self.first: dict[tuple[Any, ...], relax.Var] = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        if binding.var in self.fields:
            self.set_var_remap(binding.var, self.visit_expr(self.fields[binding.var]))
            return
        if binding.var in self.dead:
            return
        key = _view_key(value)
        if key is not None and binding.var in self.merged:
            if key in self.first:
                self.set_var_remap(binding.var, self.first[key])
                return
            super().visit_var_binding_(binding)
            self.first[key] = binding.var  # kept as it is: its value's type does not change
            return
        if _op(value) == _KILL_TENSOR and value.args[0] in self.merged:
            return
        super().visit_var_binding_(binding)


def reuse_views(func: relax.Function, mod: tvm.IRModule) -> relax.Function:
    """``func`` with one alloc_tensor per distinct planned view and no unread tuples."""
    if not isinstance(func.body, relax.SeqExpr):
        return func
    binds = _bindings(func)
    count: dict[tuple[Any, ...], int] = {}
    keys: dict[Any, tuple[Any, ...]] = {}
    for b in binds:
        key = _view_key(b.value)
        if key is not None:
            keys[b.var] = key
            count[key] = count.get(key, 0) + 1
    # t[i] of a tuple built here is that field (the kernels' outputs, read back by CallTIRRewrite)
    tuples = {b.var: b.value for b in binds if isinstance(b.value, relax.Tuple)}
    fields: dict[Any, Any] = {}
    for b in binds:
        v = b.value
        if isinstance(v, relax.TupleGetItem) and v.tuple_value in tuples:
            field = tuples[v.tuple_value].fields[v.index]
            if isinstance(field, relax.Var):
                fields[b.var] = fields.get(field, field)
    # backwards liveness: a tuple (or an alias of one) that nothing later reads is dead
    used: set[Any] = {fields.get(v, v) for v in relax.analysis.free_vars(func.body.body)}
    dead: set[Any] = set()
    for b in reversed(binds):
        if b.var in fields or (isinstance(b.value, (relax.Tuple, relax.Var)) and b.var not in used):
            dead.add(b.var)
            continue
        reads = [b.value] if isinstance(b.value, relax.Var) else relax.analysis.free_vars(b.value)
        used.update(fields.get(v, v) for v in reads)
    merged = {v for v, k in keys.items() if count[k] > 1}
    if not merged and not dead:
        return func
    return _Reuse(mod, merged, dead, fields).visit_expr(func)


@tvm.transform.module_pass(opt_level=0, name="ReuseStorageViews")
class ReuseStorageViews:
    """Module pass: ``reuse_views`` on every Relax function without control flow."""

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        funcs = {
            gv: reuse_views(func, mod) if isinstance(func, relax.Function) and not _has_if(func) else func
            for gv, func in mod.functions_items()
        }
        return tvm.IRModule(funcs, attrs=mod.attrs, global_infos=mod.global_infos)


def _has_if(func: relax.Function) -> bool:
    found: list[bool] = []
    relax.analysis.post_order_visit(func.body, lambda e: found.append(True) if isinstance(e, relax.If) else None)
    return bool(found)
