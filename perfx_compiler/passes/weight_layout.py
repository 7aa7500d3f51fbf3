"""Read linear weights as stored ([out, in]) instead of transposing them per call.

The emitted graph computes ``x @ transpose(W)``; fusing the transpose into the
matmul lets the kernel read ``W`` row by row (the layout GEMV templates want)
and removes a transpose kernel per weight per step.
"""

from __future__ import annotations

from typing import Any

import tvm
from tvm import relax

NAME = "weight_layout"
ORDER = 90  # after fusions and quantization, right before lowering
DEFAULT = True


def apply(mod: tvm.IRModule, weights: dict[str, Any], ctx: Any) -> tuple[tvm.IRModule, dict[str, Any]]:
    return relax.transform.FuseTransposeMatmul()(mod), weights
