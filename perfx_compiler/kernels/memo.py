"""Kernel builders remembered by their arguments, for the life of the process.

Parsing TVMScript was over half of a small model's compile (10 of 18 s for the tests' tiny Llama: the VNNI
GEMM and GEMV templates, the attention kernels), and the same kernels come back in every layer, in every
compile of a process (the tests, ``perfx-tune``'s rounds, a notebook compiling one model for several
targets). A builder decorated here parses once per distinct argument set. PrimFuncs are immutable, so
every caller can share one.

Arguments are keyed by value: dicts and lists by their items, TVM objects by structural hash (checked
with structural equality on a hit). A builder that raises is not remembered. :func:`clear` forgets every
builder's kernels (a test that changes how TVMScript parses must build again).

Across processes (each ``perfx-compile``, a test worker, a tuning process), kernels are also kept on disk
as TVM's JSON (``tvm.ir.save_json``, gzipped; read back instead of parsed, Gemma 3 270M compiles in 19.9 s
instead of 29.7: ``benchmarks/ab.py --level compile``, results/intel-xeon/ab_compile_kernel_cache.csv). A call with TVM arguments stores them with its kernel, and
a file is used only when they are structurally equal to the call's. The folder is
``$PERFX_KERNEL_CACHE`` (``none``: no disk cache) or ``~/.cache/perfx/kernels``, one subfolder per code version:
a hash of TVM's version and of the compiler's files (``artifact_hash.compiler_digest``, as ``LLM()``'s artifact
cache), so any change builds afresh. A file that does not load is built again and replaced; a folder that cannot be written is skipped.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import os
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
MAX_KERNELS = 512  # per builder; a tuning run's candidates are a few hundred at most
_CACHES: list[OrderedDict] = []
CACHE_ENV = "PERFX_KERNEL_CACHE"
STALE_S = 7 * 86400  # another code version's folder untouched this long is removed


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


@functools.cache
def code_version() -> str:
    """TVM's version and the digest of the compiler's files (``artifact_hash.compiler_digest``: the package's
    sources, the ``schedules`` templates, targets, tuning records), once per process."""
    import tvm

    from perfx_compiler.artifact_hash import compiler_digest

    return hashlib.sha256(f"{tvm.__version__}:{compiler_digest()}".encode()).hexdigest()[:20]


def disk_folder() -> Path | None:
    """This code version's kernel folder (None: ``$PERFX_KERNEL_CACHE`` is ``none``)."""
    env = os.environ.get(CACHE_ENV, "")
    if env.lower() == "none":
        return None
    try:
        return (Path(env) if env else Path.home() / ".cache" / "perfx" / "kernels") / code_version()
    except (OSError, RuntimeError):  # sources that cannot be read (or no home): no disk cache
        return None


def _disk_load(path: Path, objects: list[Any]) -> Any:
    """The kernel in ``path`` (None: build it). A call with TVM arguments (keyed by their structural hash) has
    them stored before its kernel, and they must be structurally equal to this call's."""
    import tvm

    try:
        got = tvm.ir.load_json(gzip.decompress(path.read_bytes()).decode())
        if not objects:
            return got
        if len(got) == len(objects) + 1 and _same_objects(list(got)[:-1], objects):
            return got[len(objects)]
    except Exception:  # missing, truncated or from a TVM that reads it otherwise: build again
        pass
    return None


def _disk_save(path: Path, out: Any, objects: list[Any]) -> None:
    import tvm
    import tvm_ffi

    try:
        if objects:
            out = tvm_ffi.convert([*objects, out])
        if not path.parent.is_dir():
            path.parent.mkdir(parents=True, exist_ok=True)
            _remove_stale(path.parent)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.partial")
        try:
            tmp.write_bytes(gzip.compress(tvm.ir.save_json(out).encode(), compresslevel=1))
            os.replace(tmp, path)  # (atomic: a process reading it sees all of it or none)
        finally:
            tmp.unlink(missing_ok=True)
    except Exception:  # a read-only or full disk, an object TVM does not serialize: memory only
        pass


def _remove_stale(folder: Path) -> None:
    """Other code versions' folders not written for ``STALE_S`` (installs side by side keep theirs)."""
    for other in folder.parent.iterdir():
        if other != folder and other.is_dir() and time.time() - other.stat().st_mtime > STALE_S:
            shutil.rmtree(other, ignore_errors=True)


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
        folder = disk_folder()
        path = folder / (hashlib.sha256(repr((fn.__module__, fn.__qualname__, key)).encode()).hexdigest()[:32]
                         + ".json.gz") if folder is not None else None
        out = _disk_load(path, objects) if path is not None and path.is_file() else None
        if out is None:
            out = fn(*args, **kwargs)
            if path is not None and type(out).__module__.startswith("tvm"):  # (tvm, tvm_ffi objects)
                _disk_save(path, out, objects)
        cache[key] = (objects, out)
        if len(cache) > MAX_KERNELS:
            cache.popitem(last=False)
        return out

    return wrapper  # type: ignore[return-value]


def clear() -> None:
    """Forget every remembered kernel."""
    for cache in _CACHES:
        cache.clear()
