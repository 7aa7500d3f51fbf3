"""Helpers shared by the graph passes: binding tables, chain matching, a binding rewriter and
weight-parameter surgery that keeps every exported function and the weight table in step."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import tvm
from tvm import relax

from perfx_compiler.kernels.tir_queries import OPAQUE

# Relax functions the runtime calls at least; every pass rewrites all exported ones alike.
EXPORTED = ("prefill", "decode", "prefill_all")


def exported(mod: tvm.IRModule) -> list[str]:
    """Names of the module's exported Relax functions (those with inputs before the weights)."""
    out = []
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function) and func.attrs is not None and "num_input" in func.attrs:
            out.append(gv.name_hint)
    return sorted(out, key=lambda n: (n not in EXPORTED, EXPORTED.index(n) if n in EXPORTED else 0, n))
SKIP = "skip"
# JSON on the kernels the fusion passes emit ({"op": "add_rms_norm", "eps": ...}, {"op": "swiglu"}), for
# later passes that fuse them further (fuse_gemv_prologue)
FUSED_OP_ATTR = "perfx.fused_op"


def op_name(expr: Any) -> str | None:
    """``relax.add`` for a call of the add operator, else None."""
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
        return str(expr.op.name)
    return None


def const_value(expr: Any) -> float | None:
    if isinstance(expr, tvm.ir.expr.Constant) and expr.value.numpy().size == 1:
        return float(expr.value.numpy().reshape(-1)[0])
    return None


def static_shape(expr: Any) -> list[int | None]:
    """Shape of a tensor-typed expression; None for symbolic dims."""
    out = []
    for d in expr.ty.shape.values:
        out.append(int(d.value) if isinstance(d, tvm.tirx.IntImm) else None)
    return out


@dataclass
class FuncInfo:
    """Bindings of a function's dataflow blocks (var -> value) and how often each var is used."""

    func: relax.Function
    values: dict[Any, Any] = field(default_factory=dict)
    uses: dict[Any, int] = field(default_factory=dict)
    readers: dict[Any, list[Any]] = field(default_factory=dict)  # var -> binding vars reading it
    order: dict[Any, int] = field(default_factory=dict)  # var -> binding position

    @classmethod
    def of(cls, func: relax.Function) -> FuncInfo:
        info = cls(func)

        def count(e: Any) -> None:
            if isinstance(e, relax.Var):
                info.uses[e] = info.uses.get(e, 0) + 1

        for block in func.body.blocks:
            for b in block.bindings:
                info.values[b.var] = b.value
                info.order[b.var] = len(info.order)
                seen: list[Any] = []
                relax.analysis.post_order_visit(b.value, lambda e, seen=seen: seen.append(e) if isinstance(e, relax.Var) else None)
                for e in seen:
                    info.uses[e] = info.uses.get(e, 0) + 1
                    readers = info.readers.setdefault(e, [])
                    if not readers or not readers[-1].same_as(b.var):  # b.var can only be the last reader so far
                        readers.append(b.var)
        relax.analysis.post_order_visit(func.body.body, count)
        return info

    def value(self, var: Any) -> Any:
        return self.values.get(var) if isinstance(var, relax.Var) else None

    def call(self, var: Any, name: str) -> relax.Call | None:
        """The value bound to ``var`` when it is a call of operator ``name``."""
        v = self.value(var)
        return v if op_name(v) == name else None

    def users(self, var: Any) -> list[Any]:
        """Vars whose bound value reads ``var``."""
        return list(self.readers.get(var, []))

    def used_outside(self, var: Any) -> bool:
        """Whether the function's result reads ``var`` directly."""
        found: list[Any] = []
        relax.analysis.post_order_visit(self.func.body.body, lambda e: found.append(e) if e.same_as(var) else None)
        return bool(found)


@dataclass
class RMSNormMatch:
    x: Any  # the normalized input
    weight: Any
    eps: float
    out: Any  # var of the final multiply
    inner: list[Any]  # vars of the chain (power ... divide), each used only inside it


