"""GPT/GLM-style blocks: residual add + LayerNorm -> one kernel; GeLU (+ the linear's bias add) -> one kernel.

(a) ``s = a + b; y = layer_norm(s, w, beta)`` (``relax.nn.layer_norm`` over the last axis, as the
ONNX ``LayerNormalization`` imports) becomes one call of a hand-scheduled kernel returning ``(s, y)``
— the LayerNorm counterpart of ``fuse_add_norm``; a LayerNorm without a residual add before it becomes
a one-kernel ``layer_norm``.

(b) GeLU, in any spelling exporters produce — ``relax.nn.gelu`` / ``gelu_tanh``, or the primitive
chains ``0.5 x (1 + erf(x / sqrt 2))`` and ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` in any
operand order — becomes one elementwise kernel. The chain is recognised by what it computes, not by
its op order: the elementwise sub-graph feeding a candidate output, with one tensor input and scalar
constants, is evaluated in float64 on sample points and compared with both GeLU forms. When the
GeLU input is a linear's bias add (``matmul + b``, possibly behind a reshape, as transformers' Conv1D
exports), the bias add moves into the kernel, and the kernel stays elementwise so FuseOps folds it
into the matmul as its epilogue: matmul + bias + GeLU is one launch.

Llama-family graphs (RMSNorm, SwiGLU) contain neither op: the pass leaves them unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import tvm
from tvm import relax, sym

from perfx_compiler.passes._ln_gelu_kernels import gelu_kernel, layer_norm_kernel
from perfx_compiler.passes._relax_util import SKIP, FuncInfo, exported, op_name, rewrite_functions

NAME = "fuse_layernorm_gelu"
ORDER = 12  # with fuse_add_norm, before merges and quantization (which then see plain matmuls)
DEFAULT = True

_ELEMWISE = {"relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.power", "relax.tanh",
             "relax.erf", "relax.sqrt"}
_GELU_OPS = {"relax.nn.gelu": "erf", "relax.nn.gelu_tanh": "tanh"}
_SAMPLES = np.linspace(-6.0, 6.0, 49)
_ERF = np.vectorize(math.erf)
_FORMS = {
    "erf": 0.5 * _SAMPLES * (1.0 + _ERF(_SAMPLES / math.sqrt(2.0))),
    "tanh": 0.5 * _SAMPLES * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (_SAMPLES + 0.044715 * _SAMPLES**3))),
}
# float32 constants (sqrt(2/pi) = 0.7978846) leave ~1e-7 relative error; the two forms differ by >= 1e-4
_MATCH_TOL = 2e-5
_Constant = tvm.ir.expr.Constant  # relax constants (tvm 0.27 moved the class)
_ELEMWISE_PATTERN = 0  # OpPatternKind.kElemWise: FuseOps may fuse the GeLU kernel into the matmul


def _lanes(ctx: Any) -> int:
    bits = getattr(getattr(ctx, "target", None), "vector_bits", None) or 512
    return max(4, bits // 32)


def _shape(expr: Any) -> list[Any]:
    return list(expr.ty.shape.values) if isinstance(getattr(expr, "ty", None), relax.TensorType) else []


def _static(d: Any) -> int | None:
    return int(d.value) if isinstance(d, tvm.tirx.IntImm) else None


def _same_shape(a: Any, b: Any) -> bool:
    sa, sb = _shape(a), _shape(b)
    ana = sym.Analyzer()
    return len(sa) == len(sb) and all(ana.can_prove_equal(x, y) for x, y in zip(sa, sb, strict=True))


def _is_f32(expr: Any) -> bool:
    return getattr(getattr(expr, "ty", None), "dtype", None) == "float32"


class _Graph:
    """One function's bindings plus the scalar values of its constants and scalar weight parameters."""

    def __init__(self, func: relax.Function, weights: dict[str, Any]) -> None:
        self.info = FuncInfo.of(func)
        self.params = {p for p in func.params}
        self.weights = weights

    def scalar(self, expr: Any) -> float | None:
        arr = None
        if isinstance(expr, _Constant):
            arr = expr.value.numpy()
        elif isinstance(expr, relax.Var) and expr in self.params and expr.name in self.weights:
            arr = np.asarray(self.weights[expr.name])
        if arr is None or arr.size != 1:
            return None
        return float(arr.reshape(-1)[0])

    def vector(self, expr: Any, n: int) -> bool:
        """Whether ``expr`` is a 1-D float32 tensor of length n that is not computed here (a bias)."""
        s = _shape(expr)
        return (len(s) == 1 and _static(s[0]) == n and _is_f32(expr)
                and (isinstance(expr, _Constant) or expr in self.params))


