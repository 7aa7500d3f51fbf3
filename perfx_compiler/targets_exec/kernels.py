"""Device kernels of one scheduled PrimFunc, with the launches its host code would make.

TVM's build splits a scheduled PrimFunc into a host function and device kernels; the host function
calls ``T.call_ffi_kernel("<kernel>", args..., extents..., launch_params=[...])``. Runtimes for
OpenCL, WebGPU and ROCm are not in the PyPI wheel, so the launchers of ``perfx_compiler.targets_exec``
replay those calls themselves: :func:`compile_primfunc` builds the device source and records every
launch (kernel name, argument expressions, grid/block extents, host ``let`` bindings), and
:meth:`CompiledPrimFunc.plan` evaluates them for concrete argument shapes. Kernel arguments come in
the device kernel's parameter order (sorted by name): buffers are identified by their data
variable, scalars are evaluated host expressions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from perfx_compiler.device_export import dedup_opencl
from perfx_compiler.kernels.tir_queries import buffer_type, has_texture_params


@dataclass
class LaunchSpec:
    kernel: str
    args: list[Any]  # TIR expressions (buffer data vars or scalar expressions)
    extents: list[Any]  # TIR expressions, one per launch param
    params: list[str]  # launch param tags ("blockIdx.x", ..., "tirx.use_dyn_shared_memory")


@dataclass
class BoundLaunch:
    """One concrete launch: ``args`` items are ("buffer", param index) or ("scalar", value, dtype)."""

    kernel: str
    args: list[tuple]
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    dyn_shared_bytes: int = 0


@dataclass
class CompiledPrimFunc:
    name: str
    func: Any  # the scheduled tirx.PrimFunc
    target: Any  # tvm.target.Target
    source: str  # device source of every kernel (OpenCL C, CUDA C, WGSL, AMDGPU asm)
    kernels: list[str]
    launches: list[LaunchSpec]
    lets: list[tuple[str, Any]]  # host let bindings in program order (name, value expression)
    aliases: dict[str, str] = field(default_factory=dict)  # host buffer declared over another's data
    host_only: bool = False  # no device kernel at all (a bug for a GPU target)
    runtime_module: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def param_info(self) -> list[tuple[str, tuple | None, str]]:
        """(name, shape expressions or None for scalars, dtype) per PrimFunc parameter."""
        return func_param_info(self.func)

    def bind_env(self, values: list[Any]) -> dict[str, int]:
        """Shape variables and scalar parameters, from the call's arrays (anything with .shape) and scalars."""
        env: dict[str, int] = {}
        for p, v in zip(self.func.params, values, strict=False):
            ty = buffer_type(p)
            if ty is None:
                env[p.name] = int(v)
                continue
            for dim, n in zip(ty.shape, v.shape, strict=False):
                if isinstance(dim, _tir().Var):
                    env.setdefault(dim.name, int(n))
        return env

    def plan(self, values: list[Any]) -> list[BoundLaunch]:
        """Evaluate every launch for these arguments (arrays by shape, scalars by value)."""
        env = self.bind_env(values)
        for name, expr in self.lets:
            try:
                env[name] = evaluate(expr, env)
            except KeyError:
                continue
        data_index = {p.name: i for i, p in enumerate(self.func.params) if buffer_type(p) is not None}
        out = []
        for spec in self.launches:
            args: list[tuple] = []
            for a in spec.args:
                base = _buffer_name(a)
                if base is not None:
                    seen = set()
                    while base not in data_index and base in self.aliases and base not in seen:
                        seen.add(base)
                        base = self.aliases[base]
                    if base not in data_index:
                        raise KeyError(f"{self.name}: kernel {spec.kernel} buffer {base} is not a parameter")
                    args.append(("buffer", data_index[base]))
                else:
                    args.append(("scalar", evaluate(a, env), expr_dtype(a)))
            grid, block, shmem = [1, 1, 1], [1, 1, 1], 0
            for tag, ext in zip(spec.params, spec.extents, strict=True):
                value = int(evaluate(ext, env))
                if tag.startswith("blockIdx."):
                    grid["xyz".index(tag[-1])] = value
                elif tag.startswith("threadIdx."):
                    block["xyz".index(tag[-1])] = value
                elif "dyn_shared" in tag:
                    shmem = value
            out.append(BoundLaunch(spec.kernel, args, tuple(grid), tuple(block), shmem))
        return out


