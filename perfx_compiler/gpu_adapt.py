"""GPU targets: no PrimFunc may be left without a device launch.

TVM compiles a PrimFunc that binds no GPU thread as *host* code; on a GPU target its buffers live
in device memory, so such a function would crash or read garbage at run time. Hand-scheduled CPU
kernels (``tirx.is_scheduled`` with ``T.parallel`` / ``T.vectorized`` loops, e.g. from graph
passes) are exactly that: no template touches them. :func:`bind_host_kernels` turns each of them
into a correct device kernel:

* a body whose top level is one loop marked parallel (independent iterations by contract) gets
  that loop bound to ``blockIdx.x`` (one block per iteration, one thread each);
* anything else runs whole on a single GPU thread (``blockIdx.x = threadIdx.x = 1``).

Kernels that have a GPU variant get it instead (:func:`gpu_variant`): the fused (add +) RMSNorm of
``kernels/rms_norm.py`` becomes ``kernels/rms_norm_gpu.py`` (one block per row, tree reduction).

Vectorized and parallel loops inside become serial (WGSL has no 16-wide vectors). This is a
correctness net, not a fast path: such kernels should get GPU variants (or their pass should skip
GPU targets); :func:`adapted_note` names them in the build notes.
"""

from __future__ import annotations

from typing import Any

from perfx_compiler.errors import PerfXError
from perfx_compiler.kernels.tir_queries import has_device_launch


def _serialize_loops(stmt: Any) -> Any:
    import tvm_ffi
    from tvm import tirx

    def to_serial(node: Any) -> Any:
        if node.kind in (tirx.ForKind.PARALLEL, tirx.ForKind.VECTORIZED, tirx.ForKind.UNROLLED):
            return tirx.For(node.loop_var, node.min, node.extent, tirx.ForKind.SERIAL, node.body)
        return node

    return tvm_ffi.structural_map(stmt, (tirx.For, to_serial), order="post")


def _expr_dtype(x: Any) -> str:
    """dtype of a TIR integer expression (TVM 0.27 keeps it in ``ty``), int32 when unknown."""
    dt = getattr(getattr(x, "ty", None), "dtype", None) or getattr(x, "dtype", None)
    return str(dt) if dt is not None else "int32"


def _thread_loop(tag: str, extent: Any, body: Any, var: Any = None) -> Any:
    import tvm
    from tvm import tirx

    dtype = _expr_dtype(extent)
    if var is None:
        var = tirx.Var(tag.replace(".", "_"), dtype)
    iv = tirx.IterVar(tvm.ir.Range.from_min_extent(tirx.const(0, dtype), extent), var, 1, tag)
    return tirx.For(var, tirx.const(0, dtype), extent, tirx.ForKind.THREAD_BINDING, body, thread_binding=iv)


def bind_to_device(func: Any) -> Any:
    """The same computation as ``func`` with a device launch (see the module docstring)."""
    from tvm import tirx

    body = func.body
    if isinstance(body, tirx.For) and body.kind == tirx.ForKind.PARALLEL:
        inner = _serialize_loops(body.body)
        one = tirx.const(1, _expr_dtype(body.extent))
        inner = _thread_loop("threadIdx.x", one, inner)
        new_body = _thread_loop("blockIdx.x", body.extent, inner, var=body.loop_var)
    else:
        inner = _serialize_loops(body)
        new_body = _thread_loop(
            "blockIdx.x", tirx.const(1, "int32"), _thread_loop("threadIdx.x", tirx.const(1, "int32"), inner)
        )
    return func.with_body(new_body)


def _rms_norm_params(func: Any) -> tuple[int, float, bool] | None:
    """(hidden, eps, residual) of a CPU RMSNorm kernel from ``kernels/rms_norm.py``, else None.

    Recognised by its signature ((a, w, out) or (a, b, w, s, out), rank-3 float32 rows of H and a
    1-D weight of H) and the ``sqrt(sum * (1/H) + eps)`` it computes, whence eps."""
    import tvm
    import tvm_ffi
    from tvm import tirx
    from tvm.tirx.buffer import BufferType

    params = [p.ty for p in func.params if isinstance(getattr(p, "ty", None), BufferType)]  # 0.27: typed Vars
    if len(params) not in (3, 5) or len(params) != len(func.params):
        return None
    iw = len(params) - 3 if len(params) == 5 else 1
    w = params[iw]
    if len(w.shape) != 1 or not isinstance(w.shape[0], tirx.IntImm) or any(str(b.dtype) != "float32" for b in params):
        return None
    hidden = int(w.shape[0])
    rows = [list(b.shape) for i, b in enumerate(params) if i != iw]
    if any(len(sh) != 3 or not isinstance(sh[2], tirx.IntImm) or int(sh[2]) != hidden for sh in rows):
        return None
    found: list[float] = []

    def on_call(node: Any) -> None:
        if getattr(node.op, "name", "") != "tirx.sqrt" or not node.args:
            return
        arg = node.args[0]
        if isinstance(arg, tirx.Add) and isinstance(arg.b, tirx.FloatImm) and isinstance(arg.a, tirx.Mul):
            if isinstance(arg.a.b, tirx.FloatImm) and abs(float(arg.a.b.value) * hidden - 1.0) < 1e-6:
                found.append(float(arg.b.value))

    tvm_ffi.structural_walk(func.body, [(tvm.ir.Call, on_call)], order="post")
    if len(found) != 1:
        return None
    return hidden, found[0], len(params) == 5


def gpu_variant(name: str, func: Any, target: Any) -> Any | None:
    """A real GPU kernel for a hand-scheduled CPU kernel, or None when there is none (yet)."""
    if not (name.startswith("rms_norm") or name.startswith("add_rms_norm")):
        return None
    found = _rms_norm_params(func)
    if found is None:
        return None
    from perfx_compiler.kernels.rms_norm_gpu import rms_norm_kernel_gpu, rms_norm_threads
    from schedules._gpu import max_threads

    hidden, eps, residual = found
    kernel = rms_norm_kernel_gpu(hidden, eps, residual, rms_norm_threads(hidden, max_threads(target)))
    attrs = func.attrs
    return kernel.with_attr("global_symbol", attrs["global_symbol"]) if attrs and "global_symbol" in attrs else kernel


def bind_host_kernels(mod: Any, target: Any) -> tuple[Any, list[str]]:
    """For a GPU target: give every PrimFunc without a device launch one; return (module, adapted names)."""
    from tvm import tirx

    if target.family != "gpu":
        return mod, []
    adapted: list[str] = []
    updates = {}
    for gvar, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc) or has_device_launch(func):
            continue
        variant = gpu_variant(gvar.name_hint, func, target)
        if variant is not None:
            updates[gvar] = variant
            continue
        try:
            updates[gvar] = bind_to_device(func)
        except Exception as err:  # noqa: BLE001 - report which function, not a TVM trace
            raise PerfXError(
                f"internal: PrimFunc {gvar.name_hint} has no GPU schedule and could not be moved to the device "
                f"for target {target.name}: {type(err).__name__}: {err}"
            ) from err
        adapted.append(gvar.name_hint)
    if not updates:
        return mod, []
    mod = mod.clone()
    for gvar, func in updates.items():
        mod.update_func(gvar, func)
    return mod, adapted


def adapted_note(names: list[str]) -> str:
    if not names:
        return ""
    return (
        f"{len(names)} hand-scheduled CPU kernel(s) run as single-thread/one-block-per-row GPU kernels "
        f"(no GPU variant yet): {', '.join(sorted(names))}"
    )