# ---------------------------------------------------------------------------------------------
# GeLU
def _chain(g: _Graph, out: Any, stop: Any) -> list[Any] | None:
    """Elementwise bindings from ``out`` down to ``stop`` (exclusive), or None when a tensor leaf
    other than ``stop`` is reached (every other leaf must be a scalar constant)."""
    nodes: list[Any] = []
    seen: set[Any] = set()
    stack = [out]
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        call = g.info.value(v)
        if op_name(call) not in _ELEMWISE:
            return None
        nodes.append(v)
        for a in call.args:
            if stop is not None and a.same_as(stop):
                continue
            if g.scalar(a) is not None:
                continue
            if isinstance(a, relax.Var) and op_name(g.info.value(a)) in _ELEMWISE:
                stack.append(a)
                continue
            return None  # a tensor leaf other than ``stop``
    return nodes


def _evaluate(g: _Graph, out: Any, x: Any) -> np.ndarray:
    memo: dict[Any, Any] = {}

    def ev(e: Any) -> Any:
        if e.same_as(x):
            return _SAMPLES
        s = g.scalar(e)
        if s is not None:
            return s
        if e in memo:
            return memo[e]
        call = g.info.value(e)
        a = [ev(arg) for arg in call.args]
        name = op_name(call)
        with np.errstate(all="ignore"):
            r = {
                "relax.add": lambda: a[0] + a[1], "relax.subtract": lambda: a[0] - a[1],
                "relax.multiply": lambda: a[0] * a[1], "relax.divide": lambda: a[0] / a[1],
                "relax.power": lambda: np.power(a[0], a[1]), "relax.tanh": lambda: np.tanh(a[0]),
                "relax.erf": lambda: _ERF(a[0]), "relax.sqrt": lambda: np.sqrt(a[0]),
            }[name]()
        memo[e] = r
        return r

    return np.broadcast_to(np.asarray(ev(out), dtype=np.float64), _SAMPLES.shape)


def _candidates(g: _Graph, out: Any) -> list[Any]:
    """Vars the chain under ``out`` reads, nearest first: the GeLU input is one of them."""
    order, seen, queue = [], set(), [out]
    while queue:
        v = queue.pop(0)
        call = g.info.value(v)
        if op_name(call) not in _ELEMWISE:
            continue
        for a in call.args:
            if isinstance(a, relax.Var) and a not in seen and g.scalar(a) is None:
                seen.add(a)
                order.append(a)
                queue.append(a)
    return order


def _match_gelu(g: _Graph, out: Any) -> dict[str, Any] | None:
    """{x, kind, inner} when ``out`` is GeLU of a single tensor ``x``."""
    call = g.info.value(out)
    name = op_name(call)
    if name in _GELU_OPS:
        return {"x": call.args[0], "kind": _GELU_OPS[name], "inner": []}
    if name != "relax.multiply":
        return None
    for x in _candidates(g, out):
        if not _same_shape(x, out) or not _is_f32(x):
            continue
        nodes = _chain(g, out, x)
        if nodes is None:
            continue
        if not any(op_name(g.info.value(v)) in ("relax.erf", "relax.tanh") for v in nodes):
            continue
        inner = [v for v in nodes if not v.same_as(out)]
        inside = set(nodes)
        if any(not set(g.info.users(v)) <= inside or not isinstance(v, relax.DataflowVar) for v in inner):
            continue  # an intermediate is read elsewhere: keep the graph as it is
        y = _evaluate(g, out, x)
        for kind, ref in _FORMS.items():
            if np.all(np.isfinite(y)) and float(np.abs(y - ref).max()) < _MATCH_TOL:
                return {"x": x, "kind": kind, "inner": inner}
    return None


