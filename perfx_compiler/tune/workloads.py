"""Distinct tuning workloads of an IRModule (after FuseTIR), plus synthetic model-shaped modules.

Functions with a symbolic M are tuned on M buckets (1, 16, 64, 256); the bucket is part of the
task (and of its records), so a dispatcher may later pick a configuration per bucket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from perfx_compiler.schedule_template import ScheduleTemplate, Workload, find_template
from perfx_compiler.targets import TargetDescription

M_BUCKETS = (1, 16, 64, 256)
SCHEDULED_ATTR = "tirx.is_scheduled"


@dataclass
class TuningTask:
    name: str  # a function name that has this workload (first seen)
    func: Any  # the unscheduled PrimFunc
    template: ScheduleTemplate
    workload: Workload
    m_value: int  # M the candidates are timed at (the bucket, or the static M)
    count: int = 1  # how many functions in the module share this workload

    @property
    def bucket(self) -> int | None:
        return self.m_value if self.workload.symbolic else None


def extract_tasks(
    mod: Any,
    target: TargetDescription,
    buckets: tuple[int, ...] = M_BUCKETS,
    only_tunable: bool = True,
) -> list[TuningTask]:
    """One task per (distinct workload, M bucket); functions already scheduled are skipped."""
    from tvm import tirx

    tasks: dict[tuple[str, int], TuningTask] = {}
    for gvar, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        if func.attrs is not None and SCHEDULED_ATTR in func.attrs and bool(func.attrs[SCHEDULED_ATTR]):
            continue
        found = find_template(func, target)
        if found is None:
            continue
        template, workload = found
        if only_tunable and len(template.space(workload, target)) == 0:
            continue
        ms = buckets if workload.symbolic else (workload.dims.get("M", 1) or 1,)
        for m in ms:
            key = (workload.key, int(m))
            if key in tasks:
                tasks[key].count += 1
            else:
                tasks[key] = TuningTask(gvar.name_hint, func, template, workload, int(m))
    return list(tasks.values())


# ----------------------------------------------------------------------------- model-shaped modules

SMOLLM2_LINEARS = {  # name -> (K, N) of SmolLM2-135M's linear layers
    "q_proj": (576, 576),
    "kv_proj": (576, 192),
    "o_proj": (576, 576),
    "gate_up": (576, 1536),
    "down_proj": (1536, 576),
    "lm_head": (576, 49152),
}


def linear_module(
    M: int | None,
    K: int,
    N: int,
    epilogue: str | None = None,
    weights_nk_fused: bool = False,
) -> Any:
    """The module the compile pipeline produces for ``matmul(x, permute_dims(w))``.

    x is [1, M, K] (M None = symbolic ``seq``), w is [N, K]. ``epilogue``: None, "add" (residual),
    "bias", "silu_mul" (silu(x W1^T) * r) or "silu". With the pipeline's pass order
    (LegalizeOps before FuseTransposeMatmul) the weight transpose stays a separate function and the
    matmul reads w^T [K, N]; ``weights_nk_fused=True`` runs FuseTransposeMatmul first, giving an
    NT_matmul that reads w [N, K] directly.
    """
    import tvm
    from tvm import relax, tirx

    m = tirx.Var("seq", "int64") if M is None else M
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1, m, K], "float32"))
    w = relax.Var("w", relax.TensorType([N, K], "float32"))
    params = [x, w]
    extra = None
    if epilogue in ("add", "silu_mul"):
        extra = relax.Var("r", relax.TensorType([1, m, N], "float32"))
        params.append(extra)
    elif epilogue == "bias":
        extra = relax.Var("b", relax.TensorType([N], "float32"))
        params.append(extra)
    with bb.function("main", params):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w)))
            if epilogue in ("add", "bias"):
                y = bb.emit(relax.op.add(y, extra))
            elif epilogue == "silu_mul":
                y = bb.emit(relax.op.multiply(relax.op.nn.silu(y), extra))
            elif epilogue == "silu":
                y = bb.emit(relax.op.nn.silu(y))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    passes = [relax.transform.LegalizeOps(), relax.transform.FuseTransposeMatmul()]
    if weights_nk_fused:
        passes.reverse()
    passes += [relax.transform.AnnotateTIROpPattern(), relax.transform.FuseOps(), relax.transform.FuseTIR()]
    return tvm.transform.Sequential(passes)(bb.get())


def packed_linear_func(M: int | None, K: int, N: int, nb: int, epilogue: str | None = None) -> Any:
    """The matmul PrimFunc of ``linear_module`` with its weight read as pre-packed [N / nb, K, nb]
    panels, as the weight_layout pass leaves it on CPU targets."""
    from perfx_compiler.passes.weight_layout import _nt_weight_arg, packed_variant

    func = matmul_func(linear_module(M, K, N, epilogue, True))
    arg = _nt_weight_arg(func)
    if arg is None:
        raise ValueError("linear_module gave no NT matmul")
    return packed_variant(func, arg, nb)


def matmul_func(mod: Any) -> Any:
    """The (fused) matmul PrimFunc of a ``linear_module``."""
    from tvm import tirx

    for gvar, func in mod.functions.items():
        if isinstance(func, tirx.PrimFunc) and "matmul" in gvar.name_hint:
            return func
    raise KeyError("module has no matmul function")


def legalize_fuse(mod: Any) -> Any:
    """LegalizeOps, FuseTransposeMatmul, AnnotateTIROpPattern, FuseOps, FuseTIR: a Relax module as fused PrimFuncs."""
    import tvm
    from tvm import relax

    passes = [
        relax.transform.LegalizeOps(),
        relax.transform.FuseTransposeMatmul(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
    ]
    return tvm.transform.Sequential(passes)(mod)


def rmsnorm_module(M: int | None, hidden: int = 576) -> Any:
    """RMSNorm over the last axis of [1, M, hidden] (FuseOps keeps a residual add separate)."""
    from tvm import relax, tirx

    m = tirx.Var("seq", "int64") if M is None else M
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1, m, hidden], "float32"))
    g = relax.Var("g", relax.TensorType([hidden], "float32"))
    with bb.function("main", [x, g]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.rms_norm(x, g, axes=[-1], epsilon=1e-5))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return legalize_fuse(bb.get())


def elementwise_module(M: int | None, width: int = 1536, op: str = "silu_mul") -> Any:
    """Injective ops of the model on [1, M, width]: "silu_mul", "gelu_tanh_mul" (GeGLU, decomposed as
    the ONNX emitter writes it), "add", or "take" (embedding)."""
    from tvm import relax, tirx

    m = tirx.Var("seq", "int64") if M is None else M
    bb = relax.BlockBuilder()
    if op == "take":
        emb = relax.Var("emb", relax.TensorType([4096, width], "float32"))
        ids = relax.Var("ids", relax.TensorType([1, m], "int32"))
        params = [emb, ids]
    else:
        a = relax.Var("a", relax.TensorType([1, m, width], "float32"))
        b = relax.Var("b", relax.TensorType([1, m, width], "float32"))
        params = [a, b]
    with bb.function("main", params):
        with bb.dataflow():
            if op == "take":
                y = bb.emit(relax.op.take(params[0], params[1], axis=0))
            elif op == "add":
                y = bb.emit(relax.op.add(params[0], params[1]))
            elif op == "gelu_tanh_mul":  # 0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3))) b
                a, c = params[0], (lambda v: relax.const(v, "float32"))
                inner = relax.op.add(a, relax.op.multiply(relax.op.multiply(relax.op.multiply(a, a), a), c(0.044715)))
                t = relax.op.tanh(relax.op.multiply(inner, c(0.7978845608028654)))
                gelu = relax.op.multiply(relax.op.multiply(a, c(0.5)), relax.op.add(t, c(1.0)))
                y = bb.emit(relax.op.multiply(gelu, params[1]))
            else:
                y = bb.emit(relax.op.multiply(relax.op.nn.silu(params[0]), params[1]))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return legalize_fuse(bb.get())


def single_func(mod: Any) -> Any:
    """The only PrimFunc of a module (helper for the one-op modules above)."""
    from tvm import tirx

    funcs = [f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc)]
    if len(funcs) != 1:
        raise ValueError(f"expected one PrimFunc, found {len(funcs)}")
    return funcs[0]
