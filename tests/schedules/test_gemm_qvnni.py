"""The VNNI int8-activation GEMM of ``schedules/gemm_qvnni_cpu.py`` (prefill) on fresh random weights.

Each GEMM runs against two numpy references:

* exactly its own arithmetic: x quantized to int8 per row and weight group
  (``formats.vnni.quantize_activations``) times the float64 dequantized weights. The integer dots are
  exact; only the float32 group sums and the float32 scale products differ -> 2e-6 of max |y|
  (observed ~3e-7; a wrong group, scale or nibble gives errors of order 1e-2 and more);
* float activations: the error is bounded by |w| . |x - xq| <= sum_k |w_k| amax_g(k) / 254
  (rounding to nearest moves each x by at most half a step dx = amax/127), checked per output.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from sched_helpers import needs_vnni, vnni_weights

from perfx_compiler.formats.vnni import quantize_activations
from perfx_compiler.schedule_template import ScheduleConfigError
from perfx_compiler.targets import load_target
from perfx_compiler.tune.measure import build_func

GROUP = {"q8": 32, "Q8_0": 32, "Q4_1": 32, "Q4_0": 32, "g128": 128, "g64s": 64, "g32": 32}


@pytest.fixture(scope="module")
def template():
    from schedules.gemm_qvnni_cpu import TEMPLATE

    return TEMPLATE


def _check(got: np.ndarray, x: np.ndarray, wd: np.ndarray, k: int, group: int, what: object) -> None:
    got = got.astype(np.float64)
    ref_q = quantize_activations(x, k, group) @ wd.T
    assert np.abs(got - ref_q).max() <= 2e-6 * np.abs(ref_q).max(), what
    xp = np.abs(x.astype(np.float64))
    lead = x.shape[:-1]
    ng = -(-k // group)
    pad = np.zeros((*lead, ng * group))
    pad[..., :k] = xp
    step = np.repeat(pad.reshape(*lead, ng, group).max(-1), group, axis=-1)[..., :k] / 254.0
    bound = step @ np.abs(wd).T
    ref_f = x.astype(np.float64) @ wd.T
    assert np.all(np.abs(got - ref_f) <= bound * 1.001 + 2e-6 * np.abs(ref_f).max()), what
    assert np.abs(got - ref_f).max() > 0  # int8 activations really are in use


def _run(rt, packed, x, n_out=None):
    import tvm

    dev = tvm.cpu()
    y = tvm.runtime.tensor(np.zeros((*x.shape[:-1], n_out or packed.n), np.float32), dev)
    rt["main"](tvm.runtime.tensor(x, dev), *[tvm.runtime.tensor(a, dev) for _, a in packed.arrays], y)
    return y.numpy()


CASES = [("Q4_1", 96, 576), ("Q4_0", 80, 1536), ("Q8_0", 48, 576), ("g128", 64, 576), ("g64s", 32, 1536),
         ("g32", 144, 4096)]


@needs_vnni
@pytest.mark.parametrize("fmt,n,k", CASES)
def test_gemm_matches_int8_reference_over_configs(template, target, fmt, n, k):
    rng = np.random.default_rng()  # fresh weights and inputs every run
    packed, wd = vnni_weights(fmt, n, k, rng)
    group = GROUP[fmt]
    func = packed.compute("matmul", (1, None))  # prefill: rows symbolic
    wl = template.match(func, target)
    assert wl is not None and wl.symbolic == "M"
    space = template.space(wl, target)
    assert all(len(space[knob]) > 1 for knob in ("mr", "nr", "tasks"))
    configs = [template.default_config(wl, target), {"mr": 1, "nr": 1, "tasks": 3},
               {"mr": 6, "nr": 2, "tasks": 2}, {"mr": 8, "nr": 1, "tasks": 16}]
    for config in configs:
        assert template.is_valid(wl, config, target), config
        rt = build_func(template.apply(func, wl, config, target), target)
        for m in (1, 3, 9, 37):  # 1, 3: decode steps of few sequences; 37 = 4 x 9 + 1 and 6 x 6 + 1 rows
            x = rng.standard_normal((1, m, k)).astype(np.float32)
            x[..., :32] *= 20.0  # one loud group: per-group scales must not leak across groups
            _check(_run(rt, packed, x), x, wd, k, group, (config, m))


@needs_vnni
@pytest.mark.parametrize("fmt", ["Q4_1", "Q4_0", "g128"])
def test_each_row_equals_its_rows_alone(template, target, fmt):
    """A row's output does not depend on the rows beside it, bit for bit (a served sequence's text must not
    depend on whether it was alone in a decode step): m rows at once (whole tiles of mr and one-row tail
    tiles) give each row exactly what that row gives alone, and rows in threes the same as in the call of 11."""
    rng = np.random.default_rng()
    packed, wd = vnni_weights(fmt, 64, 576, rng)
    func = packed.compute("matmul", (1, None))
    wl = template.match(func, target)
    for config in (template.default_config(wl, target), {"mr": 6, "nr": 2, "tasks": 2}):
        rt = build_func(template.apply(func, wl, config, target), target)
        x = rng.standard_normal((1, 11, 576)).astype(np.float32)
        together = _run(rt, packed, x)
        alone = np.concatenate([_run(rt, packed, x[:, i:i + 1]) for i in range(11)], axis=1)
        assert np.array_equal(together, alone), (config, np.abs(together - alone).max())
        threes = np.concatenate([_run(rt, packed, x[:, i:i + 3]) for i in range(0, 11, 3)], axis=1)
        assert np.array_equal(together, threes), (config, np.abs(together - threes).max())


@needs_vnni
def test_static_rows_above_gemv_and_batch_dim(template, target):
    """Static rows > 8 (and a leading batch dim > 1) go to the GEMM too."""
    rng = np.random.default_rng()
    packed, wd = vnni_weights("Q4_1", 64, 576, rng)
    func = packed.compute("matmul", (2, 12))
    wl = template.match(func, target)
    assert wl is not None and wl.symbolic is None
    rt = build_func(template.apply(func, wl, template.default_config(wl, target), target), target)
    x = rng.standard_normal((2, 12, 576)).astype(np.float32)
    _check(_run(rt, packed, x), x, wd, 576, 32, "2x12")
    assert template.match(packed.compute("matmul", (1, 8)), target) is None  # decode: the GEMV's


@needs_vnni
@pytest.mark.parametrize("fmt", ["Q4_1", "Q4_0", "Q8_0", "g128"])
def test_prepacked_panels_give_the_same_result(template, target, fmt):
    """The compile-time repack variant (``prepack`` + ``prepacked=True``) = the in-call repack, bit for bit."""
    import tvm

    from schedules.gemm_qvnni_cpu import kernel, prepack

    rng = np.random.default_rng()
    n, k = 80, 576  # 5 tiles: with nr = 2 the last block overlaps the one before it
    packed, wd = vnni_weights(fmt, n, k, rng)
    func = packed.compute("matmul", (1, None))
    wl = template.match(func, target)
    d, info = wl.dims, wl.info
    config = {"mr": 4, "nr": 2, "tasks": 2}
    args = (d["bits"], n, k, d["G"], info["sym"], info["offset"])
    rt_a = build_func(template.apply(func, wl, config, target), target)
    rt_b = build_func(kernel(*args, 4, 2, 2, prepacked=True), target)
    pre = prepack(*args, [a for _, a in packed.arrays], 2)
    x = rng.standard_normal((1, 21, k)).astype(np.float32)
    dev = tvm.cpu()
    y = tvm.runtime.tensor(np.zeros((1, 21, n), np.float32), dev)
    rt_b["main"](tvm.runtime.tensor(x, dev), *[tvm.runtime.tensor(a, dev) for a in pre], y)
    a = _run(rt_a, packed, x)
    assert np.array_equal(a, y.numpy())
    _check(a, x, wd, k, GROUP[fmt], fmt)


@needs_vnni
def test_generated_code_uses_vpdpbusd(template, target):
    import tvm

    packed, _ = vnni_weights("Q4_0", 64, 576, np.random.default_rng(0))
    func = packed.compute("matmul", (1, None))
    wl = template.match(func, target)
    sched = template.apply(func, wl, template.default_config(wl, target), target)
    ex = tvm.compile(tvm.IRModule({"main": sched.with_attr("global_symbol", "main")}), target.tvm())
    asm = ex.mod.inspect_source("asm")
    assert asm.count("vpdpbusd") >= 16  # mr x nr x 2 nibbles per step, unrolled over the group
    assert "{1to16}" in asm or "vpbroadcastd" in asm  # activation dwords broadcast, no gathers


def test_invalid_configs_are_rejected_and_targets_declined(template, target):
    packed, _ = vnni_weights("g128", 64, 576, np.random.default_rng(0))
    func = packed.compute("matmul", (1, None))
    wl = template.match(func, target)
    for bad in ({"mr": 8, "nr": 2, "tasks": 2},  # 32 accumulators + 4 weight vectors
                {"mr": 2, "nr": 5, "tasks": 2},  # 5 tiles of 16 > 64 columns
                {"mr": 0, "nr": 1, "tasks": 2}):
        assert not template.is_valid(wl, bad, target)
        with pytest.raises(ScheduleConfigError):
            template.apply(func, wl, bad, target)
    for name in ("x86-avx2", "arm64-neon", "riscv64-rvv", "cuda-sm80"):
        assert template.match(func, load_target(name)) is None
    odd, _ = vnni_weights("Q4_0", 40, 576, np.random.default_rng(0))  # N not a multiple of 16
    assert template.match(odd.compute("matmul", (1, None)), target) is None


@needs_vnni
@pytest.mark.parametrize("fmt,n,k", [("Q4_1", 160, 576), ("Q4_0", 128, 1536), ("Q8_0", 96, 576)])
def test_swiglu_epilogue_is_silu_gate_times_up(template, target, fmt, n, k):
    """``epilogue="swiglu"`` (passes/fuse_gemm_swiglu.py): the output is h = silu(gate) * up of the plain
    GEMM's y = [gate | up], up to the polynomial sigmoid's ~1e-7 (a wrong block pairing or scratch row
    gives order 1); keyed as the plain GEMM (its records apply); nr is bounded by h's tiles, not y's.
    n = 160: h has 5 tiles, so nr = 2 overlaps the last block."""
    from perfx_compiler.formats.vnni import vnni_compute
    from perfx_compiler.kernels.tir_queries import OPAQUE

    rng = np.random.default_rng()
    packed, _ = vnni_weights(fmt, n, k, rng)
    # (opaque to FuseOps, as the passes add every kernel: the record keys hash that)
    plain = packed.compute("matmul", (1, None)).with_attr("op_pattern", OPAQUE)
    q = json.loads(str(plain.attrs["perfx.quant"]))
    fused = vnni_compute(n, k, q["group"], q["bits"], q["sym"], q["offset"], "matmul", (1, None), epilogue="swiglu",
                         sb=q.get("sb", 0), lut=q.get("lut", ""))
    assert len(fused.params) == len(plain.params)  # h replaces y: no y output
    wl, wl_plain = template.match(fused, target), template.match(plain, target)
    assert wl.key == wl_plain.key and wl.info["epilogue"] == "swiglu"
    assert not template.is_valid(wl, {"mr": 4, "nr": n // 32 + 1, "tasks": 2}, target)
    rt_y = build_func(template.apply(plain, wl_plain, {"mr": 4, "nr": 2, "tasks": 2}, target), target)
    f = n // 2
    for config in (template.default_config(wl, target), {"mr": 4, "nr": 2, "tasks": 2}, {"mr": 1, "nr": 1, "tasks": 3},
                   {"mr": 6, "nr": 2, "tasks": 2}):
        assert template.is_valid(wl, config, target), config
        rt_h = build_func(template.apply(fused, wl, config, target), target)
        for m in (1, 5, 37):
            x = rng.standard_normal((1, m, k)).astype(np.float32)
            y = _run(rt_y, packed, x).astype(np.float64)
            ref = y[..., :f] / (1 + np.exp(-y[..., :f])) * y[..., f:]
            err = np.abs(_run(rt_h, packed, x, f) - ref).max() / np.abs(ref).max()
            assert err < 1e-6, (config, m, err)