def _bias_source(g: _Graph, x: Any, readers_ok: set[Any]) -> dict[str, Any] | None:
    """``x = m + b`` (or ``x = reshape(m + b)``) with a bias vector b and x/the add read only by the
    GeLU: {m, b, skip, reshape} so the add moves into the kernel."""
    if not isinstance(x, relax.DataflowVar) or not set(g.info.users(x)) <= readers_ok:
        return None
    reshape = None
    src = x
    if op_name(g.info.value(x)) == "relax.reshape":
        reshape = x
        src = g.info.value(x).args[0]
        if not isinstance(src, relax.DataflowVar) or g.info.users(src) != [x] or g.info.uses.get(src, 0) != 1:
            return None
    add = g.info.call(src, "relax.add")
    if add is None:
        return None
    n = _static(_shape(src)[-1]) if _shape(src) else None
    if n is None or n != _static(_shape(x)[-1]):
        return None
    for m, b in ((add.args[0], add.args[1]), (add.args[1], add.args[0])):
        if g.vector(b, n) and _same_shape(m, src) and _is_f32(m):
            return {"m": m, "b": b, "skip": [v for v in (src, reshape) if v is not None]}
    return None


# ---------------------------------------------------------------------------------------------
# LayerNorm
def _match_layer_norm(g: _Graph, var: Any) -> dict[str, Any] | None:
    call = g.info.call(var, "relax.nn.layer_norm")
    if call is None:
        return None
    x, w, beta = call.args[:3]
    shape = _shape(x)
    if len(shape) != 3 or not _is_f32(x) or _static(shape[-1]) is None:
        return None
    axes = [int(a) for a in call.attrs.axes]
    if axes not in ([-1], [2]) or not bool(call.attrs.center) or not bool(call.attrs.scale):
        return None
    H = _static(shape[-1])
    if not (g.vector(w, H) and g.vector(beta, H)):
        return None
    add = g.info.call(x, "relax.add")
    residual = add is not None and all(_same_shape(a, x) and _is_f32(a) for a in add.args)
    return {"x": x, "w": w, "beta": beta, "eps": float(call.attrs.epsilon), "H": H, "add": add if residual else None}


def _ln_name(H: int, eps: float, residual: bool) -> str:
    return f"{'add_layer_norm' if residual else 'layer_norm'}_{H}_{eps:g}".replace(".", "p").replace("-", "m")


def _gelu_name(fn: str, kind: str, shape: list[Any], bias: bool) -> str:
    """Kernel name: one kernel per call-site shape (per function when the shape is symbolic, since
    each function has its own sequence-length variable)."""
    dims = "x".join(str(_static(d)) if _static(d) is not None else "n" for d in shape)
    scope = f"_{fn}" if any(_static(d) is None for d in shape) else ""
    return f"{'bias_gelu' if bias else 'gelu'}_{kind}_{dims}{scope}"


