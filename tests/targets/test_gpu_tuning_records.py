"""The committed ``--no-measure`` records of the GPU targets (``tuning_logs/<target>/``) are the ones
``perfx-compile --target T`` reads: they load, carry the target's current key (a changed target file
would orphan them) and name GPU templates with configurations those templates accept."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.targets
GPU_TARGETS = ["cuda-sm80", "cuda-sm90", "rocm-gfx942", "rocm-gfx1100", "adreno", "mali", "intel-igpu", "vulkan"]


@pytest.mark.parametrize("name", GPU_TARGETS)
def test_committed_gpu_records_apply_to_the_target(name: str) -> None:
    from perfx_compiler.schedule_template import target_key
    from perfx_compiler.targets import load_target
    from perfx_compiler.tune.records import default_records
    from schedules import discover

    target = load_target(name)
    db = default_records(name)
    assert db is not None, f"no tuning_logs/{name}/ records"
    records = db.records()
    assert len(records) >= 30
    assert {r.target_key for r in records} == {target_key(target)}, "records made for another target description"
    templates = {t.name: t for t in discover()}
    for r in records:
        assert r.template.startswith("gpu_") and r.template in templates, r.template
        assert r.source in ("predicted", "measured")
        assert 1 <= int(r.config["max_threads"]) <= int(target.max_threads_per_block or 1024)
