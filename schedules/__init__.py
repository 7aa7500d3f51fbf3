"""Schedule templates, one per module. Adding a template means adding a file here.

Each template module defines ``TEMPLATE`` (a ``ScheduleTemplate`` instance) and ``PRIORITY``
(an int; lower is tried first). Modules whose names start with ``_`` are helpers, not templates.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path


def discover(reload: bool = False) -> list:
    """Import every template module in this package; return templates ordered by PRIORITY."""
    found = []
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        if reload:
            module = importlib.reload(module)
        template = getattr(module, "TEMPLATE", None)
        if template is None:
            continue
        found.append((getattr(module, "PRIORITY", 100), info.name, template))
    found.sort(key=lambda item: (item[0], item[1]))
    return [template for _, _, template in found]
