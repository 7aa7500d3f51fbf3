"""Schedule templates: the base class, the workload key and the template registry.

A template recognises a PrimFunc (``match``), describes its search space (``space``), picks a
default configuration (``default_config``, from the target file's template defaults when present)
and applies one configuration (``apply``). The configuration keys it lists in ``knobs`` can be set
for an experiment by ``perfx-compile --knob NAME.KEY=VALUE`` (``with_knobs``: over the default and
over a tuning record). Templates live one per file in the top-level ``schedules/`` package and are
tried in the order of ``schedules.TEMPLATES``; adding a template means adding a file there with
``TEMPLATE`` and one line in that list.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from perfx_compiler.errors import PerfXError
from perfx_compiler.targets import TargetDescription

log = logging.getLogger(__name__)
# Attributes that name a function rather than describe its computation: excluded from the key so a
# renamed or re-exported function keeps its tuning records.
_VOLATILE_ATTRS = ("global_symbol", "tirx.is_scheduled")


class ScheduleConfigError(PerfXError):
    """A configuration a template cannot apply to this workload (bad tile sizes, ...)."""


def target_key(target: TargetDescription) -> str:
    """Identify a target by name and codegen settings, so a record made for avx2 never applies on avx512."""
    blob = json.dumps({"t": target.tvm_target, "h": target.host}, sort_keys=True, default=str)
    return f"{target.name}-{hashlib.sha256(blob.encode()).hexdigest()[:10]}"


def func_hash(func: Any) -> str:
    """Structural hash of a PrimFunc, stable across processes and insensitive to its name."""
    import tvm_ffi

    for attr in _VOLATILE_ATTRS:
        if func.attrs is not None and attr in func.attrs:
            func = func.without_attr(attr)
    return f"{tvm_ffi.structural_hash(func, map_free_vars=True) & 0xFFFFFFFFFFFFFFFF:016x}"


@dataclass(frozen=True)
class Workload:
    """One scheduling problem: a template applied to one function structure on one target."""

    template: str
    key: str  # template + function structure + target: the tuning-record key
    target_key: str
    dims: dict[str, int] = field(default_factory=dict)  # static extents, e.g. {"N": 1536, "K": 576}
    symbolic: str | None = None  # name of the dim left symbolic (e.g. "M"), None when all static
    info: dict[str, Any] = field(default_factory=dict)  # template-private facts (layout, blocks)

    def __hash__(self) -> int:
        return hash(self.key)

    def to_json(self) -> dict[str, Any]:
        return {
            "template": self.template,
            "key": self.key,
            "target_key": self.target_key,
            "dims": self.dims,
            "symbolic": self.symbolic,
            "info": self.info,
        }


def make_workload(
    template: str,
    func: Any,
    target: TargetDescription,
    dims: dict[str, int],
    symbolic: str | None = None,
    info: dict[str, Any] | None = None,
    version: int = 1,
) -> Workload:
    """The key joins template (and its version: bump it when a knob changes meaning, so old
    records stop applying), function structure and target."""
    tkey = target_key(target)
    key = f"{template}.v{version}:{func_hash(func)}:{tkey}"
    return Workload(template, key, tkey, dict(dims), symbolic, dict(info or {}))


class ScheduleTemplate:
    """Base class of schedule templates; subclasses set ``name`` and override the four methods."""

    name: str = "base"
    version: int = 1  # part of the workload key: bump to retire records of an older schedule
    knobs: tuple[str, ...] = ()  # configuration keys ``perfx-compile --knob NAME.KEY=VALUE`` may set

    def match(self, func: Any, target: TargetDescription) -> Workload | None:
        """Return the workload if this template handles ``func`` on ``target``, else None."""
        raise NotImplementedError

    def space(self, workload: Workload, target: TargetDescription) -> dict[str, list]:
        """Knob name -> candidate values. Not every combination need be valid (apply raises)."""
        raise NotImplementedError

    def builtin_default(self, workload: Workload, target: TargetDescription) -> dict[str, Any]:
        """A good configuration without tuning; target-file defaults override its entries."""
        raise NotImplementedError

    def default_config(self, workload: Workload, target: TargetDescription) -> dict[str, Any]:
        config = self.builtin_default(workload, target)
        overrides = target.templates.get(self.name, {}) if target.templates else {}
        space = self.space(workload, target)
        for knob, value in overrides.items():
            # Target-file defaults are tuned for typical shapes; keep them only where valid here.
            if knob in config and (knob not in space or value in space[knob]):
                config[knob] = value
        if not self.is_valid(workload, config, target):
            config = self.builtin_default(workload, target)
        return self.with_knobs(workload, config, target)

    def with_knobs(self, workload: Workload, config: dict[str, Any], target: TargetDescription) -> dict[str, Any]:
        """``config`` with the ``--knob`` values for this template (``target.knobs``) where the key
        applies to this workload (in its config, its builtin default or its space); kept as it was, with
        a warning, when they would make it invalid."""
        knobs = target.knobs.get(self.name) if target.knobs else None
        if not knobs:
            return config
        keys = set(config) | set(self.builtin_default(workload, target)) | set(self.space(workload, target))
        out = {**config, **{k: v for k, v in knobs.items() if k in keys}}
        try:
            valid = out == config or self.is_valid(workload, out, target)
        except (ValueError, TypeError, ScheduleConfigError):  # a value of the wrong kind ("abc" for a count)
            valid = False
        if not valid:
            log.warning("%s: --knob %s does not apply to %s (invalid config %s); kept %s",
                        self.name, knobs, workload.dims, out, config)
            return config
        return out

    def is_valid(self, workload: Workload, config: dict[str, Any], target: TargetDescription) -> bool:
        """Cheap static check of a configuration (no scheduling); apply() may still reject it."""
        return True

    def apply(
        self, func: Any, workload: Workload, config: dict[str, Any], target: TargetDescription
    ) -> Any:
        """Return the scheduled PrimFunc; raise ScheduleConfigError if ``config`` is invalid."""
        raise NotImplementedError


def vector_lanes(target: TargetDescription, dtype_bits: int = 32) -> int:
    """SIMD lanes of ``dtype_bits`` elements (16 fp32 on AVX-512, 8 on AVX2, 4 when unknown)."""
    bits = target.vector_bits or 128
    return max(1, bits // dtype_bits)


def is_cpu_target(target: TargetDescription) -> bool:
    return target.family == "cpu" and target.tvm_target.get("kind") == "llvm"


_REGISTRY: list[ScheduleTemplate] | None = None


def registered_templates(reload: bool = False) -> list[ScheduleTemplate]:
    """Templates from the ``schedules`` package, in the order of ``schedules.TEMPLATES``."""
    global _REGISTRY
    if _REGISTRY is None or reload:
        package = importlib.import_module("schedules")
        _REGISTRY = list(package.discover(reload=reload))
    return _REGISTRY


def template_by_name(name: str) -> ScheduleTemplate:
    for template in registered_templates():
        if template.name == name:
            return template
    raise KeyError(f"no schedule template named {name!r}")


def find_template(func: Any, target: TargetDescription) -> tuple[ScheduleTemplate, Workload] | None:
    """First template (in ``schedules.TEMPLATES`` order) that matches ``func``."""
    for template in registered_templates():
        workload = template.match(func, target)
        if workload is not None:
            return template, workload
    return None