def match_rms_norm(info: FuncInfo, out_var: Any) -> RMSNormMatch | None:
    """``x / sqrt(mean(x^2, -1, keepdims) + eps) * w`` as ONNX emission produces it."""
    mul = info.call(out_var, "relax.multiply")
    if mul is None:
        return None
    for div_var, w in ((mul.args[0], mul.args[1]), (mul.args[1], mul.args[0])):
        div = info.call(div_var, "relax.divide")
        if div is None:
            continue
        x, sq_var = div.args
        sq = info.call(sq_var, "relax.sqrt")
        add = info.call(sq.args[0], "relax.add") if sq is not None else None
        if add is None:
            continue
        mean_var, eps_c = add.args
        eps = const_value(eps_c)
        mean = info.call(mean_var, "relax.mean")
        if eps is None or mean is None:
            continue
        axis = [int(a) for a in (mean.attrs.axis or [])]
        ndim = len(x.ty.shape.values)
        if axis not in ([-1], [ndim - 1]) or not bool(mean.attrs.keepdims):
            continue
        pw = info.call(mean.args[0], "relax.power")
        if pw is None or not pw.args[0].same_as(x) or const_value(pw.args[1]) != 2.0:
            continue
        if len(w.ty.shape.values) != 1:
            continue
        inner = [div_var, sq_var, sq.args[0], mean_var, mean.args[0]]
        if any(info.uses.get(v, 0) != 1 for v in inner):
            continue  # an intermediate is read elsewhere: keep the graph as it is
        return RMSNormMatch(x=x, weight=w, eps=eps, out=out_var, inner=inner)
    return None


@relax.expr_functor.mutator
class BindingRewriter(relax.PyExprMutator):
    """Re-emit a function's bindings, replacing planned ones: ``plan[var]`` is SKIP (drop the
    binding; its var must be remapped by another action) or an action that emits replacements
    and remaps ``var``."""

    def __init__(self, mod: tvm.IRModule, plan: dict[Any, Any]) -> None:
        super().__init__(mod)
        self.plan = plan

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        action = self.plan.get(binding.var)
        if action is None:
            super().visit_var_binding_(binding)
        elif action is SKIP or action == SKIP:
            return
        else:
            action(self, binding)

    def arg(self, expr: Any) -> Any:
        """An original expression as it reads in the function being built."""
        return self.visit_expr(expr)

    def emit(self, value: Any, like: Any = None) -> Any:
        """Emit ``value``; an output var (not dataflow) of the original stays an output var."""
        if like is not None and not isinstance(like, relax.DataflowVar):
            return self.builder_.emit_output(value)
        return self.builder_.emit(value)

    def remap(self, old: Any, new: Any) -> None:
        self.set_var_remap(old, new)


def rewrite_functions(
    mod: tvm.IRModule,
    plan_for: Callable[[str, relax.Function, FuncInfo, dict[str, relax.GlobalVar]], dict[Any, Any]],
    prim_funcs: dict[str, Any] | None = None,
) -> tuple[tvm.IRModule, dict[str, relax.GlobalVar]]:
    """Add ``prim_funcs`` (name -> PrimFunc, made opaque to FuseOps), then rewrite every exported
    function with the plan ``plan_for(name, func, info, gvars)`` (gvars: kernel name -> GlobalVar)."""
    mod = mod.clone()
    gvars: dict[str, relax.GlobalVar] = {}
    rewriter = BindingRewriter(mod, {})
    for name, pf in (prim_funcs or {}).items():
        gvars[name] = rewriter.builder_.add_func(pf.with_attr("op_pattern", OPAQUE), name)
    names = exported(mod)
    for name in names:
        func = mod[name]
        plan = plan_for(name, func, FuncInfo.of(func), gvars)
        if not plan:
            continue
        rewriter.plan = plan
        new_func = rewriter.visit_expr(func)
        rewriter.builder_.update_func(rewriter.builder_.get().get_global_var(name), new_func)
    out = rewriter.builder_.get()
    return relax.transform.DeadCodeElimination(names)(out), gvars


def replace_weight_params(
    mod: tvm.IRModule,
    weights: dict[str, Any],
    new_weights: dict[str, Any],
    num_inputs: int | None = None,
) -> tuple[tvm.IRModule, dict[str, Any], dict[str, dict[str, relax.Var]]]:
    """Give every exported function the weight parameters ``new_weights`` (name -> array, in
    order). Parameters whose name survives keep their Var; new names get fresh Vars. Returns the
    module (bodies unchanged: the caller rewrites uses via the returned name -> Var maps) and the
    new weight table."""
    mod = mod.clone()
    params_by_fn: dict[str, dict[str, relax.Var]] = {}
    for fn in exported(mod):
        func = mod[fn]
        n = num_inputs if num_inputs is not None else int(func.attrs["num_input"])
        old = {p.name: p for p in func.params[n:]}
        params = list(func.params[:n])
        by_name: dict[str, relax.Var] = {}
        for name, arr in new_weights.items():
            var = old.get(name)
            if var is None or tuple(static_shape(var)) != tuple(arr.shape):
                var = relax.Var(name, relax.TensorType(list(arr.shape), str(arr.dtype)))
            params.append(var)
            by_name[name] = var
        mod[fn] = relax.Function(params, func.body, func.ty.ret, func.is_pure, func.attrs)
        params_by_fn[fn] = by_name
    return mod, dict(new_weights), params_by_fn


