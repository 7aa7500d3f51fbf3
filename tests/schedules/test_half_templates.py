"""gemv_half_cpu: half-weight GEMV / dequantize / gather / bf16 rounding kernels against numpy on
fresh random inputs, for several shapes and configurations of the template's space."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from sched_helpers import sample_configs

from perfx_compiler.formats.half import from_half, half_compute, round_act, to_half
from perfx_compiler.schedule_template import ScheduleConfigError
from perfx_compiler.tune.measure import build_func
from schedules.gemv_half_cpu import TEMPLATE

SHAPES = [(576, 576), (1536, 576), (576, 1536), (192, 576)]  # SmolLM2's linears (N, K) and a small one


def run(rt, *arrays):
    dev = tvm.cpu()
    ts = [tvm.runtime.tensor(a, dev) for a in arrays]
    rt["main"](*ts)
    return ts[-1].numpy()


def gemv_reference(x: np.ndarray, h: np.ndarray, family: str, act: str) -> np.ndarray:
    return round_act(x, act).astype(np.float64) @ from_half(h, family).astype(np.float64).T


def scheduled(func, target, config=None):
    wl = TEMPLATE.match(func, target)
    assert wl is not None
    cfg = TEMPLATE.default_config(wl, target) if config is None else config
    return TEMPLATE.apply(func, wl, cfg, target), wl


@pytest.mark.parametrize("family, act", [("bf16", "f32"), ("f16", "f32"), ("bf16", "bf16")])
@pytest.mark.parametrize("n, k", SHAPES)
def test_gemv_matches_numpy_over_configs(cpu_target, family, act, n, k):
    rng = np.random.default_rng()
    func = half_compute(n, k, family, "matmul", (1, 1), act)
    wl = TEMPLATE.match(func, cpu_target)
    for cfg in sample_configs(TEMPLATE, wl, cpu_target, 2, seed=int(rng.integers(1 << 30))):
        rt = build_func(TEMPLATE.apply(func, wl, cfg, cpu_target), cpu_target)
        h = to_half(rng.standard_normal((n, k)).astype(np.float32), family)
        x = rng.standard_normal((1, 1, k)).astype(np.float32)
        got = run(rt, x, h, np.zeros((1, 1, n), np.float32))
        want = gemv_reference(x, h, family, act)
        err = rel(got, want)
        assert err < 2e-6, (cfg, err)  # fp32 accumulation of exact products
        if act == "bf16":  # the input rounding is really there: the unrounded product is far off
            assert rel(got, gemv_reference(x, h, family, "f32")) > 20 * max(err, 1e-7)


@pytest.mark.parametrize("rows", [(1, 3), (2, 4)])
def test_gemv_several_rows(cpu_target, rows):
    rng = np.random.default_rng()
    n, k = 576, 576
    func = half_compute(n, k, "bf16", "matmul", rows, "bf16")
    s, _ = scheduled(func, cpu_target)
    rt = build_func(s, cpu_target)
    h = to_half(rng.standard_normal((n, k)).astype(np.float32), "bf16")
    x = rng.standard_normal((*rows, k)).astype(np.float32)
    got = run(rt, x, h, np.zeros((*rows, n), np.float32))
    assert rel(got, gemv_reference(x, h, "bf16", "bf16")) < 2e-6


@pytest.mark.parametrize("family", ["bf16", "f16"])
def test_dequant_and_take_are_exact(cpu_target, family):
    rng = np.random.default_rng()
    n, k = 1536, 576
    h = to_half(rng.standard_normal((n, k)).astype(np.float32), family)
    wl = TEMPLATE.match(half_compute(n, k, family, "dequant", (None, None)), cpu_target)
    for cfg in [{"tasks": t} for t in TEMPLATE.space(wl, cpu_target)["tasks"][:3]]:
        s, _ = scheduled(half_compute(n, k, family, "dequant", (None, None)), cpu_target, cfg)
        np.testing.assert_array_equal(run(build_func(s, cpu_target), h, np.zeros((n, k), np.float32)),
                                      from_half(h, family))
    for ids_dtype in ("int64", "int32"):
        s, _ = scheduled(half_compute(n, k, family, "take", (1, None), ids_dtype=ids_dtype), cpu_target)
        ids = rng.integers(0, n, size=(1, 9)).astype(ids_dtype)
        got = run(build_func(s, cpu_target), h, ids, np.zeros((1, 9, k), np.float32))
        np.testing.assert_array_equal(got, from_half(h, family)[ids])


def test_round_kernel_matches_numpy_bit_for_bit(cpu_target):
    rng = np.random.default_rng()
    s, _ = scheduled(half_compute(1, 576, "f16", "round", (None, None), act="bf16"), cpu_target)
    rt = build_func(s, cpu_target)
    for m in (1, 7, 33):
        x = (rng.standard_normal((1, m, 576)) * 10.0 ** rng.integers(-5, 5, (1, m, 576))).astype(np.float32)
        np.testing.assert_array_equal(run(rt, x, np.zeros_like(x)), round_act(x, "bf16"))


def test_wrong_configs_are_rejected(cpu_target):
    func = half_compute(576, 576, "bf16", "matmul", (1, 1))
    wl = TEMPLATE.match(func, cpu_target)
    for bad in ({"tasks": 7, "rows": 1, "accum": 1}, {"tasks": 2, "rows": 5, "accum": 1},
                {"tasks": 1, "rows": 1, "accum": 5}, {"tasks": 1, "rows": 8, "accum": 4}):
        assert not TEMPLATE.is_valid(wl, bad, cpu_target)
        with pytest.raises(ScheduleConfigError):
            TEMPLATE.apply(func, wl, bad, cpu_target)


def test_only_half_functions_match(cpu_target):
    from perfx_compiler.formats.int8 import int8_matmul_compute

    assert TEMPLATE.match(int8_matmul_compute(64, 64, 32), cpu_target) is None
    assert TEMPLATE.match(half_compute(64, 64, "f16", "round", (None, None), act="f16"), cpu_target) is None
    many = half_compute(64, 64, "bf16", "matmul", (None, None))  # prefill rows go to dequant + GEMM
    assert TEMPLATE.match(many, cpu_target) is None


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())
