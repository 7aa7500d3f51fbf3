"""Narrow every 64-bit integer of the model's PrimFuncs to int32, for targets without i64 (WebGPU/WGSL).

Relax legalizes shapes as int64 and PerfX's kernels index in int64. TVM's
``ForceNarrowIndexToInt32`` narrows buffer shapes, loop variables and index expressions, but leaves
let-bound variables (``b = bks // seq`` in a kernel), the casts that feed them and the ``if``/
``select`` arithmetic around them in int64; WebGPU's device pipeline then turns those lets into
int64 local variables and its codegen rejects them. :func:`narrow_to_int32` runs TVM's pass and then
rewrites what it left: every int64 variable becomes an int32 one, int64 constants become int32
(they must fit), ``Cast(int64, x)`` of an int32 ``x`` disappears and every arithmetic node is rebuilt
from its narrowed operands. Before TVM's pass, int64 buffers a kernel allocates itself (local scratch,
e.g. each row's query position in the tiled CPU attention) become int32 (TVM's pass refuses them).
Tensor parameters of int64 *elements* are not touched (the graph's integer inputs are int32 on such
targets: ``"index_dtype": "int32"``; quantized kernels read int8 codes as uint32 words there,
``formats/int8.py``); :func:`remaining_int64` reports any that is left so the build can say which
kernel is at fault, and 8/16-bit integer tensors are refused the same way.

Host (Relax) functions keep int64 shapes: the VM passes them into the narrowed PrimFuncs as it does
for any int32 shape variable.
"""

from __future__ import annotations

from typing import Any

I32_MAX = 2**31 - 1


def _dtype(x: Any) -> str:
    """dtype of a TIR expression (TVM 0.27 keeps it in ``ty``; non-PrimType types give "")."""
    ty = getattr(x, "ty", None)
    if ty is None:
        return ""
    dt = getattr(ty, "dtype", None)
    return str(dt) if dt is not None else ""


def _is_buffer(v: Any) -> bool:
    from tvm.tirx.buffer import BufferType

    return isinstance(getattr(v, "ty", None), BufferType)


def _map(body: Any, callbacks: list[tuple[Any, Any]]) -> Any:
    """``tvm_ffi.structural_map`` in post order, with no exception crossing it: in apache-tvm-ffi 0.1.14 an
    exception raised by a callback after a variable has been remapped corrupts the heap ("malloc():
    unaligned tcache chunk detected", sometimes only later, at run time). The first error is re-raised
    once the map has returned."""
    import tvm_ffi

    errors: list[BaseException] = []

    def guard(fn: Any) -> Any:
        def call(x: Any) -> Any:
            if errors:
                return x
            try:
                return fn(x)
            except Exception as err:  # re-raised below, outside the C++ traversal
                errors.append(err)
                return x

        return call

    out = tvm_ffi.structural_map(body, [(ty, guard(fn)) for ty, fn in callbacks], order="post")
    if errors:
        raise errors[0]
    return out


