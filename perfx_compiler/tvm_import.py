"""Import TVM without torch.

tvm_ffi imports torch whenever it is installed, for torch-tensor interop (~200 MB resident, ~1.5 s).
PerfX hands TVM only numpy arrays and TVM tensors, so both the compiler (``tvm_compiler``) and the
runtime (``runtime/engine.py``) import TVM with torch hidden; ``import torch`` works again right after.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def torch_hidden() -> Iterator[None]:
    """Within the block ``import torch`` raises ImportError, unless torch is already imported."""
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # type: ignore[assignment]  # makes `import torch` raise ImportError
    try:
        yield
    finally:
        if hide and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
