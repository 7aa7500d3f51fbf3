"""The ``perfx.quant`` PrimFunc attribute: the JSON facts (bits, N, K, group, layout, kind, ...) a
quantization pass puts on a linear's reference PrimFunc and the schedule templates match on.

One definition for the passes and for ``schedules/`` (which imports it from here: ``schedules`` is
imported by ``perfx_compiler``, so the dependency runs this way round). No TVM import: any object
with ``attrs`` will do.
"""

from __future__ import annotations

import json
from typing import Any

QUANT_ATTR = "perfx.quant"


def read_quant_info(func: Any) -> dict[str, Any] | None:
    """The parsed ``perfx.quant`` attribute of ``func``; None when it has none or it is not JSON."""
    attrs = getattr(func, "attrs", None)
    if attrs is None or QUANT_ATTR not in attrs:
        return None
    try:
        return json.loads(str(attrs[QUANT_ATTR]))
    except ValueError:
        return None