def _narrow_func(func: Any) -> Any:
    import tvm
    from tvm import tirx

    var_map: dict[Any, Any] = {}

    def is_i64(x: Any) -> bool:
        return not _is_buffer(x) and _dtype(x) == "int64"

    def on_var(v: Any) -> Any:
        if _is_buffer(v):
            # scalar lets are 1-element local buffers in TVM 0.27: int64 ones become int32
            if _dtype(v) != "int64" or v.scope() not in ("local", ""):
                return v
            new = var_map.get(v)
            if new is None:
                new = v.with_dtype("int32")
                var_map[v] = new
            return new
        if not is_i64(v):
            return v
        new = var_map.get(v)
        if new is None:
            new = tirx.Var(v.name, "int32")
            var_map[v] = new
        return new

    def on_int(x: Any) -> Any:
        if _dtype(x) != "int64":
            return x
        if not -I32_MAX - 1 <= int(x.value) <= I32_MAX:
            raise ValueError(f"int64 constant {x.value} does not fit in int32")
        return tirx.IntImm("int32", int(x.value))

    def to_i32(x: Any) -> Any:
        return tirx.Cast("int32", x) if _dtype(x) == "int64" else x

    def on_cast(x: Any) -> Any:
        value = x.value
        if _dtype(x) == "int64":
            return value if _dtype(value) == "int32" else tirx.Cast("int32", value)
        if _dtype(x) == _dtype(value):
            return value
        return tirx.Cast(_dtype(x), value)

    binary = (
        tirx.Add, tirx.Sub, tirx.Mul, tirx.Div, tirx.Mod, tirx.FloorDiv, tirx.FloorMod, tirx.Min, tirx.Max,
        tirx.EQ, tirx.NE, tirx.LT, tirx.LE, tirx.GT, tirx.GE,
    )  # fmt: skip

    def on_binary(x: Any) -> Any:
        a, b = x.a, x.b
        if _dtype(a) == _dtype(b) and not is_i64(x):
            return x
        if _dtype(a) != _dtype(b):  # one side narrowed, the other an int64 load TVM left: narrow it too
            a, b = to_i32(a), to_i32(b)
        return type(x)(a, b)

    def on_select(x: Any) -> Any:
        if not is_i64(x) and _dtype(x.true_value) == _dtype(x.false_value):
            return x
        return tirx.Select(x.condition, to_i32(x.true_value), to_i32(x.false_value))

    def on_let(x: Any) -> Any:
        return tirx.Let(x.var, x.value, x.body) if is_i64(x) else x

    def on_call(x: Any) -> Any:
        if not is_i64(x):
            return x
        args = list(x.args)
        if getattr(x.op, "name", "") == "tirx.if_then_else":
            args = [args[0], to_i32(args[1]), to_i32(args[2])]
        return tvm.ir.Call(x.op, args, attrs=x.attrs, ty_args=list(x.ty_args) or None, ret_ty="int32")

    def on_load(x: Any) -> Any:
        buf = x.source if hasattr(x, "source") else x.buffer
        if _dtype(x) == _dtype(buf):
            return x
        return tirx.BufferLoad(buf, list(x.indices))

    def on_store(x: Any) -> Any:
        if _dtype(x.buffer) == "int32" and _dtype(x.value) == "int64":
            return tirx.BufferStore(x.buffer, tirx.Cast("int32", x.value), list(x.indices))
        return x

    callbacks = [
        (tirx.Var, on_var),
        (tirx.IntImm, on_int),
        (tirx.Cast, on_cast),
        (binary, on_binary),
        (tirx.Select, on_select),
        (tirx.Let, on_let),
        (tvm.ir.TensorLoad, on_load),
        (tirx.BufferStore, on_store),
        (tvm.ir.Call, on_call),
    ]
    body = _map(func.body, callbacks)
    return func.with_body(body)


def _narrow_local_buffers(func: Any) -> Any:
    """int64-element buffers a kernel allocates itself (scope "local" or ""), made int32 before TVM's
    pass, which refuses them: stores into them are cast to int32 and loads from them are read back
    through ``Cast(int64, ...)``, so every expression around them keeps its type; :func:`_narrow_func`
    drops those casts afterwards. Only allocations are touched (a parameter's dtype is the caller's)."""
    import tvm
    import tvm_ffi
    from tvm import tirx

    local: dict[Any, Any] = {}

    def on_alloc(stmt: Any) -> None:
        buf = stmt.buffer
        if _dtype(buf) == "int64" and buf.scope() in ("local", ""):
            local[buf] = buf.with_dtype("int32")

    tvm_ffi.structural_walk(func.body, [(tirx.AllocBuffer, on_alloc)], order="pre")
    if not local:
        return func

    def on_var(v: Any) -> Any:
        return local.get(v, v)

    def on_load(x: Any) -> Any:
        buf = x.source if hasattr(x, "source") else x.buffer
        if _dtype(buf) != "int32" or buf not in local.values() or _dtype(x) == "int32":
            return x
        return tirx.Cast("int64", tirx.BufferLoad(buf, list(x.indices)))

    def on_store(x: Any) -> Any:
        if x.buffer in local.values() and _dtype(x.value) != "int32":
            return tirx.BufferStore(x.buffer, tirx.Cast("int32", x.value), list(x.indices))
        return x

    body = _map(func.body, [(tirx.Var, on_var), (tvm.ir.TensorLoad, on_load), (tirx.BufferStore, on_store)])
    return func.with_body(body)


