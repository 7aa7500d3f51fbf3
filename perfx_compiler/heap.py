"""Hand freed heap memory back to the OS.

glibc keeps memory freed by Python and by native libraries (the ``tokenizers`` build of a 262k-token
vocabulary, TVM's passes) in its arenas, so the process stays that large for the rest of a compile and
the next phase's peak lands on top of it. ``malloc_trim`` returns it. The runtime also maps its large
buffers on their own (``map_large_allocations``), so that a freed one leaves the process at once. Without
glibc both do nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
from collections.abc import Iterator
from typing import Any


@functools.cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "malloc_trim") else None


def trim_heap() -> None:
    """Return the heap's free memory to the OS (glibc ``malloc_trim``; a no-op without it)."""
    lib = _libc()
    if lib is not None:
        lib.malloc_trim(0)


M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)


def map_large_allocations(threshold: int = 1 << 20) -> None:
    """Serve every allocation of ``threshold`` bytes or more from a mapping of its own (glibc ``mallopt``),
    so freeing it unmaps it. By default glibc raises that bound to the size of each such block freed (up to
    32 MiB), after which the VM's prefill activations (0.5-11 MiB each) come from the heap and, freed, stay
    there: docs/decisions/long-context.md."""
    lib = _libc()
    if lib is not None:
        lib.mallopt(M_MMAP_THRESHOLD, int(threshold))


M_ARENA_MAX = -8  # mallopt parameter (malloc.h)


@contextlib.contextmanager
def one_arena() -> Iterator[None]:
    """Threads that first allocate inside the block share the arenas glibc already has instead of making one
    each. The compile's codegen threads (``codegen_parts``) each left an arena of freed LLVM memory that
    ``malloc_trim`` did not give back for the rest of the compile (Gemma 3 270M's peak 453 MB with an arena a
    thread, 433 sharing: docs/decisions/gguf-superblocks.md). On leaving, glibc's default bound (8 arenas a
    core) is back."""
    lib = _libc()
    if lib is None:
        yield
        return
    lib.mallopt(M_ARENA_MAX, 1)
    try:
        yield
    finally:
        lib.mallopt(M_ARENA_MAX, 8 * (os.cpu_count() or 1))


def drop_file_pages(view: Any, written: bool = False) -> None:
    """Let the OS drop the resident pages under ``view``, a read-only numpy view of a memory-mapped file (the
    GGUF's blocks), once it has been read: they are clean file pages, read again from the page cache or
    the file if needed. ``written``: ``view`` is (part of) a writable shared mapping (``np.memmap`` mode
    "r+", ``package.WeightFile.reserve``) that has been filled: its dirty pages stay in the page cache, which
    writes them to the file. Anything else (a copy, a private mapping) is left alone; only pages wholly
    inside the view are dropped."""
    import mmap

    import numpy as np

    base, shared = view, False
    while base is not None and not isinstance(base, mmap.mmap):
        if isinstance(base, np.memmap):
            shared = shared or base.mode in ("r+", "w+")  # (mode "c" is private: dropping its pages loses writes)
        if isinstance(base, np.ndarray) and base.flags.writeable and not written:
            return
        if isinstance(base, memoryview):
            base = base.obj
        elif isinstance(base, np.memmap):
            base = getattr(base, "_mmap", None)
        else:
            base = getattr(base, "base", None)
    lib = _libc()
    if base is None or (written and not shared) or lib is None or not hasattr(lib, "madvise") or not view.flags.c_contiguous:
        return
    page = mmap.PAGESIZE
    start = -(-view.ctypes.data // page) * page
    end = (view.ctypes.data + view.nbytes) // page * page
    if end > start:
        lib.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4)  # MADV_DONTNEED