def _plan(fn: str, g: _Graph, lanes: int, kernels: dict[str, Any]) -> list[tuple[str, Any, dict[str, Any]]]:
    found: list[tuple[str, Any, dict[str, Any]]] = []
    claimed: set[Any] = set()
    for var in g.info.values:
        m = _match_layer_norm(g, var)
        if m is not None:
            name = _ln_name(m["H"], m["eps"], m["add"] is not None)
            if name not in kernels:  # built once: parsing TVMScript is slow
                kernels[name] = layer_norm_kernel(m["H"], m["eps"], m["add"] is not None, lanes)
            found.append(("ln", var, {**m, "kernel": name}))
    if not any(op_name(v) in ("relax.erf", "relax.tanh", *_GELU_OPS) for v in g.info.values.values()):
        return found  # no GeLU anywhere (Llama-family graphs): skip the matcher
    for var in reversed(list(g.info.values)):  # outermost first, so a chain's inner nodes are claimed
        if var in claimed or op_name(g.info.value(var)) not in ("relax.multiply", *_GELU_OPS):
            continue
        m = _match_gelu(g, var)
        if m is None or any(v in claimed for v in m["inner"]):
            continue
        shape = _shape(m["x"])
        F = _static(shape[-1]) if shape else None
        if F is None:
            continue
        bias = _bias_source(g, m["x"], {*m["inner"], var}) if op_name(g.info.value(var)) not in _GELU_OPS \
            else _bias_source(g, m["x"], {var})
        src = bias["m"] if bias else m["x"]
        name = _gelu_name(fn, m["kind"], _shape(src), bias is not None)
        if name not in kernels:
            kernels[name] = gelu_kernel(_shape(src), m["kind"], bias is not None)
        claimed.update([var, *m["inner"]])
        found.append(("gelu", var, {**m, "bias": bias, "src": src, "kernel": name}))
    return found


def apply(mod: tvm.IRModule, weights: dict[str, Any], ctx: Any) -> tuple[tvm.IRModule, dict[str, Any]]:
    lanes = _lanes(ctx)
    kernels: dict[str, Any] = {}
    plans = {fn: _plan(fn, _Graph(mod[fn], weights), lanes, kernels) for fn in exported(mod)}
    if not kernels:
        return mod, weights

    def plan_for(fn: str, func: relax.Function, info: FuncInfo, gvars: dict[str, Any]) -> dict[Any, Any]:
        plan: dict[Any, Any] = {}
        for kind, var, m in plans[fn]:
            gv = gvars[m["kernel"]]
            if kind == "ln":
                ty = relax.TensorType(m["x"].ty.shape, "float32")
                plan[var] = SKIP
                if m["add"] is not None:

                    def fused(rw: Any, binding: Any, m=m, gv=gv, ty=ty, out=var) -> None:
                        a, b = rw.arg(m["add"].args[0]), rw.arg(m["add"].args[1])
                        t = rw.emit(relax.call_tir(gv, [a, b, rw.arg(m["w"]), rw.arg(m["beta"])], [ty, ty]))
                        rw.remap(binding.var, rw.emit(relax.TupleGetItem(t, 0), binding.var))
                        rw.remap(out, rw.emit(relax.TupleGetItem(t, 1), out))

                    plan[m["x"]] = fused
                else:

                    def single(rw: Any, binding: Any, m=m, gv=gv, ty=ty) -> None:
                        call = relax.call_tir(gv, [rw.arg(m["x"]), rw.arg(m["w"]), rw.arg(m["beta"])], ty)
                        rw.remap(binding.var, rw.emit(call, binding.var))

                    plan[var] = single
                continue
            for v in [*m["inner"], *(m["bias"]["skip"] if m["bias"] else [])]:
                plan[v] = SKIP

            def gelu(rw: Any, binding: Any, m=m, gv=gv) -> None:
                src = m["src"]
                args = [rw.arg(src)] + ([rw.arg(m["bias"]["b"])] if m["bias"] else [])
                y = relax.call_tir(gv, args, relax.TensorType(src.ty.shape, "float32"))
                if not _same_shape(src, binding.var):
                    y = relax.op.reshape(rw.emit(y), binding.var.ty.shape)
                rw.remap(binding.var, rw.emit(y, binding.var))

            plan[var] = gelu
        return plan

    mod, gvars = rewrite_functions(mod, plan_for, kernels)
    for name, gv in gvars.items():
        if name.startswith(("gelu_", "bias_gelu_")):
            mod[gv] = mod[gv].with_attr("op_pattern", _ELEMWISE_PATTERN)
    return mod, weights
