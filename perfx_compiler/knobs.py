"""``perfx-compile --knob TEMPLATE.KEY=VALUE``: override one tunable of a schedule template for an
experiment (an A/B of two builds), without editing code, a target file or a tuning record.

A knob name is a schedule template's name and one of the configuration keys it declares
(``ScheduleTemplate.knobs``), e.g. ``gemv_qvnni_cpu.prefetch=0`` or ``attention_cpu.splits=2``.
The value wins over the template's default, the target file's template defaults and a tuning
record, for every kernel of that template where the key applies and the configuration stays valid
(``ScheduleTemplate.with_knobs``). The knobs in effect are a compile option: recorded in
``perfx-config.json`` (``compile_options.knobs``), part of ``LLM()``'s cache key and of
``perfx-bench``'s build stamp.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from perfx_compiler.errors import PerfXError


class UnknownKnobError(PerfXError):
    """A ``--knob`` whose name no schedule template declares, or that is not NAME=VALUE."""


def knob_names() -> dict[str, tuple[str, ...]]:
    """Template name -> the configuration keys ``--knob`` may set, for every registered template."""
    from perfx_compiler.schedule_template import registered_templates

    return {t.name: tuple(t.knobs) for t in registered_templates() if t.knobs}


def _value(text: str) -> Any:
    """``"128"`` -> 128, ``"0.5"`` -> 0.5, ``"true"``/``"false"`` -> bool, anything else the string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def parse_knobs(knobs: Iterable[str] | Mapping[str, Any] | None) -> dict[str, Any]:
    """``["t.key=value", ...]`` (the CLI's repeated flag) or ``{"t.key": value}`` -> ``{"t.key": value}``
    sorted by name (a later setting of a name wins); raises :class:`UnknownKnobError` on a name no
    template declares, listing the valid ones."""
    if not knobs:
        return {}
    if isinstance(knobs, Mapping):
        pairs = [(str(k), v if not isinstance(v, str) else _value(v)) for k, v in knobs.items()]
    else:
        pairs = []
        for item in knobs:
            name, sep, text = str(item).partition("=")
            if not sep or not name.strip() or not text.strip():
                raise UnknownKnobError(f"--knob {item!r}: expected NAME=VALUE, e.g. gemv_qvnni_cpu.prefetch=0")
            pairs.append((name.strip(), _value(text)))
    valid = knob_names()
    out: dict[str, Any] = {}
    for name, value in pairs:
        template, _, key = name.partition(".")
        if key not in valid.get(template, ()):
            names = ", ".join(f"{t}.{k}" for t in sorted(valid) for k in valid[t])
            raise UnknownKnobError(f"unknown knob {name!r}; valid knobs: {names}")
        out[name] = value
    return dict(sorted(out.items()))


def by_template(knobs: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"t.key": value}`` -> ``{"t": {"key": value}}`` (what ``TargetDescription.knobs`` holds)."""
    out: dict[str, dict[str, Any]] = {}
    for name, value in knobs.items():
        template, _, key = name.partition(".")
        out.setdefault(template, {})[key] = value
    return out
