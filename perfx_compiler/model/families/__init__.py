"""Model families, one folder each: adding a family is adding a folder with ``FAMILY = Family(...)``.

``FAMILIES`` is found by listing this package's subfolders, so no list elsewhere names them.
"""

from __future__ import annotations

import importlib
import pkgutil

from perfx_compiler.model.families._family import Family


def _discover() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not info.ispkg or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if not isinstance(family, Family):
            raise TypeError(f"{module.__name__} has no FAMILY = Family(...)")
        found[family.name] = family
    return found


FAMILIES: dict[str, Family] = _discover()


def family_for_hf_class(cls: str | None) -> Family | None:
    return next((f for f in FAMILIES.values() if cls in f.hf_classes), None)


def family_for_gguf_arch(arch: str) -> Family | None:
    return next((f for f in FAMILIES.values() if arch in f.gguf_archs), None)


def hf_classes() -> list[str]:
    return [c for f in FAMILIES.values() for c in f.hf_classes]


def gguf_archs() -> list[str]:
    return [a for f in FAMILIES.values() for a in f.gguf_archs]
