"""Faster TVMScript parsing: the same frames, found without reading source files.

TVMScript looks up its callers' frames with ``inspect.stack()`` (``@T.prim_func``, ``@R.function``,
``@I.ir_module``) and ``inspect.getouterframes`` (every macro expansion). Both build a ``FrameInfo`` for
every frame on the stack, which reads the frame's source line and resolves its module (a scan of
``sys.modules`` for files that are no module's, per frame per call). PerfX parses its kernels, fused
pass kernels and template kernels at compile time, so this was most of the schedule phase of a SmolLM2
compile (docs/decisions/tvmscript-parse-speedup.md). Here the same frames are visited in the same
order; a frame's ``FrameInfo`` (source line included) is built only when the parser reads more than
``.frame``, so every parsed PrimFunc is unchanged (tests/test_tvmscript_speedups.py builds kernels both
ways and compares them).

The packages that hold TVMScript (``perfx_compiler.kernels``, ``perfx_compiler.passes``, ``schedules``)
call :func:`install` when imported; it is idempotent.
"""

from __future__ import annotations

import inspect
import sys
from types import FrameType, TracebackType
from typing import Any


class _LazyFrameInfo:
    """``inspect.FrameInfo`` of ``frame`` as it stood when listed (its line and instruction are kept
    in a traceback entry), built on first use of anything but ``.frame``."""

    __slots__ = ("frame", "_at", "_context", "_info")

    def __init__(self, frame: FrameType, context: int) -> None:
        self.frame, self._context, self._info = frame, context, None
        self._at = TracebackType(None, frame, frame.f_lasti, frame.f_lineno)

    def _real(self) -> inspect.FrameInfo:
        if self._info is None:
            # getframeinfo of a traceback entry reads its lasti/lineno where a frame's would read the
            # frame's current ones: the same Traceback as inspect.stack() gave at listing time
            tb = inspect.getframeinfo(self._at, self._context)
            self._info = inspect.FrameInfo(self.frame, *tb, positions=tb.positions)
        return self._info

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real(), name)

    def __getitem__(self, i: Any) -> Any:
        return self._real()[i]

    def __iter__(self) -> Any:
        return iter(self._real())

    def __len__(self) -> int:
        return len(self._real())


def _lazy_stack(context: int = 1) -> list[_LazyFrameInfo]:
    """``inspect.stack(context)``: the caller's frame first, then outwards."""
    frames, frame = [], sys._getframe(1)
    while frame is not None:
        frames.append(_LazyFrameInfo(frame, context))
        frame = frame.f_back
    return frames


ORIGINALS: dict[str, Any] = {}  # what install() replaced (the comparison test restores them)


class _InspectWithLazyStack:
    """The ``inspect`` module as TVMScript's entry points see it, with a lazy ``stack``."""

    stack = staticmethod(_lazy_stack)

    def __getattr__(self, name: str) -> Any:
        return getattr(inspect, name)


def install() -> None:
    """Patch TVMScript's frame lookups (no-op where the TVM version lays them out differently, and
    when already installed)."""
    import importlib

    if ORIGINALS:
        return
    try:
        from tvm.script.parser.core.parser import ScriptMacro
    except ImportError:
        return
    if hasattr(ScriptMacro, "_find_parser_def"):

        def _find_parser_def(self: ScriptMacro) -> Any:
            # getouterframes(currentframe()) with only .frame read: the same frames, same order
            frame = sys._getframe()
            while frame is not None:
                parser = frame.f_globals.get(ScriptMacro.parser_object_name)
                if parser is not None:
                    return parser
                frame = frame.f_back
            raise RuntimeError(f"{ScriptMacro.parser_object_name} not available")

        ORIGINALS.setdefault("ScriptMacro._find_parser_def", ScriptMacro._find_parser_def)
        ScriptMacro._find_parser_def = _find_parser_def
    for name in ("tvm.tirx.script.parser.entry", "tvm.relax.script.parser.entry", "tvm.script.parser.ir.entry"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(mod, "inspect", None) is inspect:
            ORIGINALS.setdefault(name, mod)
            mod.inspect = _InspectWithLazyStack()