def func_param_info(func: Any) -> list[tuple[str, tuple | None, str]]:
    """(name, shape expressions or None for scalars, dtype) per parameter of a PrimFunc."""
    out = []
    for p in func.params:
        ty = buffer_type(p)
        if ty is None:
            out.append((p.name, None, expr_dtype(p)))
        else:
            out.append((p.name, tuple(ty.shape), str(ty.dtype)))
    return out


def expr_dtype(expr: Any) -> str:
    """dtype of a scalar TIR expression (a Var carries it in its PrimType)."""
    ty = getattr(expr, "ty", None)
    if ty is not None and hasattr(ty, "dtype"):
        return str(ty.dtype)
    return str(expr.dtype)


def _buffer_name(expr: Any) -> str | None:
    """Name of the buffer whose data pointer ``expr`` is (``tirx.buffer_data(buf)`` or a handle Var)."""
    import tvm

    if isinstance(expr, tvm.ir.Call) and getattr(expr.op, "name", "") == "tirx.buffer_data":
        return expr.args[0].name
    if isinstance(expr, _tir().Var) and "handle" in str(getattr(expr, "ty", "")):
        return expr.name
    return None


def _tir():
    from tvm import tirx

    return tirx


def evaluate(expr: Any, env: dict[str, Any]) -> Any:
    """Evaluate an integer/float TIR expression with variables taken by name from ``env``."""
    import tvm

    t = _tir()
    if isinstance(expr, (int, float)):
        return expr
    if isinstance(expr, t.IntImm):
        return int(expr.value)
    if isinstance(expr, t.FloatImm):
        return float(expr.value)
    if isinstance(expr, t.Var):
        if expr.name not in env:
            raise KeyError(expr.name)
        return env[expr.name]
    binary = {
        t.Add: lambda a, b: a + b,
        t.Sub: lambda a, b: a - b,
        t.Mul: lambda a, b: a * b,
        t.FloorDiv: lambda a, b: a // b,
        t.FloorMod: lambda a, b: a % b,
        t.Div: lambda a, b: math.trunc(a / b) if isinstance(a, int) and isinstance(b, int) else a / b,
        t.Mod: lambda a, b: int(math.fmod(a, b)),
        t.Min: min,
        t.Max: max,
        t.EQ: lambda a, b: a == b,
        t.NE: lambda a, b: a != b,
        t.LT: lambda a, b: a < b,
        t.LE: lambda a, b: a <= b,
        t.GT: lambda a, b: a > b,
        t.GE: lambda a, b: a >= b,
        t.And: lambda a, b: bool(a) and bool(b),
        t.Or: lambda a, b: bool(a) or bool(b),
    }
    for cls, fn in binary.items():
        if isinstance(expr, cls):
            return fn(evaluate(expr.a, env), evaluate(expr.b, env))
    if isinstance(expr, t.Not):
        return not evaluate(expr.a, env)
    if isinstance(expr, t.Cast):
        v = evaluate(expr.value, env)
        return float(v) if "float" in expr_dtype(expr) else int(v)
    if isinstance(expr, t.Select):
        return evaluate(expr.true_value if evaluate(expr.condition, env) else expr.false_value, env)
    if isinstance(expr, tvm.ir.Call) and getattr(expr.op, "name", "") == "tirx.if_then_else":
        c, a, b = expr.args
        return evaluate(a if evaluate(c, env) else b, env)
    raise KeyError(f"cannot evaluate {type(expr).__name__}: {expr}")


