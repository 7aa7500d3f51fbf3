"""Matmul-input precision (``--precision f32 | bf16 | f16 | fp8``, ``CompileOptions.precision``).

Per-operator policy: only the inputs of linear layers (matmuls against weights) are rounded to
the chosen format, and the weights are stored in it (quantization ``bf16`` / ``f16``); norms,
softmax, RoPE, attention, residual adds and every accumulation stay fp32.

* decode (few static rows): the half-weight GEMV rounds x itself (``formats/half.py``);
* prefill (rows symbolic): this pass inserts one rounding kernel before each such linear, whose
  dequantize + float GEMM then multiplies rounded inputs by the widened weights.

Which target may use which format is decided by :func:`resolve_precision` (one-line errors).
"""

from __future__ import annotations

from typing import Any

import tvm
from tvm import relax

from perfx_compiler.errors import PerfXError
from perfx_compiler.formats.half import half_compute
from perfx_compiler.passes._quantized_linears import GEMV_MAX_ROWS, static_dim
from perfx_compiler.passes._relax_util import exported, find_linears, rewrite_functions

NAME = "precision"
PRECISIONS = ("f32", "bf16", "f16", "fp8")
GPU_KINDS = ("cuda", "rocm", "opencl", "vulkan", "webgpu", "metal")


def _mattr(target: Any) -> list[str]:
    return [str(a) for a in (getattr(target, "tvm_target", None) or {}).get("mattr", []) or []]


def _arch(target: Any) -> str:
    return str((getattr(target, "tvm_target", None) or {}).get("arch", ""))


def resolve_precision(precision: str | None, quantization: str, target: Any) -> tuple[str, str]:
    """(precision, quantization) after checking ``precision`` against ``target``; ``auto``
    quantization becomes the precision's weight format. One-line PerfXError for a bad combination."""
    p = str(precision or "f32")
    if p not in PRECISIONS:
        raise PerfXError(f"unknown precision '{p}'; use one of {', '.join(PRECISIONS)}")
    if p == "f32":
        return p, quantization
    name = getattr(target, "name", "?")
    kind = str((getattr(target, "tvm_target", None) or {}).get("kind", ""))
    gpu = getattr(target, "family", "") == "gpu" or kind in GPU_KINDS
    if p == "fp8":
        if kind == "cuda" and _arch(target).startswith("sm_9"):
            raise PerfXError(f"precision fp8 (e4m3) on {name} is not implemented yet; use f16 or bf16")
        raise PerfXError(f"precision fp8 needs a target with fp8 (e4m3) matmuls (cuda-sm90); {name} has none")
    if not gpu:
        if p == "bf16" and "+avx512bf16" not in _mattr(target):
            raise PerfXError(f"precision bf16 needs AVX-512 BF16 on a CPU target (x86-avx512); {name} has no avx512bf16")
        if p == "f16" and "+avx512fp16" not in _mattr(target):
            raise PerfXError(f"precision f16 needs AVX-512 FP16 on a CPU target; {name} has no avx512fp16 (use bf16)")
    if quantization in ("auto", "", None):
        return p, p
    if quantization != p:
        raise PerfXError(
            f"precision {p} multiplies {p} weights by {p} inputs: use --quantization {p} (or auto), "
            f"not {quantization}"
        )
    return p, quantization


def apply(mod: tvm.IRModule, weights: dict[str, Any], ctx: Any) -> tuple[tvm.IRModule, dict[str, Any]]:
    act = getattr(ctx.options, "precision", "f32") or "f32"
    if act not in ("bf16", "f16"):
        return mod, weights
    kernels: dict[str, Any] = {}
    todo: dict[str, list[Any]] = {}
    for fn in exported(mod):
        lins = []
        for lin in find_linears(_info(mod[fn])):
            rows = [static_dim(lin.x, 0), static_dim(lin.x, 1)]
            if None not in rows and rows[0] * rows[1] <= GEMV_MAX_ROWS:
                continue  # the GEMV rounds its input itself
            k = int(lin.x.ty.shape.values[-1])
            key = f"round_{act}_{k}"
            kernels.setdefault(key, half_compute(1, k, "f16", kind="round", rows=(None, None), act=act))
            lins.append((lin, key))
        todo[fn] = lins

    def plan_for(fn: str, func: relax.Function, info: Any, gvars: dict[str, Any]) -> dict[Any, Any]:
        plan: dict[Any, Any] = {}
        for lin, key in todo.get(fn, []):

            def rounded(rw: Any, binding: Any, lin=lin, key=key) -> None:
                x = rw.arg(lin.x)
                xr = rw.emit(relax.call_tir(gvars[key], [x], relax.TensorType(lin.x.ty.shape, "float32")))
                y = rw.emit(relax.op.matmul(xr, rw.arg(lin.permute)), binding.var)
                rw.remap(binding.var, y)

            plan[lin.matmul] = rounded
        return plan

    if not any(todo.values()):
        return mod, weights
    mod, _ = rewrite_functions(mod, plan_for, kernels)
    return mod, weights


def _info(func: relax.Function) -> Any:
    from perfx_compiler.passes._relax_util import FuncInfo

    return FuncInfo.of(func)
