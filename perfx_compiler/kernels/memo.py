"""Kernel builders remembered by their arguments, for the life of the process.

Parsing TVMScript was over half of a small model's compile (10 of 18 s for the tests' tiny Llama: the VNNI
GEMM and GEMV templates, the attention kernels), and the same kernels come back in every layer, in every
compile of a process (the tests, ``perfx-tune``'s rounds, a notebook compiling one model for several
targets). A builder decorated here parses once per distinct argument set. PrimFuncs are immutable, so
every caller can share one.

Arguments are keyed by value: dicts and lists by their items, TVM objects by structural hash (checked
with structural equality on a hit). A builder that raises is not remembered. :func:`clear` forgets every
builder's kernels (a test that changes how TVMScript parses must build again).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
MAX_KERNELS = 512  # per builder; a tuning run's candidates are a few hundred at most
_CACHES: list[OrderedDict] = []


class _Unkeyable(Exception):
    pass


def _key(value: Any, objects: list[Any]) -> Any:
    if isinstance(value, str | int | float | bool | type(None)):
        return value
    if isinstance(value, Mapping):
        return ("map", tuple(sorted((str(k), _key(v, objects)) for k, v in value.items())))
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(_key(v, objects) for v in value))
    if type(value).__module__.startswith(("tvm", "tvm_ffi")):
        import tvm_ffi

        objects.append(value)
        return ("tvm", int(tvm_ffi.structural_hash(value)))
    raise _Unkeyable(type(value).__name__)


def _same_objects(a: list[Any], b: list[Any]) -> bool:
    import tvm_ffi

    return len(a) == len(b) and all(tvm_ffi.structural_equal(x, y) for x, y in zip(a, b, strict=True))


def memoized_kernel(fn: F) -> F:
    """``fn`` remembered by its arguments (module docstring); arguments it cannot key go through uncached."""
    cache: OrderedDict = OrderedDict()
    _CACHES.append(cache)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        objects: list[Any] = []
        try:
            key = (_key(args, objects), _key(kwargs, objects))
        except _Unkeyable:
            return fn(*args, **kwargs)
        hit = cache.get(key)
        if hit is not None and _same_objects(hit[0], objects):
            cache.move_to_end(key)
            return hit[1]
        out = fn(*args, **kwargs)
        cache[key] = (objects, out)
        if len(cache) > MAX_KERNELS:
            cache.popitem(last=False)
        return out

    return wrapper  # type: ignore[return-value]


def clear() -> None:
    """Forget every remembered kernel."""
    for cache in _CACHES:
        cache.clear()
