"""GPU targets: no PrimFunc may be left without a device launch.

TVM compiles a PrimFunc that binds no GPU thread as *host* code; on a GPU target its buffers live
in device memory, so such a function would crash or read garbage at run time. Hand-scheduled CPU
kernels (``tirx.is_scheduled`` with ``T.parallel`` / ``T.vectorized`` loops, e.g. from graph
passes) are exactly that: no template touches them. :func:`bind_host_kernels` turns each of them
into a correct device kernel:

* a body whose top level is one loop marked parallel (independent iterations by contract) gets
  that loop bound to ``blockIdx.x`` (one block per iteration, one thread each);
* anything else runs whole on a single GPU thread (``blockIdx.x = threadIdx.x = 1``).

Vectorized and parallel loops inside become serial (WGSL has no 16-wide vectors). This is a
correctness net, not a fast path: such kernels should get GPU variants (or their pass should skip
GPU targets); :func:`adapted_note` names them in the build notes.
"""

from __future__ import annotations

from typing import Any

from perfx_compiler.errors import PerfXError


def has_device_launch(func: Any) -> bool:
    """True when ``func`` binds a GPU thread (thread-bound loop or a thread_extent attribute)."""
    import tvm_ffi
    from tvm import tirx

    found = False

    def visit_attr(node: Any) -> None:
        nonlocal found
        if node.attr_key == "thread_extent":
            found = True

    def visit_for(node: Any) -> None:
        nonlocal found
        if node.kind == tirx.ForKind.THREAD_BINDING:
            found = True

    tvm_ffi.structural_walk(func.body, [(tirx.AttrStmt, visit_attr), (tirx.For, visit_for)], order="post")
    return found


def _serialize_loops(stmt: Any) -> Any:
    import tvm_ffi
    from tvm import tirx

    def to_serial(node: Any) -> Any:
        if node.kind in (tirx.ForKind.PARALLEL, tirx.ForKind.VECTORIZED, tirx.ForKind.UNROLLED):
            return tirx.For(node.loop_var, node.min, node.extent, tirx.ForKind.SERIAL, node.body)
        return node

    return tvm_ffi.structural_map(stmt, (tirx.For, to_serial), order="post")


def _thread_loop(tag: str, extent: Any, body: Any, var: Any = None) -> Any:
    import tvm
    from tvm import tirx

    dtype = str(getattr(extent, "dtype", "int32"))
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
        one = tirx.const(1, str(body.extent.dtype))
        inner = _thread_loop("threadIdx.x", one, inner)
        new_body = _thread_loop("blockIdx.x", body.extent, inner, var=body.loop_var)
    else:
        inner = _serialize_loops(body)
        new_body = _thread_loop(
            "blockIdx.x", tirx.const(1, "int32"), _thread_loop("threadIdx.x", tirx.const(1, "int32"), inner)
        )
    return func.with_body(new_body)


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
