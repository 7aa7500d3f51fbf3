"""schedules.TEMPLATES is the one place the templates and their order live: every template module of
the package is in it (a new file left out would never be tried), and the registry follows it."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import schedules
from perfx_compiler.schedule_template import registered_templates


def test_every_template_module_is_listed_once() -> None:
    found = []
    for info in pkgutil.iter_modules([str(Path(schedules.__file__).parent)]):
        if not info.name.startswith("_") and hasattr(importlib.import_module(f"schedules.{info.name}"), "TEMPLATE"):
            found.append(info.name)
    assert len(schedules.TEMPLATES) == len(set(schedules.TEMPLATES))
    assert sorted(found) == sorted(schedules.TEMPLATES)


def test_registry_tries_templates_in_list_order() -> None:
    assert [t.name for t in registered_templates()] == schedules.TEMPLATES
