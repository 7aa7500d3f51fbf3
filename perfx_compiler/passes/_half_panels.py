"""Half-precision weights (``--quantization f16 | bf16``) packed at compile time into the GEMM's
panels: the Relax surgery ``weight_layout`` runs on CPU targets, and the PrimFuncs it emits.

Before: a half weight W [N, K] (``formats/half.py``) is read by a decode GEMV (``<f>_matmul``, rows <= 8),
by a prefill dequantize (``<f>_dequant``: float32 panels, rewritten per call) feeding NT matmuls,
and, for a tied embedding, by a gather (``<f>_take``). After: W is stored once as half panels
``[N / nb, K, nb]`` (``formats/panels.py``'s layout, 2 bytes per element), every matmul
reads ``widen(Wp[n // nb, k, n % nb])`` directly (``schedules/gemm_half_cpu.py`` schedules it,
widening each panel row in registers: bf16 by a shift, f16 by vcvtph2ps) and the gather reads
the panels too. The per-call float32 dequantize disappears (it wrote 4 N K bytes per prefill).

Only weights whose every use is one of those three is packed; activations rounded under
``--precision`` (act != f32) keep the row layout and their GEMV/dequantize kernels.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tvm
from tvm import relax, te, tirx

from perfx_compiler.formats import read_quant_info
from perfx_compiler.formats.half import FAMILIES, storage_dtype, widen_expr
from perfx_compiler.passes._relax_util import FuncInfo, drop_uncalled_primfuncs, exported, replace_weight_params

SUFFIX = "_panels"


def _quant_info(func: Any) -> dict[str, Any] | None:
    info = read_quant_info(func) if isinstance(func, tirx.PrimFunc) else None
    return info if info is not None and info.get("bits") == 16 and info.get("dtype") in FAMILIES else None


def _i64(d: Any) -> Any:
    """Shape dims as int64 (Relax's), so FuseTIR sees the same buffer types on both sides."""
    return tirx.IntImm("int64", int(d)) if isinstance(d, int) or isinstance(d, tirx.IntImm) else d


def _own_dims(shape: list[Any]) -> list[Any]:
    """The call site's dims with each compound symbolic one (``min(.., seq) - ..``: the last-token
    slice of prefill) as a fresh var of the PrimFunc, bound from its own ``x``. Kept as is it
    would reference the caller's ``seq``, which no PrimFunc argument defines; plain vars are
    renamed too so one kernel serves call sites of different functions."""
    return [d if isinstance(d, (int, tirx.IntImm)) else tirx.Var(f"n{i}", "int64") for i, d in enumerate(shape)]


def _rows_key(shape: list[Any]) -> str:
    return "x".join(str(int(d)) if isinstance(d, (int, tirx.IntImm)) else "n" for d in shape)


def half_panel_matmul(x_shape: list[Any], n: int, k: int, nb: int, family: str) -> Any:
    """PrimFunc ``y[..., n] = sum_k x[..., k] * widen(Wp[n // nb, k, n % nb])`` with Wp the half
    panels; ``x_shape`` may hold symbolic dims (prefill rows) or constants (decode)."""
    if n % nb:
        raise ValueError(f"panel width {nb} does not divide N={n}")
    i64 = _i64
    x = te.placeholder([i64(d) for d in x_shape], "float32", name="x")
    w = te.placeholder((i64(n // nb), i64(k), i64(nb)), storage_dtype(family), name="w")
    r = te.reduce_axis((i64(0), i64(k)), name="k")
    lead = len(x_shape) - 1
    y = te.compute(
        ([i64(d) for d in x_shape[:lead]] + [i64(n)]),
        lambda *i: te.sum(x[(*i[:lead], r)] * widen_expr(w[i[lead] // nb, r, i[lead] % nb], family), axis=r),
        name="NT_matmul",
    )
    # Opaque to FuseOps: fusing a producer that returns a tuple (add_rms_norm) into it breaks
    # FuseTIR ("inconsistent buffers"); the template schedules the matmul alone.
    return te.create_prim_func([x, w, y]).with_attr("op_pattern", 8)


def half_panel_take(ids_shape: list[Any], ids_dtype: str, n: int, k: int, nb: int, family: str) -> Any:
    """PrimFunc of an embedding gather from the half panels: out[..., c] = widen(Wp[i // nb, c, i % nb])."""
    i64 = _i64
    w = te.placeholder((i64(n // nb), i64(k), i64(nb)), storage_dtype(family), name="w")
    ids = te.placeholder([i64(d) for d in ids_shape], ids_dtype, name="ids")

    def row(*idx: Any) -> Any:
        i = ids[idx[:-1]].astype("int64")
        return widen_expr(w[i // nb, idx[-1], i % nb], family)

    out = te.compute([i64(d) for d in ids_shape] + [i64(k)], row, name="take_half_panels")
    return te.create_prim_func([w, ids, out])


def _shape(expr: Any) -> list[Any]:
    return _own_dims(list(expr.ty.shape.values))


def pack_half_weights(mod: tvm.IRModule, weights: dict[str, Any], nb: int,
                      nt_weight_arg: Any) -> tuple[tvm.IRModule, dict[str, Any]]:
    """Pack every half weight whose uses are all half GEMVs (act f32), half gathers, or half
    dequantizes feeding only NT matmuls (``nt_weight_arg(func)``: the weight's argument index,
    None when ``func`` is no NT matmul) into half panels, and rewrite those calls."""
    call_tir = tvm.ir.Op.get("relax.call_tir")
    quant = {gv.name_hint: info for gv, f in mod.functions_items() if (info := _quant_info(f)) is not None}
    if not quant:
        return mod, weights
    from schedules._matmul import analyze_matmul

    # Plain NT matmuls (x, W) -> y only: one with a fused epilogue would lose it in the rewrite.
    nt_args = {gv.name_hint: a for gv, f in mod.functions_items()
               if isinstance(f, tirx.PrimFunc) and gv.name_hint not in quant and len(f.params) == 3
               and (a := nt_weight_arg(f)) == 1 and not analyze_matmul(f).epilogue}

    ok: dict[str, bool] = {}
    for fn in exported(mod):
        func = mod[fn]
        info = FuncInfo.of(func)
        params = {p.name: p for p in func.params[int(func.attrs["num_input"]):]}
        nt_uses: dict[Any, int] = {}
        for value in info.values.values():
            if isinstance(value, relax.Call) and value.op.same_as(call_tir) and value.args[0].name_hint in nt_args:
                targs = list(value.args[1].fields)
                w = targs[nt_args[value.args[0].name_hint]]
                nt_uses[w] = nt_uses.get(w, 0) + 1
        good: dict[Any, int] = {}
        for var, value in info.values.items():
            if not (isinstance(value, relax.Call) and value.op.same_as(call_tir)):
                continue
            q = quant.get(value.args[0].name_hint)
            if q is None or q.get("act", "f32") != "f32" or int(q["N"]) % nb:
                continue
            targs = list(value.args[1].fields)
            arg = 0 if q["kind"] in ("dequant", "take") else 1 if q["kind"] == "matmul" else None
            if arg is None or arg >= len(targs):
                continue
            if q["kind"] == "dequant" and not (info.uses.get(var, 0) and nt_uses.get(var, 0) == info.uses[var]):
                continue
            good[targs[arg]] = good.get(targs[arg], 0) + 1
        for name, var in params.items():
            arr = weights.get(name)
            if arr is None or np.asarray(arr).ndim != 2 or info.uses.get(var, 0) == 0:
                continue
            ok[name] = ok.get(name, True) and good.get(var, 0) == info.uses[var]
    packable = {n for n, v in ok.items() if v}
    if not packable:
        return mod, weights

    from perfx_compiler.formats.panels import pack_weight

    new_weights = {n: (pack_weight(np.asarray(a), nb) if n in packable else a) for n, a in weights.items()}
    mod, new_weights, params_by_fn = replace_weight_params(mod, weights, new_weights)
    added: dict[str, Any] = {}

    @relax.expr_functor.mutator
    class Rewriter(relax.PyExprMutator):
        def __init__(self, mod: tvm.IRModule) -> None:
            super().__init__(mod)
            self.old: dict[Any, str] = {}
            self.new: dict[str, relax.Var] = {}
            self.deq: dict[Any, tuple[Any, dict[str, Any]]] = {}  # dequantized var -> (panels, info)

        def _add(self, key: str, func: Any) -> Any:
            if key not in added:
                added[key] = self.builder_.add_func(func, key)
            return added[key]

        def _panels(self, e: Any) -> Any:
            name = self.old.get(e) if isinstance(e, relax.Var) else None
            return self.new[name] if name in packable else None

        def visit_var_binding_(self, binding: Any) -> None:
            value = binding.value
            if isinstance(value, relax.Call) and value.op.same_as(call_tir):
                q = quant.get(value.args[0].name_hint)
                if q is not None and q["kind"] == "dequant":
                    wp = self._panels(list(value.args[1].fields)[0])
                    if wp is not None:
                        self.deq[binding.var] = (wp, q)  # its NT matmuls read the panels instead
                        return None
            return super().visit_var_binding_(binding)

        def visit_call_(self, call: relax.Call) -> Any:
            if not call.op.same_as(call_tir):
                return super().visit_call_(call)
            name = call.args[0].name_hint
            targs = list(call.args[1].fields)
            q = quant.get(name)
            if name in nt_args and targs[nt_args[name]] in self.deq:
                wp, q = self.deq[targs[nt_args[name]]]
                x = self.visit_expr(targs[0])
                n, k, fam = int(q["N"]), int(q["K"]), q["dtype"]
                shape = _shape(targs[0])
                pf = half_panel_matmul(shape, n, k, nb, fam)
                gv = self._add(f"{fam}_gemm_{n}_{k}_{_rows_key(shape[:-1])}{SUFFIX}", pf)
                return relax.call_tir(gv, [x, wp], call.ty)
            if q is not None and q["kind"] == "matmul" and self._panels(targs[1]) is not None:
                n, k, fam = int(q["N"]), int(q["K"]), q["dtype"]
                shape = _shape(targs[0])
                pf = half_panel_matmul(shape, n, k, nb, fam)
                gv = self._add(f"{fam}_gemv_{n}_{k}_{_rows_key(shape[:-1])}{SUFFIX}", pf)
                return relax.call_tir(gv, [self.visit_expr(targs[0]), self._panels(targs[1])], call.ty)
            if q is not None and q["kind"] == "take" and self._panels(targs[0]) is not None:
                n, k, fam = int(q["N"]), int(q["K"]), q["dtype"]
                ids = targs[1]
                shape = _shape(ids)
                pf = half_panel_take(shape, str(ids.ty.dtype), n, k, nb, fam)
                key = f"{fam}_take_{n}_{k}_{_rows_key(shape)}_{ids.ty.dtype}{SUFFIX}"
                return relax.call_tir(self._add(key, pf), [self._panels(targs[0]), self.visit_expr(ids)], call.ty)
            return super().visit_call_(call)

    rewriter = Rewriter(mod)
    for fn in exported(mod):
        func = mod[fn]
        rewriter.old = {v: v.name for v in relax.analysis.free_vars(func.body) if v.name in packable}
        rewriter.new = params_by_fn[fn]
        rewriter.deq = {}
        new_func = rewriter.visit_expr(func)
        rewriter.builder_.update_func(rewriter.builder_.get().get_global_var(fn), new_func)
    out = relax.transform.DeadCodeElimination(exported(rewriter.builder_.get()))(rewriter.builder_.get())
    # The row-layout half kernels nothing calls any more: drop them.
    return drop_uncalled_primfuncs(out, lambda gv, _func: gv.name_hint in quant), new_weights
