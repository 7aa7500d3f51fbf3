"""The committed x86-avx512 tuning records (tuning_logs/x86-avx512/) reach the built module.

SmolLM2-135M is lowered as the README's first command builds it (the shipped GGUF Q4_1, int8
activations on AVX-512 VNNI) and with ``--quantization bf16``. For every function of the tuned
templates (attention_cpu, gemm_half_cpu, gemv_qvnni_cpu, gemm_qvnni_cpu) the committed records hold a best record,
and the scheduler builds the function with exactly that record's configuration (per M bucket for a
symbolic-M GEMM). A function whose structure changed has no record and gets the template default,
and so does one whose committed records are stale (decode-shaped GEMMs timed warm, before the
tuner timed them cold: records.py), until it is retuned.
Slow: each lowering takes minutes on the 2-core machine.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

TUNED = ("gemv_qvnni_cpu", "gemm_qvnni_cpu", "attention_cpu", "gemm_half_cpu")


@pytest.fixture(scope="module")
def readme_desc():
    """SmolLM2 loaded as ``perfx-compile smollm2-135m`` loads it (its own context length), once for
    both lowerings (the pipeline only reads the description)."""
    from perfx_compiler.model.loader import load_model

    return load_model("smollm2-135m")


def _lowered(desc, quantization: str):
    from perfx_compiler.pipeline import lower_model

    return lower_model(desc, "x86-avx512", quantization=quantization)


def _committed(target_name: str):
    from perfx_compiler.tune.records import DEFAULT_LOG_ROOT, TuningDatabase

    directory = DEFAULT_LOG_ROOT / target_name
    return TuningDatabase(directory / "records.jsonl")


def _check_module(mod, target, templates):
    import tvm_ffi
    from tvm import tirx

    from perfx_compiler.schedule import (
        SCHEDULED_ATTR,
        TYPICAL_M,
        _bucket_configs,
        _dispatch_by_bucket,
        apply_schedules,
    )
    from perfx_compiler.schedule_template import find_template

    db = _committed(target.name)
    built = apply_schedules(mod, target, db)
    seen: dict[str, int] = {}
    missing: list[str] = []
    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        found = find_template(func, target)
        if found is None or found[0].name not in templates:
            continue
        template, wl = found
        best = db.best(wl.key, wl.target_key, bucket=TYPICAL_M if wl.symbolic else None, nearest=True)
        if best is None or best.template != template.name:
            missing.append(f"{gv.name_hint} ({template.name} {wl.dims})")  # e.g. failed to measure
            held = db.for_workload(wl.key, wl.target_key, include_stale=True)
            if held and all(r.stale for r in held):  # committed, but timed warm: never applied
                seen["stale:" + template.name] = seen.get("stale:" + template.name, 0) + 1
            default = template.apply(func, wl, template.default_config(wl, target), target)
            assert tvm_ffi.structural_equal(built[gv.name_hint], default.with_attr(SCHEDULED_ATTR, True)), (
                f"{gv.name_hint} has no record but was not built with the template default")
            seen["default:" + template.name] = seen.get("default:" + template.name, 0) + 1
            continue
        stale_buckets = {r.bucket for r in db.for_workload(wl.key, wl.target_key, include_stale=True) if r.stale}
        if stale_buckets:  # e.g. the M=1 bucket of a prefill GEMM, timed warm: not a candidate
            assert stale_buckets.isdisjoint(db.buckets(wl.key, wl.target_key)), stale_buckets
            seen["stale-bucket:" + template.name] = seen.get("stale-bucket:" + template.name, 0) + 1
        dispatched = _dispatch_by_bucket(func, target, db)
        if dispatched is not None:  # one variant per bucket: each the bucket's best record
            chosen = _bucket_configs(template, wl, db)
            for bucket, config in chosen:
                assert config == db.best(wl.key, wl.target_key, bucket=bucket).config
            assert not stale_buckets & {b for b, _ in chosen}, "a stale bucket's record was dispatched to"
            want = dispatched
        else:
            want = template.apply(func, wl, best.config, target).with_attr(SCHEDULED_ATTR, True)
        assert tvm_ffi.structural_equal(built[gv.name_hint], want), f"{gv.name_hint} not built from its record"
        seen[template.name] = seen.get(template.name, 0) + 1
        if best.confirmed:  # the winner of the paired re-timing (tune/confirm.py), not the raw fastest
            seen["confirmed:" + template.name] = seen.get("confirmed:" + template.name, 0) + 1
    print("built from committed records:", seen, "without a record:", missing)
    return seen, missing


def test_readme_model_uses_committed_attention_and_vnni_records(readme_desc):
    """The README's first command builds SmolLM2's prefill GEMMs from the committed cold-timed,
    confirmed VNNI records and the prefill attention from its record. The decode GEMVs' records are
    retired (they lost to the improved template defaults in the replayed decode step, x1.03-1.14:
    docs/decisions/tuning-records.md), and so are the decode attention's (its kernel's version 2
    appends k/v inside the tasks): the template default, checked to be what was built."""
    mod, state = _lowered(readme_desc, "auto")  # the README's first command: the GGUF's Q4_1, int8 activations
    seen, missing = _check_module(mod, state.target, TUNED)
    assert seen.get("attention_cpu", 0) >= 1 and seen.get("default:attention_cpu", 0) == 1, (seen, missing)
    # qkv, o, gate|up, down and the lm-head: each the template default (no record left to apply)
    assert seen.get("default:gemv_qvnni_cpu", 0) >= 5 and seen.get("gemv_qvnni_cpu", 0) == 0, (seen, missing)
    # the prefill GEMMs (symbolic M, one variant per bucket)
    assert seen.get("gemm_qvnni_cpu", 0) >= 4, (seen, missing)
    # the embedding gathers have no knob, so no record: the template default (and the decode attention
    # and GEMVs)
    assert all("_take_" in name or "attention_decode" in name or "gemv_qvnni_cpu" in name for name in missing), missing


def test_bf16_model_uses_committed_half_records_and_rejects_changed_structure(readme_desc):
    from tvm import tirx

    from perfx_compiler.passes._half_panels import half_panel_matmul
    from perfx_compiler.schedule import schedule_func
    from perfx_compiler.schedule_template import find_template
    from schedules._matmul import panel_width

    mod, state = _lowered(readme_desc, "bf16")
    target = state.target
    seen, missing = _check_module(mod, target, TUNED)
    # SmolLM2's 5 prefill GEMMs are built from their records (buckets 16-256); the committed records
    # of the 4 decode GEMMs (M=1) and of every M=1 bucket were timed warm before cold timing: stale,
    # so the decode GEMMs get the template default until retuned.
    assert seen.get("gemm_half_cpu", 0) >= 5 and seen.get("stale-bucket:gemm_half_cpu", 0) >= 5, (seen, missing)
    assert seen.get("stale:gemm_half_cpu", 0) >= 4, (seen, missing)
    # A workload whose structure changed (here: the same GEMM over f16 instead of bf16 panels,
    # same template and dims) has another key: no record applies, the template default does.
    db = _committed(target.name)
    func = half_panel_matmul([1, tirx.Var("seq", "int64"), 576], 576, 576, panel_width(target), "f16")
    template, wl = find_template(func, target)
    assert template.name == "gemm_half_cpu" and db.for_workload(wl.key, wl.target_key) == []
    _, name, config = schedule_func(func, target, db)
    assert name == "gemm_half_cpu" and config == template.default_config(wl, target)
