"""Run a compiled model's Relax function kernel by kernel through a launcher (OpenCL, WebGPU).

Without a TVM runtime for the device, the Relax VM cannot run the model; but after the schedule
phase every Relax function is a straight list of ``call_tir`` / ``call_tir_inplace`` calls on
PrimFuncs. :class:`RelaxKernelRunner` walks that list, allocates each output on the device
through the launcher, and runs each PrimFunc's device kernels with the launches TVM's host code
would make (``kernels.compile_primfunc``). Supported bindings: call_tir, call_tir_inplace, tuple,
tuple item, variable alias, constant.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from perfx_compiler.targets_exec.kernels import CompiledPrimFunc, compile_primfunc, evaluate


class RelaxKernelRunner:
    def __init__(self, mod: Any, target: Any, launcher: Any) -> None:
        self.mod = mod
        self.target = target  # tvm.target.Target with host
        self.launcher = launcher
        self._compiled: dict[str, CompiledPrimFunc] = {}

    def compiled(self, name: str) -> CompiledPrimFunc:
        if name not in self._compiled:
            self._compiled[name] = compile_primfunc(name, self.mod[name], self.target)
        return self._compiled[name]

    def _shape(self, ty: Any, env: dict[str, int]) -> tuple[tuple[int, ...], str]:
        return tuple(int(evaluate(d, env)) for d in ty.shape), str(ty.dtype)

    def _bind_shapes(self, params: list[Any], values: list[Any], env: dict[str, int]) -> None:
        from tvm import tirx

        for p, v in zip(params, values, strict=True):
            shape = getattr(p.ty, "shape", None)
            if shape is None:
                continue
            for d, n in zip(shape, v.shape, strict=True):
                if isinstance(d, tirx.Var):
                    env.setdefault(d.name, int(n))

    def run(self, fn_name: str, args: list[Any]) -> Any:
        """Run Relax function ``fn_name`` on device arrays ``args``; return its result (tuples as lists)."""
        import tvm
        from tvm import relax

        func = self.mod[fn_name]
        env: dict[str, int] = {}
        self._bind_shapes(list(func.params), args, env)
        values: dict[Any, Any] = dict(zip(func.params, args, strict=True))

        def get(expr: Any) -> Any:
            if isinstance(expr, relax.Var) and expr not in values and getattr(expr, "name", None) in env:
                return int(env[expr.name])  # a shape variable passed as a scalar (the last-token lm_head's seq)
            if isinstance(expr, relax.Var):
                return values[expr]
            if isinstance(expr, relax.Tuple):
                return [get(f) for f in expr.fields]
            if isinstance(expr, relax.TupleGetItem):
                return get(expr.tuple_value)[expr.index]
            if isinstance(expr, tvm.ir.Constant):
                return self.launcher.to_device(expr.value.numpy())
            raise NotImplementedError(f"relax_exec: unsupported expression {type(expr).__name__}")

        for block in func.body.blocks:
            for binding in block.bindings:
                values[binding.var] = self._eval(binding.value, get, env)
        return get(func.body.body)

    def _eval(self, value: Any, get: Any, env: dict[str, int]) -> Any:
        from tvm import relax

        if not isinstance(value, relax.Call):
            return get(value)
        op = getattr(value.op, "name", "")
        if op not in ("relax.call_tir", "relax.call_tir_inplace"):
            raise NotImplementedError(f"relax_exec: unsupported call {op}")
        gvar = value.args[0]
        ins = [get(a) for a in value.args[1].fields]
        tir_vars: list[int] = []
        if len(value.args) > 2:
            tir_vars = [int(evaluate(d, env)) for d in value.args[2].values]
        out_ty = value.ty
        out_tys = list(out_ty.fields) if isinstance(out_ty, relax.TupleType) else [out_ty]
        inplace = (
            [int(i) for i in value.attrs.inplace_indices] if op == "relax.call_tir_inplace" else [-1] * len(out_tys)
        )
        outs = []
        for ty, idx in zip(out_tys, inplace, strict=True):
            if idx >= 0:
                outs.append(ins[idx])
            else:
                shape, dtype = self._shape(ty, env)
                outs.append(self.launcher.empty(shape, dtype))
        extra = [o for o, idx in zip(outs, inplace, strict=True) if idx < 0]
        self.launcher.run(self.compiled(gvar.name_hint), [*ins, *extra, *tir_vars])
        return outs if isinstance(out_ty, relax.TupleType) else outs[0]


def upload_weights(launcher: Any, weights: dict[str, np.ndarray]) -> list[Any]:
    """Every weight on the device, in table order: the image weights of the Adreno texture path
    (``*__tex``, passes/texture_weights.py) as images, the others as buffers."""
    return [launcher.to_image(np.asarray(w)) if name.endswith("__tex") else launcher.to_device(np.asarray(w))
            for name, w in weights.items()]


def run_decode_steps(
    state: Any,
    launcher: Any,
    tokens: list[int],
    weights: dict[str, np.ndarray],
    runner: RelaxKernelRunner | None = None,
) -> list[np.ndarray]:
    """Run ``tokens`` one by one through ``decode`` from an empty cache; return the logits of every step.
    ``state`` is a pipeline state after the schedule phase; ``runner`` defaults to a
    :class:`RelaxKernelRunner` over ``launcher``."""
    from perfx_compiler.model.onnx_emit import cache_shape
    from perfx_compiler.targets import index_dtype_of

    cfg = state.desc.config
    index = np.dtype(index_dtype_of(state.target))  # int32 where the device has no 64-bit integers
    if runner is None:
        runner = RelaxKernelRunner(state.mod, state.target.tvm(), launcher)
    caches = [launcher.to_device(np.zeros(cache_shape(cfg), np.float32)) for _ in range(2 * cfg.num_layers)]
    dev_weights = upload_weights(launcher, weights)
    logits = []
    for pos, tok in enumerate(tokens):
        ids = launcher.to_device(np.array([[tok]], index))
        past = launcher.to_device(np.array([pos], index))
        out = runner.run("decode", [ids, past, *caches, *dev_weights])
        first = out[0] if isinstance(out, list) else out
        logits.append(launcher.to_host(first).reshape(-1))
    return logits


def run_paged_decode_steps(
    state: Any,
    launcher: Any,
    streams: list[list[int]],
    weights: dict[str, np.ndarray],
    runner: RelaxKernelRunner | None = None,
    seed: int = 0,
) -> list[np.ndarray]:
    """Batched serving's step: the token streams advance together through ``paged_decode`` (one call a
    step, one token per sequence) from empty pools, each sequence on its own randomly drawn pages;
    return the logits [len(streams), vocab] of every step."""
    from perfx_compiler.model.onnx_emit import pages_per_sequence, pool_shape
    from perfx_compiler.targets import index_dtype_of

    cfg = state.desc.config
    index = np.dtype(index_dtype_of(state.target))
    if runner is None:
        runner = RelaxKernelRunner(state.mod, state.target.tvm(), launcher)
    batch, npp = len(streams), pages_per_sequence(cfg)
    table = np.random.default_rng(seed).permutation(batch * npp).reshape(batch, npp).astype(index)
    pools = [launcher.to_device(np.zeros(pool_shape(cfg, batch * npp), np.float32)) for _ in range(2 * cfg.num_layers)]
    dev_weights = upload_weights(launcher, weights)
    logits = []
    for step in range(len(streams[0])):
        ids = launcher.to_device(np.array([[s[step]] for s in streams], index))
        pos = launcher.to_device(np.full(batch, step, index))
        out = runner.run("paged_decode", [ids, pos, launcher.to_device(table), *pools, *dev_weights])
        first = out[0] if isinstance(out, list) else out
        logits.append(launcher.to_host(first).reshape(batch, -1))
    return logits