def _collect_host(host_mod: Any) -> tuple[list[tuple[str, Any]], list[LaunchSpec], dict[str, str]]:
    import tvm
    import tvm_ffi

    t = _tir()
    lets: list[tuple[str, Any]] = []
    launches: list[LaunchSpec] = []
    op = tvm.ir.Op.get("tirx.call_ffi_kernel")

    aliases: dict[str, str] = {}

    def on_let(node: Any) -> None:
        lets.append((node.var.name, node.value))

    def on_decl(node: Any) -> None:
        data = getattr(node, "data", None)  # TVM 0.27: DeclBuffer(buffer, data=<the buffer it views>)
        base = _buffer_name(data if data is not None else node.buffer.data)
        if base is not None and base != node.buffer.name:
            aliases[node.buffer.name] = base

    def on_call(node: Any) -> None:
        if not node.op.same_as(op):
            return
        name = str(node.args[0].value)
        params = [str(p) for p in node.attrs.launch_params] if hasattr(node.attrs, "launch_params") else []
        rest = list(node.args[1:])
        n_ext = len(params)
        launches.append(LaunchSpec(name, rest[: len(rest) - n_ext], rest[len(rest) - n_ext :], params))

    for _, func in host_mod.functions.items():
        if isinstance(func, t.PrimFunc):
            tvm_ffi.structural_walk(
                func.body, [(t.LetStmt, on_let), (t.DeclBuffer, on_decl), (tvm.ir.Call, on_call)], order="pre"
            )
    return lets, launches, aliases


def compile_primfunc(
    name: str, func: Any, target: Any, build_runtime: bool = True, pipeline: tuple[Any, Any, Any] | None = None
) -> CompiledPrimFunc:
    """Lower one scheduled PrimFunc for ``target`` (a tvm Target with host) and record its launches.

    ``pipeline``: (pipeline, finalize_host, finalize_device) passes; TVM's s_tir pipeline by default
    (``kernels.gemv_texture.adreno_tir_pipeline`` for Adreno textures)."""
    import tvm
    from tvm.tirx.build import codegen_build, split_host_device_mods

    func = func.with_attr("global_symbol", "main")
    mod = tvm.IRModule({"main": func})
    host = target.host if target.host is not None else tvm.target.Target("llvm")
    mod = tvm.tirx.transform.BindTarget(target.with_host(host))(mod)
    if pipeline is None and has_texture_params(func):
        from perfx_compiler.kernels.gemv_texture import adreno_tir_pipeline

        pipeline = adreno_tir_pipeline()  # image parameters need TextureFlatten
    pipeline, finalize_host, finalize_device = pipeline or tvm.tirx.get_tir_pipeline("s_tir")
    with target:
        mod = pipeline(mod)
        host_mod, device_mods = split_host_device_mods(mod)
    lets, launches, aliases = _collect_host(host_mod)
    kernels: list[str] = []
    source_parts: list[str] = []
    runtime = None
    dev_mod_final = None
    for dev_target, dev_mod in device_mods.items():
        if len(dev_mod.functions) == 0:
            continue
        dev_mod_final = finalize_device()(dev_mod)
        kernels += [g.name_hint for g in dev_mod_final.functions]
        if build_runtime:
            with dev_target:
                runtime = codegen_build(dev_mod_final, dev_target)
            source_parts.append(_device_source(runtime))
    return CompiledPrimFunc(
        name=name,
        func=func,
        target=target,
        source="\n".join(source_parts),
        kernels=kernels,
        launches=launches,
        lets=lets,
        aliases=aliases,
        host_only=not launches,
        runtime_module=runtime,
        extra={"device_mod": dev_mod_final},
    )


def _device_source(module: Any) -> str:
    kind = module.kind
    if kind == "rocm":
        return module.inspect_source("asm")
    src = module.inspect_source()
    if kind == "opencl":
        return dedup_opencl(src)
    return src


def random_inputs(cf: CompiledPrimFunc, sizes: dict[str, int], seed: int = 0) -> list[Any]:
    """Random arguments for ``cf`` (see :func:`random_args`)."""
    return random_args(cf.func, sizes, seed)


def random_args(func: Any, sizes: dict[str, int], seed: int = 0) -> list[Any]:
    """Random arguments for PrimFunc ``func``: shape variables from ``sizes`` (name -> value), int buffers
    small non-negative values (indices), floats standard normal; scalars from ``sizes``."""
    rng = np.random.default_rng(seed)
    out: list[Any] = []
    for name, shape, dtype in func_param_info(func):
        if shape is None:
            out.append(int(sizes.get(name, 1)))
            continue
        dims = [int(evaluate(d, sizes)) for d in shape]
        if dtype.startswith("int") or dtype.startswith("uint"):
            out.append(np.asarray(rng.integers(0, 4, size=dims), dtype=dtype))  # 0-d stays an ndarray
        else:
            out.append(np.asarray(rng.standard_normal(dims), dtype=dtype))
    return out