def remaining_int64(func: Any) -> list[str]:
    """Descriptions of int64 scalars or int64-element buffers still in ``func`` (empty when clean)."""
    import tvm
    import tvm_ffi
    from tvm import tirx

    found: list[str] = []

    def on_expr(x: Any) -> None:
        if _dtype(x) == "int64" and len(found) < 5:
            found.append(f"{type(x).__name__}: {x}")

    def on_var(v: Any) -> None:
        if _dtype(v) == "int64" and len(found) < 5:
            found.append(f"{'buffer' if _is_buffer(v) else 'Var'} {v.name}")

    tvm_ffi.structural_walk(
        func.body,
        [(tirx.Var, on_var), ((tirx.IntImm, tirx.Cast, tirx.Add, tirx.Mul, tvm.ir.TensorLoad, tvm.ir.Call), on_expr)],
        order="post",
    )
    return found


def mismatched_stores(func: Any) -> list[str]:
    """Stores whose value's element type is not the buffer's (at most 5). Nothing checks this when a
    BufferStore is rebuilt by a structural map, and codegen would write the value's width: an int64
    value stored into an int32 buffer writes 8 bytes into a 4-byte element."""
    import tvm_ffi
    from tvm import tirx

    found: list[str] = []

    def on_store(x: Any) -> None:
        value, buf = _dtype(x.value).split("x")[0], _dtype(x.buffer)
        if value and buf and value != buf and len(found) < 5:
            found.append(f"{x.buffer.name}[...] = <{_dtype(x.value)}>")

    tvm_ffi.structural_walk(func.body, [(tirx.BufferStore, on_store)], order="post")
    return found


def narrow_to_int32(mod: Any) -> Any:
    """``mod`` with every PrimFunc narrowed to int32 indices and scalars (see the module docstring)."""
    from tvm import tirx

    from perfx_compiler.errors import PerfXError

    for gv, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        wide = [p.name for p in func.params if _is_buffer(p) and _dtype(p) in ("int64", "uint64")]
        if wide:
            raise PerfXError(
                f"kernel {gv.name_hint} takes 64-bit integer tensor(s) {', '.join(wide)}, which this target cannot "
                "hold (index_dtype int32: WGSL has no 64-bit integers); the pass that made it must follow the "
                "graph's index dtype"
            )
        narrow = [p.name for p in func.params if _is_buffer(p) and _dtype(p) in ("int8", "uint8", "int16", "uint16")]
        if narrow:
            raise PerfXError(
                f"kernel {gv.name_hint} takes 8/16-bit integer tensor(s) {', '.join(narrow)}, which WGSL cannot hold "
                "(no 8/16-bit integer types); the pass that made it must store them as uint32 words"
            )
    pre = {gv: _narrow_local_buffers(f) for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)}
    pre = {gv: f for gv, f in pre.items() if not f.same_as(mod[gv])}
    if pre:
        mod = mod.clone()
        for gv, func in pre.items():
            mod.update_func(gv, func)
    mod = tirx.transform.ForceNarrowIndexToInt32()(mod)
    updates = {}
    for gv, func in mod.functions.items():
        if isinstance(func, tirx.PrimFunc):
            updates[gv] = _narrow_func(func)
    for gv, func in updates.items():
        bad = mismatched_stores(func)
        if bad:
            raise PerfXError(f"int32 narrowing left kernel {gv.name_hint} storing values of the wrong width: {bad}")
    if not updates:
        return mod
    mod = mod.clone()
    for gv, func in updates.items():
        mod.update_func(gv, func)
    return mod
