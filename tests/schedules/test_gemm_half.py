"""gemm_half_cpu: f16/bf16 weights in compile-time half panels [N / nb, K, nb], widened in
registers. The kernel against numpy (float64) on fresh random inputs, per format, for prefill
(symbolic rows, ragged against mr) and decode (static rows) shapes and several configurations of
the space; and a tiny model compiled with ``--quantization bf16 | f16``: its linears read the half
panels (no per-call float dequantize left) and its logits match the float64 reference run on the
half-rounded weights."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from sched_helpers import sample_configs
from tvm import tirx

from perfx_compiler.formats.half import from_half, to_half
from perfx_compiler.formats.panels import pack_weight
from perfx_compiler.passes._half_panels import half_panel_matmul
from perfx_compiler.schedule_template import ScheduleConfigError
from perfx_compiler.tune.measure import build_func
from schedules._matmul import panel_width
from schedules.gemm_half_cpu import TEMPLATE

SHAPES = [(576, 576), (3072, 576), (576, 1536), (192, 320)]  # SmolLM2's linears (N, K) and a small one


def _run(sched, target, x, wp, n):
    rt = build_func(sched, target)
    dev = tvm.cpu()
    y = tvm.runtime.tensor(np.full((*x.shape[:-1], n), np.nan, np.float32), dev)
    rt["main"](tvm.runtime.tensor(x, dev), tvm.runtime.tensor(wp, dev), y)
    return y.numpy()


@pytest.mark.parametrize("family", ["bf16", "f16"])
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("rows", [None, 1, 3])  # None: symbolic (prefill), run at 1 and 37 rows
def test_gemm_half_matches_numpy_over_configs(cpu_target, family, n, k, rows):
    rng = np.random.default_rng()  # fresh inputs every run
    nb = panel_width(cpu_target)
    m = tirx.Var("m", "int64") if rows is None else rows
    func = half_panel_matmul([1, m, k], n, k, nb, family)
    wl = TEMPLATE.match(func, cpu_target)
    assert wl is not None and wl.info["b_half"] == family and wl.info["nb"] == nb
    assert (wl.symbolic == "M") == (rows is None)
    h = to_half(rng.standard_normal((n, k)).astype(np.float32), family)
    wp = pack_weight(h, nb)
    wd = from_half(h, family).astype(np.float64)
    configs = [TEMPLATE.default_config(wl, cpu_target)]
    configs += sample_configs(TEMPLATE, wl, cpu_target, 2, seed=int(rng.integers(1 << 30)))
    for cfg in configs:
        sched = TEMPLATE.apply(func, wl, cfg, cpu_target)
        for count in ([1, 37] if rows is None else [rows]):
            x = rng.standard_normal((1, count, k)).astype(np.float32)
            got = _run(sched, cpu_target, x, wp, n)
            want = x.astype(np.float64) @ wd.T
            err = np.abs(got - want).max() / np.abs(want).max()
            # exact fp32 products of widened halves, fp32 sums: only the summation order differs (a wrong
            # widening or tile is off by > 1e-3)
            assert err < 1e-5, (family, n, k, count, cfg, err)


def test_wrong_configs_are_rejected(cpu_target):
    nb = panel_width(cpu_target)
    func = half_panel_matmul([1, tirx.Var("m", "int64"), 576], 576, 576, nb, "bf16")
    wl = TEMPLATE.match(func, cpu_target)
    good = TEMPLATE.builtin_default(wl, cpu_target)
    lanes = cpu_target.vector_bits // 32
    bad = [dict(good, nr=lanes * 3), dict(good, nc=nb * 5), dict(good, k_unroll=7), dict(good, mr=40)]
    for cfg in bad:
        assert not TEMPLATE.is_valid(wl, cfg, cpu_target), cfg
        with pytest.raises(ScheduleConfigError):
            TEMPLATE.apply(func, wl, cfg, cpu_target)
    decode = half_panel_matmul([1, 1, 576], 576, 576, nb, "bf16")
    wd = TEMPLATE.match(decode, cpu_target)
    assert not TEMPLATE.is_valid(wd, dict(TEMPLATE.builtin_default(wd, cpu_target), mr=4), cpu_target)


def test_float_matmuls_do_not_match(cpu_target):
    from tvm import te

    x = te.placeholder((1, tirx.Var("m", "int64"), 64), "float32", name="x")
    w = te.placeholder((1, 64, 64), "float32", name="w")
    r = te.reduce_axis((0, 64), name="k")
    y = te.compute((1, x.shape[1], 64), lambda b, i, j: te.sum(x[b, i, r] * w[j // 64, r, j % 64], axis=r))
    assert TEMPLATE.match(te.create_prim_func([x, w, y]), cpu_target) is None


@pytest.mark.parametrize("family", ["bf16", "f16"])
def test_tiny_model_reads_half_panels(tmp_path, family):
    from perfx_compiler.model.description import ModelDescription
    from perfx_compiler.pipeline import compile_model, lower_model
    from perfx_compiler.runtime.engine import Engine
    from tests.passes.conftest import max_rel_err, tiny_desc

    seed = int(np.random.default_rng().integers(1 << 20))
    mod, state = lower_model(tiny_desc(hidden=128, ffn=256, tied=True, seed=seed), "host", quantization=family)
    nb = panel_width(state.target)
    names = [gv.name_hint for gv, _ in mod.functions_items()]
    assert any(n.startswith(f"{family}_gemm_") and n.endswith("_panels") for n in names), names
    assert any(n.startswith(f"{family}_gemv_") and n.endswith("_panels") for n in names), names
    # the vocabulary (96) is no multiple of nb: the tied embedding / lm_head keeps its row kernels;
    # every other linear weight is stored as half panels and has no dequantize left
    dequants = [n for n in names if n.startswith(f"{family}_dequant_")]
    assert dequants and all(n.startswith(f"{family}_dequant_96_") for n in dequants), dequants
    packed = [a for n, a in state.weights.items() if n.endswith(f"_{family}") and a.ndim == 3]
    assert packed and all(a.shape[2] == nb and a.dtype.itemsize == 2 for a in packed)

    desc = tiny_desc(hidden=128, ffn=256, tied=True, seed=seed)  # the pipeline consumes its description
    art = compile_model(desc, "host", tmp_path / "art", progress=False, quantization=family)
    rounded = {name: (from_half(to_half(w, family), family) if w.ndim == 2 else w) for name, w in desc.weights.items()}
    # prefill, decode steps and prefill_all (every row through the GEMM) against float64
    assert max_rel_err(Engine(art), ModelDescription(config=desc.config, weights=rounded, source="half")) < 1e-3