def weight_name(expr: Any, func: relax.Function) -> str | None:
    """Name of the weight parameter ``expr`` is, or None."""
    if isinstance(expr, relax.Var) and any(expr.same_as(p) for p in func.params):
        return expr.name
    return None


@dataclass
class Linear:
    """``out = matmul(x, permute_dims(W)) [+ b]`` with W (and b) weight parameters."""

    x: Any
    weight: relax.Var
    bias: relax.Var | None
    permute: Any
    matmul: Any
    add: Any | None

    @property
    def out(self) -> Any:
        return self.add if self.add is not None else self.matmul

    @property
    def vars(self) -> list[Any]:
        return [v for v in (self.permute, self.matmul, self.add) if v is not None]


def find_linears(info: FuncInfo) -> list[Linear]:
    """Every linear layer of a function, in binding order."""
    out = []

    def is_weight(e: Any) -> bool:  # a parameter (or one a pass is about to replace): not bound here
        return isinstance(e, relax.Var) and e not in info.values

    for var, value in info.values.items():
        if op_name(value) != "relax.matmul":
            continue
        x, pt = value.args
        perm = info.call(pt, "relax.permute_dims")
        if perm is None or info.uses.get(pt, 0) != 1 or not is_weight(perm.args[0]):
            continue
        axes = perm.attrs.axes
        if axes is None or [int(a) for a in axes] != [1, 0]:
            continue
        bias = add = None
        readers = info.users(var)
        if info.uses.get(var, 0) == 1 and len(readers) == 1:
            a = info.call(readers[0], "relax.add")
            if a is not None:
                other = a.args[1] if a.args[0].same_as(var) else a.args[0]
                if is_weight(other) and len(other.ty.shape.values) == 1:
                    bias, add = other, readers[0]
        out.append(Linear(x=x, weight=perm.args[0], bias=bias, permute=pt, matmul=var, add=add))
    return out


def drop_uncalled_primfuncs(mod: tvm.IRModule, droppable: Callable[[Any, Any], bool]) -> tvm.IRModule:
    """``mod`` without the PrimFuncs that ``droppable(global_var, func)`` selects and no exported
    function calls (``call_tir``) any more: DeadCodeElimination keeps every PrimFunc."""
    call_tir = tvm.ir.Op.get("relax.call_tir")
    called: set[str] = set()
    for fn in exported(mod):
        relax.analysis.post_order_visit(
            mod[fn],
            lambda e: called.add(str(e.args[0].name_hint)) if isinstance(e, relax.Call) and e.op.same_as(call_tir) else None,
        )
    dead = [gv for gv, func in mod.functions_items() if gv.name_hint not in called and droppable(gv, func)]
    if dead:
        mod = mod.clone()
        for gv in dead:
            del mod[gv]
    return mod


def call_tir_callee(mod: tvm.IRModule, value: Any) -> tuple[str, Any] | None:
    """(name, PrimFunc) of a ``call_tir`` binding's callee, else None."""
    if not isinstance(value, relax.Call) or getattr(value.op, "name", "") != "relax.call_tir":
        return None
    gv = value.args[0]
    func = mod[gv] if isinstance(gv, relax.GlobalVar) and gv in mod.functions else None
    return (gv.name_hint, func) if isinstance(func, tvm.tirx.PrimFunc) else None


def json_attr(func: Any, key: str) -> dict[str, Any] | None:
    """A PrimFunc's JSON attribute ``key`` (``perfx.quant``, ``perfx.fused_op``) parsed, else None."""
    if func.attrs is None or key not in func.attrs:
        return None
    return json.loads(str(func.attrs[key]))


def swiglu_reader(mod: tvm.IRModule, info: FuncInfo, y: Any) -> Any | None:
    """The var of ``h = swiglu(y)`` when that call is ``y``'s only reader, else None."""
    readers = info.users(y)
    if len(readers) != 1 or info.uses.get(y, 0) != 1 or info.used_outside(y):
        return None
    callee = call_tir_callee(mod, info.value(readers[0]))
    op = json_attr(callee[1], FUSED_OP_ATTR) if callee else None
    return readers[0] if op and op.get("op") == "swiglu" else None
