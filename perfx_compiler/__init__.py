"""PerfX: an LLM compiler on Apache TVM, with a thin vLLM-shaped runtime.

``from perfx_compiler import LLM, SamplingParams`` resolves lazily (PEP 562), so
importing the package pulls in neither the compiler nor TVM.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> module that defines it; loaded on first attribute access.
_LAZY = {
    "LLM": "perfx_compiler.llm",
    "SamplingParams": "perfx_compiler.runtime.api",
    "RequestOutput": "perfx_compiler.runtime.api",
    "CompletionOutput": "perfx_compiler.runtime.api",
}

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from perfx_compiler.llm import LLM
    from perfx_compiler.runtime.api import (
        CompletionOutput,
        RequestOutput,
        SamplingParams,
    )


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'perfx_compiler' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
