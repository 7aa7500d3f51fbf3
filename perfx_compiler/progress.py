"""Where progress bars go during a compile: the terminal's stderr, even while a phase captures fd 2
(pipeline._native_log collects what TVM's C++ side prints there and pushes the real stderr here)."""

from __future__ import annotations

import sys
from typing import Any, TextIO

_CONSOLE: list[TextIO] = []


def console() -> Any:
    """The stream a progress bar should write to now."""
    return _CONSOLE[-1] if _CONSOLE else sys.stderr


def push_console(stream: TextIO) -> None:
    _CONSOLE.append(stream)


def pop_console() -> TextIO:
    return _CONSOLE.pop()
