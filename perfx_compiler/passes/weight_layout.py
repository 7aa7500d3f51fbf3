"""Weight layout: read linear weights without a per-call transpose, and on CPU targets pre-pack
them at compile time into the panels the GEMM/GEMV micro-kernels read.

1. ``FuseTransposeMatmul``: ``x @ transpose(W)`` becomes one ``NT_matmul`` that reads W [N, K]
   as stored (no transpose kernel per weight per step).
2. CPU (llvm) targets: every float weight parameter that only feeds NT matmuls (and, for a tied
   embedding, ``take(W, ids, axis=0)``) is packed here, once, into ``[N / nb, K, nb]`` panels
   (nb = ``schedules._matmul.panel_width(target)``, a multiple of the SIMD width), and the
   matmuls read ``W[n // nb, k, n % nb]``: each micro-tile's weights are one contiguous stream
   and no call repacks them (the in-call packing cost as much as the FLOPs at short prompts).
   The gather of a tied embedding reads the same panels, so no second copy is kept. The
   templates take nb from the function itself, so a tuning record made for another nb belongs
   to another workload and a config whose tiles do not fit nb is rejected.
3. CPU targets, quantized prefill: a weight dequantized at run time (a ``perfx.quant``
   ``dequant`` PrimFunc, see ``_quantized_linears``) whose result only feeds NT matmuls is written
   straight into the same panels (its output buffer is re-laid out ``[N / nb, K, nb]``; the
   dequant templates take nb from that buffer) and the matmuls become the same packed variants
   as for a compile-time packed weight: the GEMM never repacks a runtime weight.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tvm
from tvm import relax, te, tirx

from perfx_compiler.formats import read_quant_info
from perfx_compiler.formats.panels import pack_weight
from perfx_compiler.passes._relax_util import FuncInfo, drop_uncalled_primfuncs, exported, replace_weight_params

NAME = "weight_layout"
PACKED_SUFFIX = "_packed"


def _nt_weight_arg(func: Any) -> int | None:
    """Position of the [N, K] weight among ``func``'s parameters when it is an NT matmul."""
    from schedules._matmul import _name, analyze_matmul

    facts = analyze_matmul(func)
    if facts is None or facts.layout != "NT":
        return None
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    block = sch.get(sch.get_sblock(facts.block))
    b_name = _name(block.reads[facts.b_read_index])
    names = [str(p.name) for p in func.params]
    return names.index(b_name) if names.count(b_name) == 1 else None


