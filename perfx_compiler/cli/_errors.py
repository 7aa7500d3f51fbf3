"""The one way every PerfX command reports errors a user can cause.

A ``PerfXError`` becomes one line ``PROG: error: ...`` on stderr and exit code 2 (the traceback
only with ``--debug``); Ctrl-C exits 130 with an optional hint. A missing optional package (a plain
``pip install .`` has no extras) is one line naming the extra that installs it: commands check with
``require`` before any work, and an import of one that still fails is caught here. Imports nothing
heavy, so the thin runtime's commands can use it.
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from collections.abc import Callable

from perfx_compiler.errors import MissingDependencyError, PerfXError

# Optional packages by import name: (the pip package, the extra of pyproject.toml that installs it).
EXTRAS: dict[str, tuple[str, str]] = {
    "uvicorn": ("uvicorn", "serve"),
    "fastapi": ("fastapi", "serve"),
    "starlette": ("fastapi", "serve"),
    "pydantic": ("fastapi", "serve"),
    "prometheus_client": ("prometheus-client", "serve"),
    "llama_cpp": ("llama-cpp-python", "bench"),
    "onnxruntime_genai": ("onnxruntime-genai", "bench"),
}


def missing_message(module: str) -> str | None:
    """What to install for the optional ``module`` (its top-level name); None when it is not optional."""
    if module not in EXTRAS:
        return None
    package, extra = EXTRAS[module]
    return f'{package} is not installed; pip install "perfx[{extra}]"'


def require(*modules: str) -> None:
    """Raise ``MissingDependencyError`` (naming the extra) for the first of ``modules`` not installed."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            raise MissingDependencyError(missing_message(module) or f"{module} is not installed")


def _fail(prog: str, msg: str, debug: bool) -> int:
    if debug:
        traceback.print_exc()
    print(f"{prog}: error: {msg}", file=sys.stderr)
    return 2


def run_command(prog: str, body: Callable[[], int], *, debug: bool = False, interrupted: str = "interrupted") -> int:
    try:
        return body()
    except PerfXError as err:
        return _fail(prog, " ".join(str(err).split()) or type(err).__name__, debug)
    except ModuleNotFoundError as err:
        msg = missing_message((err.name or "").partition(".")[0])
        if msg is None:  # a core dependency missing is a broken install: keep its traceback
            raise
        return _fail(prog, msg, debug)
    except KeyboardInterrupt:
        print(f"{prog}: {interrupted}", file=sys.stderr)
        return 130
