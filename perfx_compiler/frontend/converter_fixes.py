"""Project-side overrides of TVM ONNX converters that break on dynamic-sequence LLM graphs.

``torch.onnx.export(dynamo=True)`` of a transformers decoder with a dynamic sequence axis
emits three patterns TVM 0.27's Relax frontend mishandles (see shared notes):

* ``Reshape`` of a scalar symbolic value (``Squeeze(Shape(x))`` is imported as a PrimExpr,
  which ``relax.op.reshape`` rejects) -> return a ``ShapeExpr``.
* ``Expand`` of an input with symbolic dims to a constant shape (the converter reads
  ``dim.value`` of every input dim) -> broadcast with the symbolic dims kept.
* ``Range(0, seq, 1)`` goes through ``tensor_to_shape`` and yields a fresh length variable,
  so later broadcasts against ``seq``-shaped tensors lose the relation -> ``relax.op.arange``
  with the symbolic end, whose length simplifies to ``seq``.

We never edit the installed TVM: the frontend looks converters up through its module-level
``_get_convert_map()``, which ``patched_convert_map`` temporarily wraps.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import tvm
from tvm import relax, tirx
from tvm.relax.frontend.onnx import onnx_frontend as _of


def _as_symbolic_scalar(x: Any) -> Any | None:
    """A scalar integer PrimExpr hiding in an importer value, else None."""
    if isinstance(x, (relax.ShapeExpr, tvm.ir.GenericConst)):
        return None
    if tvm.ir.is_prim_expr(x):
        return x
    return None


def _prim_dtype(x: Any) -> str:
    # PrimExprs carry their dtype as a PrimType in ``ty`` (``.dtype`` is for buffer vars only).
    return str(x.ty)


def _const_list(x: Any, params: Any) -> list | None:
    x = _of.get_constant(x, params)
    if isinstance(x, tvm.ir.GenericConst):
        return x.value.numpy().reshape(-1).tolist() if x.value.numpy().ndim <= 1 else None
    return None


def _const_scalar(x: Any, params: Any) -> int | float | None:
    x = _of.get_constant(x, params)
    if isinstance(x, tvm.ir.GenericConst) and x.value.numpy().size == 1:
        return x.value.numpy().reshape(()).item()
    return None


class Reshape(_of.Reshape):
    """Reshape that accepts a scalar symbolic value (e.g. ``seq`` taken out of a Shape)."""

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        scalar = _as_symbolic_scalar(inputs[0])
        if scalar is None:
            return super()._impl_v13(bb, inputs, attr, params)
        if _prim_dtype(scalar) != "int64":
            scalar = tirx.Cast("int64", scalar)
        new_shape = _const_list(inputs[1], params)
        if new_shape == []:
            return scalar  # reshape to rank 0: still the same scalar
        if new_shape is not None and len(new_shape) == 1 and new_shape[0] in (1, -1):
            # A 1-element shape value: keep it symbolic so Concat/Expand/Reshape consumers can use it.
            return relax.ShapeExpr([scalar])
        # Anything else: materialize as an int64 tensor and let the stock converter reshape it.
        data = bb.normalize(relax.op.shape_to_tensor(relax.ShapeExpr([scalar])))
        return super()._impl_v13(bb, [data, inputs[1]], attr, params)


class Expand(_of.Expand):
    """Expand of an input with symbolic dims to a constant target shape."""

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        data, shape = inputs[0], _of.get_constant(inputs[1], params)
        ty = getattr(data, "ty", None)
        if not (
            isinstance(shape, tvm.ir.GenericConst)
            and isinstance(ty, relax.TensorType)
            and isinstance(ty.shape, relax.ShapeExpr)
            and any(not isinstance(d, tirx.IntImm) for d in ty.shape.values)
        ):
            return super()._impl_v13(bb, inputs, attr, params)
        target = [int(v) for v in shape.value.numpy().reshape(-1).tolist()]
        dims = list(ty.shape.values)
        rank = max(len(target), len(dims))
        target = [1] * (rank - len(target)) + target
        dims = [tirx.IntImm("int64", 1)] * (rank - len(dims)) + dims
        out = []
        for i, (t, d) in enumerate(zip(target, dims, strict=True)):
            if t in (1, -1):
                out.append(d)  # broadcast(d, 1) == d, whatever d is
            elif isinstance(d, tirx.IntImm) and int(d.value) not in (1, t):
                raise ValueError(f"Expand: dim {i} of size {int(d.value)} cannot broadcast to {t}")
            else:
                # Symbolic d must be 1 or t at run time for a valid graph: the result is t.
                out.append(tirx.IntImm("int64", t))
        if rank == len(ty.shape.values) and all(
            isinstance(o, tirx.IntImm) and isinstance(d, tirx.IntImm) and o.value == d.value or o.same_as(d)
            for o, d in zip(out, dims, strict=True)
        ):
            return data
        return relax.op.broadcast_to(data, relax.ShapeExpr(out))


class Range(_of.Range):
    """Range with a symbolic limit and constant integer start / positive delta: length stays symbolic."""

    @classmethod
    def _impl_v12(cls, bb, inputs, attr, params):
        start, delta = _const_scalar(inputs[0], params), _const_scalar(inputs[2], params)
        limit = _as_symbolic_scalar(_of.get_constant(inputs[1], params))
        if (
            limit is None
            or not isinstance(start, int)
            or not isinstance(delta, int)
            or delta <= 0  # arange does not clamp a negative count the way ONNX Range does
            or not _prim_dtype(limit).startswith("int")
        ):
            return super()._impl_v12(bb, inputs, attr, params)
        out_dtype = str(_of.get_constant(inputs[0], params).ty.dtype)
        if _prim_dtype(limit) != "int64":
            limit = tirx.Cast("int64", limit)
        # arange's length is ceil((limit - start) / delta); for Range(0, n, 1) it simplifies to n.
        return relax.op.arange(start, limit, delta, out_dtype)


#: op_type -> converter class, applied on top of TVM's map by ``patched_convert_map``.
CONVERTER_FIXES: dict[str, type] = {"Reshape": Reshape, "Expand": Expand, "Range": Range}

_PATCH_LOCK = threading.RLock()


@contextlib.contextmanager
def patched_convert_map(
    extra_converters: Mapping[str, type] | None = None, *, fixes: bool = True
) -> Iterator[dict[str, type]]:
    """Make the TVM ONNX frontend see its own map + our fixes + ``extra_converters``.

    Yields the effective map. The patch is process-global (the frontend reads a module
    attribute), so imports under it are serialized with a lock.
    """
    with _PATCH_LOCK:
        original = _of._get_convert_map
        effective = dict(original())
        if fixes:
            effective.update(CONVERTER_FIXES)
        effective.update(extra_converters or {})
        _of._get_convert_map = lambda: effective
        try:
            yield effective
        finally:
            _of._get_convert_map = original