def packed_variant(func: Any, arg: int, nb: int) -> Any:
    """The same PrimFunc reading its weight parameter ``arg`` as [N / nb, K, nb] panels."""
    from tvm import s_tir

    from schedules._matmul import analyze_matmul

    facts = analyze_matmul(func)
    sch = s_tir.Schedule(func)
    block = sch.get_sblock(facts.block)
    # Rewrites the parameter buffer and every access: w[n, k] -> w[n // nb, k, n % nb].
    sch.transform_layout(block, ("read", facts.b_read_index), lambda n, k: (n // nb, k, n % nb))
    return sch.mod["main"]


def is_dequant(func: Any) -> bool:
    """A quantized weight's reference dequantize PrimFunc (W as float [N, K])."""
    info = read_quant_info(func) if isinstance(func, tirx.PrimFunc) else None
    return info is not None and info.get("kind") == "dequant"


def packed_dequant(func: Any, nb: int) -> Any:
    """The dequantize PrimFunc writing its [N, K] output as [N / nb, K, nb] panels."""
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    out = func.params[-1]  # tirx PrimFunc params are the buffers
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        if any(r.source.same_as(out) for r in sch.get(block).writes):
            sch.transform_layout(block, ("write", 0), lambda n, k: (n // nb, k, n % nb))
            return sch.mod["main"]
    raise ValueError("internal: no block writes the dequantized weight")


def _runtime_plan(mod: tvm.IRModule, fn: str, matmuls: dict[str, int], nb: int) -> set[Any]:
    """Vars of ``fn`` bound to a dequantize call whose every use is an NT matmul's weight."""
    call_tir = tvm.ir.Op.get("relax.call_tir")
    info = FuncInfo.of(mod[fn])
    good: dict[Any, int] = {}
    deq: list[Any] = []
    for var, value in info.values.items():
        if not (isinstance(value, relax.Call) and value.op.same_as(call_tir)):
            continue
        name = value.args[0].name_hint
        if name in matmuls:
            targs = list(value.args[1].fields)
            if matmuls[name] < len(targs) and isinstance(targs[matmuls[name]], relax.Var):
                w = targs[matmuls[name]]
                good[w] = good.get(w, 0) + 1
        elif is_dequant(mod[name]) and isinstance(var, relax.DataflowVar):
            shape = [int(d) for d in var.ty.shape.values]
            if len(shape) == 2 and shape[0] % nb == 0:
                deq.append(var)
    return {v for v in deq if info.uses.get(v, 0) > 0 and good.get(v, 0) == info.uses[v]}


def _packed_take(nb: int):  # noqa: ANN202 - a TE compute builder
    def take(w: te.Tensor, ids: te.Tensor) -> te.Tensor:
        k = w.shape[1]

        def row(*idx: Any) -> Any:
            i = ids[idx[:-1]].astype("int64")
            return w[i // nb, idx[-1], i % nb]

        return te.compute((*ids.shape, k), row, name="take_packed")

    return take


def _plan(mod: tvm.IRModule, weights: dict[str, Any], nb: int) -> tuple[dict[str, int], set[str]]:
    """Which PrimFuncs are NT matmuls (name -> weight arg) and which weights can be packed: every
    use in every exported function is such a matmul's weight or a row gather (take axis 0)."""
    matmuls: dict[str, int] = {}
    for gv, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc):
            arg = _nt_weight_arg(func)
            if arg is not None:
                matmuls[gv.name_hint] = arg
    ok: dict[str, bool] = {}
    for fn in exported(mod):
        func = mod[fn]
        info = FuncInfo.of(func)
        params = {p.name: p for p in func.params[int(func.attrs["num_input"]) :]}
        good: dict[Any, int] = {}
        for value in info.values.values():
            if isinstance(value, relax.Call) and value.op.same_as(tvm.ir.Op.get("relax.call_tir")):
                name = value.args[0].name_hint
                targs = list(value.args[1].fields)
                if name in matmuls and matmuls[name] < len(targs):
                    w = targs[matmuls[name]]
                    good[w] = good.get(w, 0) + 1
            elif (
                isinstance(value, relax.Call)
                and value.op.same_as(tvm.ir.Op.get("relax.take"))
                and int(value.attrs.axis) == 0
            ) or (isinstance(value, relax.Call) and value.op.same_as(tvm.ir.Op.get("relax.shape_of"))):
                # a row gather, or the [N, K] shape (negative ids wrap around the vocabulary)
                good[value.args[0]] = good.get(value.args[0], 0) + 1
        for name, var in params.items():
            arr = weights.get(name)
            if arr is None or arr.ndim != 2 or arr.dtype != np.float32 or arr.shape[0] % nb:
                continue
            uses = info.uses.get(var, 0)
            if uses == 0:
                continue
            ok[name] = ok.get(name, True) and good.get(var, 0) == uses
    return matmuls, {n for n, v in ok.items() if v}


def pack_linear_weights(
    mod: tvm.IRModule, weights: dict[str, Any], nb: int
) -> tuple[tvm.IRModule, dict[str, Any]]:
    """Pack every packable linear weight (see module doc); returns the new module and weights."""
    matmuls, packable = _plan(mod, weights, nb)
    runtime = {fn: _runtime_plan(mod, fn, matmuls, nb) for fn in exported(mod)}
    # Only matmuls that read a packable weight somewhere get a packed variant.
    if not packable and not any(runtime.values()):
        return mod, weights
    if packable:
        new_weights = {n: (pack_weight(np.asarray(a), nb) if n in packable else a) for n, a in weights.items()}
        mod, new_weights, params_by_fn = replace_weight_params(mod, weights, new_weights)
    else:
        new_weights, params_by_fn = weights, {fn: {} for fn in exported(mod)}
    variants: dict[str, Any] = {}
    call_tir = tvm.ir.Op.get("relax.call_tir")
    take_op = tvm.ir.Op.get("relax.take")
    shape_op = tvm.ir.Op.get("relax.shape_of")

    @relax.expr_functor.mutator
    class Rewriter(relax.PyExprMutator):
        def __init__(self, mod: tvm.IRModule, old_params: dict[Any, str], new_params: dict[str, relax.Var]) -> None:
            super().__init__(mod)
            self.old = old_params  # original weight Var -> name
            self.new = new_params
            self.runtime: set[Any] = set()  # dequantized weights to write as panels

        def visit_var_binding_(self, binding: Any) -> None:
            if binding.var not in self.runtime:
                return super().visit_var_binding_(binding)
            value = binding.value
            name = value.args[0].name_hint
            if name + PACKED_SUFFIX not in variants:
                variants[name + PACKED_SUFFIX] = self.builder_.add_func(packed_dequant(mod[name], nb), name + PACKED_SUFFIX)
            n, k = (int(d) for d in binding.var.ty.shape.values)
            args = [self.visit_expr(a) for a in value.args[1].fields]
            call = relax.call_tir(variants[name + PACKED_SUFFIX], args, relax.TensorType([n // nb, k, nb], "float32"))
            self.set_var_remap(binding.var, self.builder_.emit(call, binding.var.name))
            return None

        def _packed(self, e: Any) -> relax.Var | None:
            name = self.old.get(e) if isinstance(e, relax.Var) else None
            return self.new[name] if name in packable else None

        def visit_call_(self, call: relax.Call) -> Any:
            if call.op.same_as(call_tir) and call.args[0].name_hint in matmuls:
                name = call.args[0].name_hint
                args = list(call.args[1].fields)
                wp = self._packed(args[matmuls[name]])
                if wp is None and args[matmuls[name]] in self.runtime:
                    wp = self.visit_expr(args[matmuls[name]])  # the panels its dequantize now writes
                if wp is not None:
                    if name not in variants:
                        pf = packed_variant(mod[name], matmuls[name], nb)
                        variants[name] = self.builder_.add_func(pf, name + PACKED_SUFFIX)
                    new_args = [self.visit_expr(a) for a in args]
                    new_args[matmuls[name]] = wp
                    return relax.call_tir(variants[name], new_args, call.ty)
            if call.op.same_as(shape_op) and self._packed(call.args[0]) is not None:
                return relax.ShapeExpr(list(weights[self.old[call.args[0]]].shape))  # the logical shape
            if call.op.same_as(take_op) and int(call.attrs.axis) == 0:
                wp = self._packed(call.args[0])
                if wp is not None:
                    ids = self.visit_expr(call.args[1])
                    return self.builder_.emit_te(_packed_take(nb), wp, ids, primfunc_name_hint="take_packed")
            return super().visit_call_(call)

    rewriter = Rewriter(mod, {}, {})
    for fn in exported(mod):
        func = mod[fn]
        # The body still reads the weight Vars the function had before replace_weight_params
        # gave packed weights fresh ones: map those (now free) vars to their names.
        rewriter.old = {v: v.name for v in relax.analysis.free_vars(func.body) if v.name in packable}
        rewriter.new = params_by_fn[fn]
        rewriter.runtime = runtime[fn]
        new_func = rewriter.visit_expr(func)
        rewriter.builder_.update_func(rewriter.builder_.get().get_global_var(fn), new_func)
    out = relax.transform.DeadCodeElimination(exported(rewriter.builder_.get()))(rewriter.builder_.get())
    # A dequantize whose every call now writes panels is dead: drop it.
    out = drop_uncalled_primfuncs(out, lambda gv, func: is_dequant(func) and gv.name_hint + PACKED_SUFFIX in variants)
    return out, new_weights


def apply(mod: tvm.IRModule, weights: dict[str, Any], ctx: Any) -> tuple[tvm.IRModule, dict[str, Any]]:
    mod = relax.transform.FuseTransposeMatmul()(mod)
    target = getattr(ctx, "target", None)
    if target is None:
        return mod, weights
    from perfx_compiler.schedule_template import is_cpu_target
    from schedules._matmul import panel_width

    if not is_cpu_target(target):
        return mod, weights  # GPU rules (dlight, ours) read NT weights
    from perfx_compiler.passes._half_panels import pack_half_weights

    # f16/bf16 weights: half panels read by gemm_half_cpu (no per-call fp32 dequantize)
    mod, weights = pack_half_weights(mod, weights, panel_width(target), _nt_weight_arg)
    return pack_linear_weights(mod, weights, panel_width(target))
