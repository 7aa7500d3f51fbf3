"""The compile pipeline's schedule phase: give every unscheduled PrimFunc a template schedule.

For each PrimFunc without ``tirx.is_scheduled``: the first matching template (by priority),
configured by the best tuning record for (workload key, target key) when one exists, else by the
template default. A record that no longer applies (the template rejects it) falls back to the
default with a warning; a default that fails falls back to the next template, so the phase
never leaves a function worse than unscheduled-but-correct.

Per-bucket dispatch: a symbolic-M matmul (prefill) tuned on several M buckets whose best
configurations differ is scheduled once per distinct configuration, and the variants are joined
in one PrimFunc under ``if M < sqrt(b_i * b_i+1)`` tests on its run-time M (thresholds halfway
between buckets on a log scale). Other symbolic functions use the record of the bucket nearest
``TYPICAL_M``.

A kernel that nothing schedules is an error (:class:`UnscheduledKernelError`, naming the kernel and
every template tried with its error): on a CPU it would otherwise run serially with no sign of it.
``best_effort=True`` builds it unscheduled with a warning instead. GPU kernels that no template
matches are left to ``gpu_adapt.bind_host_kernels`` (a correctness net the compile report names).
Every kernel's outcome (template, config source) is returned as a :class:`KernelSchedule`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from perfx_compiler.errors import PerfXError
from perfx_compiler.schedule_template import registered_templates
from perfx_compiler.targets import TargetDescription

if TYPE_CHECKING:
    import tvm

    from perfx_compiler.tune.records import TuningDatabase

log = logging.getLogger(__name__)
SCHEDULED_ATTR = "tirx.is_scheduled"
TYPICAL_M = 64  # prompt length the single-config symbolic functions are configured for


def _is_scheduled(func: Any) -> bool:
    attrs = func.attrs
    return attrs is not None and SCHEDULED_ATTR in attrs and bool(attrs[SCHEDULED_ATTR])


class UnscheduledKernelError(PerfXError):
    """Every template that matched a kernel failed on it (or none matched on a CPU target)."""


@dataclass
class KernelSchedule:
    """How one PrimFunc was scheduled: what the compile report and the manifest list."""

    kernel: str
    template: str | None  # None: nothing scheduled it
    # record | default | records per bucket | pre-scheduled (a hand-written kernel) | unmatched | failed
    source: str
    config: dict[str, Any] | None = None
    failures: list[str] = field(default_factory=list)  # "template (source config): error", in order tried

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kernel": self.kernel, "template": self.template, "source": self.source}
        if self.failures:
            out["failures"] = list(self.failures)
        return out


def _one_line(err: BaseException, limit: int = 200) -> str:
    # TVM errors carry a C++ backtrace; the last non-empty line is the message
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    text = f"{type(err).__name__}: {lines[-1] if lines else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def schedule_kernel(
    func: Any,
    target: TargetDescription,
    records: TuningDatabase | None = None,
    m_hint: int | None = None,
    name: str = "",
) -> tuple[Any, KernelSchedule]:
    """Schedule one PrimFunc: every matching template in priority order, each with its tuning record
    (when one applies) and then its default; the first that applies wins. The function comes back
    unchanged with ``template=None`` when none does (``failures`` says why)."""
    failures: list[str] = []
    matched = False
    for template in registered_templates():
        workload = template.match(func, target)
        if workload is None:
            continue
        matched = True
        candidates: list[tuple[str, dict[str, Any]]] = []
        if records is not None:
            hint = m_hint if m_hint is not None else (TYPICAL_M if workload.symbolic else None)
            best = records.best(workload.key, workload.target_key, bucket=hint, nearest=True)
            if best is not None and best.template == template.name:
                candidates.append(("record", template.with_knobs(workload, dict(best.config), target)))
        candidates.append(("default", template.default_config(workload, target)))
        for source, config in candidates:
            try:
                scheduled = template.apply(func, workload, config, target)
            except Exception as err:  # noqa: BLE001 - any template failure falls through (and is kept)
                log.warning("%s: %s (%s config %s) failed: %s", name or "kernel", template.name, source, config, err)
                failures.append(f"{template.name} ({source} config {config}): {_one_line(err)}")
                continue
            outcome = KernelSchedule(name, template.name, source, config, failures)
            return scheduled.with_attr(SCHEDULED_ATTR, True), outcome
    return func, KernelSchedule(name, None, "failed" if matched else "unmatched", None, failures)


def schedule_func(
    func: Any,
    target: TargetDescription,
    records: TuningDatabase | None = None,
    m_hint: int | None = None,
) -> tuple[Any, str | None, dict[str, Any] | None]:
    """Schedule one PrimFunc; returns (func, template name or None, config used)."""
    scheduled, outcome = schedule_kernel(func, target, records, m_hint)
    return scheduled, outcome.template, outcome.config


def unscheduled_error(outcomes: list[KernelSchedule], target: TargetDescription) -> UnscheduledKernelError:
    """One line naming each kernel nothing scheduled and what was tried on it."""
    parts = []
    for o in outcomes:
        why = "; ".join(o.failures) if o.failures else f"no schedule template matches it on {target.name}"
        parts.append(f"kernel {o.kernel}: {why}")
    return UnscheduledKernelError(
        f"{len(outcomes)} kernel(s) left unscheduled for target {target.name} (they would run serially): "
        + " | ".join(parts)
        + " (pass best_effort=True / perfx-compile --best-effort to build them unscheduled)"
    )


def schedule_module(
    mod: tvm.IRModule,
    target: TargetDescription,
    records: TuningDatabase | None = None,
    best_effort: bool = False,
) -> tuple[tvm.IRModule, list[KernelSchedule]]:
    """Schedule every PrimFunc of ``mod`` not already scheduled; return the module and one
    :class:`KernelSchedule` per PrimFunc (pre-scheduled ones included), sorted by name.

    A kernel no template schedules raises :class:`UnscheduledKernelError` unless ``best_effort``
    (then it stays unscheduled, with a warning). On GPU targets a kernel no template matches is
    not an error: ``bind_host_kernels`` gives it a device launch after this phase."""
    from tvm import tirx

    updates = {}
    outcomes: list[KernelSchedule] = []
    for gvar, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        name = gvar.name_hint
        if _is_scheduled(func):
            outcomes.append(KernelSchedule(name, "hand-written", "pre-scheduled"))
            continue
        dispatched = _dispatch_named(func, target, records) if records is not None else None
        if dispatched is not None:
            updates[gvar] = dispatched[0]
            outcomes.append(KernelSchedule(name, dispatched[1], "records per bucket"))
            continue
        scheduled, outcome = schedule_kernel(func, target, records, name=name)
        outcomes.append(outcome)
        if outcome.template is not None:
            log.debug("scheduled %s with %s %s", name, outcome.template, outcome.config)
            updates[gvar] = scheduled
    missing = [o for o in outcomes if o.template is None and _needs_schedule(o, target)]
    if missing:
        err = unscheduled_error(missing, target)
        if not best_effort:
            raise err
        log.warning("best effort: %s", err)
    outcomes.sort(key=lambda o: o.kernel)
    if not updates:
        return mod, outcomes
    mod = mod.clone()  # the caller's module stays as it was
    for gvar, func in updates.items():
        mod.update_func(gvar, func)
    return mod, outcomes


def _needs_schedule(outcome: KernelSchedule, target: TargetDescription) -> bool:
    # A GPU kernel no template matches gets a device launch from gpu_adapt (the generic path);
    # a template that matched and failed is an error everywhere.
    return outcome.source == "failed" or target.family != "gpu"


def apply_schedules(
    mod: tvm.IRModule,
    target: TargetDescription,
    records: TuningDatabase | None = None,
    best_effort: bool = False,
) -> tvm.IRModule:
    """Schedule every PrimFunc of ``mod`` not already scheduled; Relax functions are untouched
    (see :func:`schedule_module`, which also returns how each kernel was scheduled)."""
    return schedule_module(mod, target, records, best_effort)[0]


def _bucket_configs(template: Any, workload: Any, records: TuningDatabase,
                    target: TargetDescription | None = None) -> list[tuple[int, dict[str, Any]]]:
    """(bucket, best config) per measured bucket, ascending; neighbours with equal configs merged;
    with ``target``, the --knob values it carries applied to each."""
    out: list[tuple[int, dict[str, Any]]] = []
    for bucket in records.buckets(workload.key, workload.target_key):
        best = records.best(workload.key, workload.target_key, bucket=bucket)
        if best is None or best.template != template.name:
            continue
        if out and out[-1][1] == best.config:
            continue
        out.append((bucket, best.config))
    return out if target is None else [(b, template.with_knobs(workload, dict(c), target)) for b, c in out]


def _dispatch_by_bucket(func: Any, target: TargetDescription, records: TuningDatabase) -> Any | None:
    """One variant per distinct per-bucket configuration of a symbolic-M matmul, joined by tests
    on M; None when not applicable (static M, one config, not a matmul, a variant fails)."""
    dispatched = _dispatch_named(func, target, records)
    return None if dispatched is None else dispatched[0]


def _dispatch_named(func: Any, target: TargetDescription, records: TuningDatabase) -> tuple[Any, str] | None:
    """:func:`_dispatch_by_bucket` and the name of the template whose variants it joined."""
    from tvm import s_tir, tirx
    from tvm.s_tir.stmt import SBlock, SBlockRealize

    from perfx_compiler.schedule_template import find_template
    from schedules._matmul import analyze_matmul

    found = find_template(func, target)
    if found is None or found[1].symbolic is None:
        return None
    template, workload = found
    chosen = _bucket_configs(template, workload, records, target)
    if len(chosen) < 2:
        return None
    facts = analyze_matmul(func, allow_half=True)  # half-weight GEMMs dispatch per bucket too
    if facts is None or facts.M is not None:
        return None
    sch = s_tir.Schedule(func)
    blk = sch.get(sch.get_sblock(facts.block))
    m_extent = blk.iter_vars[facts.roles.index("m")].dom.extent
    variants = []
    for bucket, config in chosen:
        try:
            variants.append((bucket, template.apply(func, workload, config, target)))
        except Exception as err:  # noqa: BLE001 - fall back to the single-config path
            log.warning("%s bucket %d config %s failed: %s", template.name, bucket, config, err)
            return None
    roots = [v.body for _, v in variants]
    if not all(isinstance(r, SBlockRealize) for r in roots) or any(
        not v.params[i].same_as(func.params[i]) for _, v in variants for i in range(len(func.params))
    ):
        return None  # the variants must share the function's parameters to share one body
    body = roots[-1].block.body
    for i in range(len(variants) - 2, -1, -1):
        threshold = int(round((variants[i][0] * variants[i + 1][0]) ** 0.5))
        cond = m_extent < tirx.const(max(2, threshold), str(m_extent.ty) if hasattr(m_extent, "ty") else "int64")
        body = tirx.IfThenElse(cond, roots[i].block.body, body)
    allocs = [buf for r in roots for buf in r.block.alloc_buffers]
    root = roots[0].block
    merged = SBlockRealize([], True, SBlock([], [], [], root.name_hint, body, alloc_buffers=allocs))
    log.debug("%s: per-bucket dispatch over %s", workload.key, [b for b, _ in chosen])
    return variants[0][1].with_body(merged).with_attr(SCHEDULED_ATTR, True), template.name
