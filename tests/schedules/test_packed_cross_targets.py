"""arm64-neon and riscv64-rvv: the packed GEMM/GEMV spaces follow the target description (vector
width from ``vector_bits``: 4 fp32 lanes for 128-bit NEON and for the RVV file's VLEN 128; 32
vector registers; cores -> parallel split), and the configurations ``perfx-tune --no-measure``
picks (template defaults + cost model) build with LLVM for the cross triple into code that uses
the target's FMA instructions. Execution of whole models on these targets is covered by
tests/targets (qemu)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import tvm

from perfx_compiler.schedule_template import find_template, vector_lanes
from perfx_compiler.targets import load_target
from perfx_compiler.tune.records import TuningDatabase
from perfx_compiler.tune.session import group_tasks, predict_groups
from perfx_compiler.tune.workloads import TuningTask, packed_linear_func
from schedules._matmul import panel_width, vector_registers

FMA = {"arm64-neon": ("fmla",), "riscv64-rvv": ("vfmacc", "vfmadd")}


def _asm(func, target) -> str:
    ex = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target.tvm())
    return ex.mod.inspect_source("asm")


@pytest.mark.parametrize("name", ["arm64-neon", "riscv64-rvv"])
def test_spaces_follow_the_target_description(name):
    target = load_target(name)
    lanes = vector_lanes(target)
    assert lanes == target.vector_bits // 32 == 4
    assert vector_registers(target) == 32
    nb = panel_width(target)
    func = packed_linear_func(None, 576, 960, nb)
    template, wl = find_template(func, target)
    assert template.name == "gemm_cpu" and wl.info["nb"] == nb
    space = template.space(wl, target)
    assert all(nr % lanes == 0 and nb % nr == 0 for nr in space["nr"])
    default = template.default_config(wl, target)
    assert template.is_valid(wl, default, target)
    # All accumulators of the default micro-tile + one B vector per column fit the 32 registers.
    assert default["mr"] * default["nr"] // lanes + default["nr"] // lanes + 1 <= 32
    gemv = packed_linear_func(1, 576, 960, nb)
    gt, gwl = find_template(gemv, target)
    assert gt.name == "gemv_cpu" and all(nc % lanes == 0 for nc in gt.space(gwl, target)["nc"])


@pytest.mark.parametrize("name", ["arm64-neon", "riscv64-rvv"])
def test_no_measure_picks_build_for_the_cross_target(name, tmp_path: Path):
    target = load_target(name)
    nb = panel_width(target)
    funcs = {"gemm": packed_linear_func(None, 576, 1536, nb), "gemv": packed_linear_func(1, 1536, 576, nb)}
    tasks = []
    for fname, func in funcs.items():
        template, wl = find_template(func, target)
        for m in ((16, 64) if wl.symbolic else (1,)):
            tasks.append(TuningTask(fname, func, template, wl, m))
    db = TuningDatabase(tmp_path / name / "x.jsonl")
    from perfx_compiler.tune.cost_model import CostModel

    model = CostModel()  # untrained: --no-measure then writes the template defaults
    assert predict_groups(group_tasks(tasks), target, db, model) == len(tasks)
    picks = {(t.name, t.bucket): db.best(t.workload.key, t.workload.target_key, t.bucket).config for t in tasks}
    # ... and a couple of other points of each space, so more than the default is known to build.
    rng = random.Random(3)
    for fname, func in funcs.items():
        template, wl = find_template(func, target)
        space = template.space(wl, target)
        combos = [{k: rng.choice(v) for k, v in space.items()} for _ in range(40)]
        picks.update({(fname, f"sample{i}"): c for i, c in enumerate([c for c in combos if template.is_valid(wl, c, target)][:2])})
    for (fname, _), config in picks.items():
        func = funcs[fname]
        template, wl = find_template(func, target)
        asm = _asm(template.apply(func, wl, config, target), target)
        assert any(op in asm for op in FMA[name]), (name, fname, config)
