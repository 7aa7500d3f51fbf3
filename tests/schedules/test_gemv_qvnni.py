"""The VNNI (int8-activation) kernels of ``schedules/gemv_qvnni_cpu.py`` on fresh random weights.

Each GEMV runs against two numpy references:

* the same int8 activation quantization (``formats.vnni.quantize_activations``) times the float64
  dequantized weights: the kernel's integer dots are exact, only float32 sums differ -> 1e-5
  of max |y|;
* the float activations: the error is bounded by |w| . |x - xq| <= sum_k |w_k| amax_g(k) / 254
  (rounding to nearest moves each x by at most half a step dx = amax/127), checked per output.
"""

from __future__ import annotations

import numpy as np
import pytest
from sched_helpers import int8_rounding_slack, needs_vnni, prologue_x, vnni_weights

from perfx_compiler.formats.gguf_blocks import Q4_1
from perfx_compiler.formats.vnni import (
    pack_q4_pairs,
    pack_q8_offset,
    q4_vnni_packed,
    quantize_activations,
    unpack_q4_pairs,
    unpack_q8_offset,
)
from perfx_compiler.schedule_template import ScheduleConfigError
from perfx_compiler.targets import load_target
from perfx_compiler.tune.measure import build_func


@pytest.fixture(scope="module")
def template():
    from schedules.gemv_qvnni_cpu import TEMPLATE

    return TEMPLATE


def _run(template, target, packed, wd, rows, config, rng, group):
    func = packed.compute("matmul", rows)
    wl = template.match(func, target)
    assert wl is not None
    sched = template.apply(func, wl, config, target)
    rt = build_func(sched, target)
    import tvm

    dev = tvm.cpu()
    x = rng.standard_normal((*rows, packed.k)).astype(np.float32)
    x[..., :32] *= 20.0  # one loud group: per-group scales must not leak across groups
    y = tvm.runtime.tensor(np.zeros((*rows, packed.n), np.float32), dev)
    rt["main"](tvm.runtime.tensor(x, dev), *[tvm.runtime.tensor(a, dev) for _, a in packed.arrays], y)
    got = y.numpy().astype(np.float64)
    ref_q = quantize_activations(x, packed.k, group) @ wd.T
    assert np.abs(got - ref_q).max() <= 1e-5 * np.abs(ref_q).max(), config
    # float activations: the rigorous bound of the module docstring (+ float32 slack)
    xp = np.abs(x.astype(np.float64))
    ng = -(-packed.k // group)
    pad = np.zeros((*rows, ng * group))
    pad[..., : packed.k] = xp
    amax = pad.reshape(*rows, ng, group).max(-1)
    step = np.repeat(amax, group, axis=-1)[..., : packed.k] / 254.0
    bound = step @ np.abs(wd).T
    ref_f = x.astype(np.float64) @ wd.T
    assert np.all(np.abs(got - ref_f) <= bound * 1.001 + 1e-5 * np.abs(ref_f).max()), config
    assert np.abs(got - ref_f).max() > 0  # int8 activations really are in use
    return sched


CASES = [
    ("Q4_1", 96, 576), ("Q4_0", 70, 1536), ("q8", 50, 576), ("g128", 64, 576), ("g64s", 33, 1536),
    ("g32", 130, 4096),
]


@needs_vnni
@pytest.mark.parametrize("fmt,n,k", CASES)
def test_gemv_matches_int8_reference_over_configs(template, target, fmt, n, k):
    rng = np.random.default_rng()  # fresh weights and inputs every run
    packed, wd = vnni_weights(fmt, n, k, rng)
    group = {"q8": 32, "Q4_1": 32, "Q4_0": 32, "g128": 128, "g64s": 64, "g32": 32}[fmt]
    wl = template.match(packed.compute("matmul", (1, 1)), target)
    space = template.space(wl, target)
    assert all(len(space[k]) > 1 for k in ("units", "tasks", "unroll", "prefetch"))
    configs = [template.default_config(wl, target), {"units": 1, "tasks": 3, "unroll": max(1, group // 64)},
               {"units": 4, "tasks": 16, "unroll": 8 if group <= 64 else 2, "prefetch": 16},
               # split accumulators / masked high nibble each on their own (the default takes both)
               {"units": 2, "tasks": 5, "unroll": max(1, group // 64), "split": 2, "hinib": 0},
               {"units": 1, "tasks": 2, "unroll": max(1, group // 64), "split": 1, "hinib": 1, "prefetch": 16},
               # scale/zero prefetch (an uneven 3 tasks, and 4)
               {"units": 1, "tasks": 3, "unroll": max(1, group // 64), "prefetch": 16, "sprefetch": 1},
               {"units": 2, "tasks": 4, "unroll": max(1, group // 64), "prefetch": 128, "sprefetch": 1},
               # x quantized by every row task for itself (2 tasks, and an uneven 3)
               {"units": 1, "tasks": 2, "unroll": max(1, group // 64), "prefetch": 128, "sprefetch": 1, "tquant": 1},
               {"units": 2, "tasks": 3, "unroll": max(1, group // 64), "tquant": 1}]
    for config in configs:
        if template.is_valid(wl, config, target):
            _run(template, target, packed, wd, (1, 1), config, rng, group)
    # batched decode rows (1 x 3) share the weight loads
    _run(template, target, packed, wd, (1, 3), {"units": 1, "tasks": 4, "unroll": max(1, group // 64)}, rng, group)
    _run(template, target, packed, wd, (1, 3), {"units": 1, "tasks": 4, "unroll": max(1, group // 64),
                                                "sprefetch": 1, "prefetch": 64}, rng, group)
    _run(template, target, packed, wd, (1, 3), {"units": 1, "tasks": 2, "unroll": max(1, group // 64), "tquant": 1},
         rng, group)


@needs_vnni
def test_generated_code_uses_vpdpbusd(template, target):
    import tvm

    packed, _ = vnni_weights("Q4_1", 64, 576, np.random.default_rng(0))
    func = packed.compute("matmul", (1, 1))
    wl = template.match(func, target)
    sched = template.apply(func, wl, template.default_config(wl, target), target)
    ex = tvm.compile(tvm.IRModule({"main": sched.with_attr("global_symbol", "main")}), target.tvm())
    asm = ex.mod.inspect_source("asm")
    assert "vpdpbusd" in asm and "vpermps" in asm
    # hinib: the odd row's codes are masked with 0xF0, not shifted (one vector op less per step)
    base = template.apply(func, wl, {**template.default_config(wl, target), "hinib": 0}, target)
    asm0 = tvm.compile(tvm.IRModule({"main": base.with_attr("global_symbol", "main")}), target.tvm()).mod.inspect_source("asm")
    assert asm.count("vpsrlw") < asm0.count("vpsrlw")


def test_invalid_configs_are_rejected(template, target):
    packed, _ = vnni_weights("g128", 64, 576, np.random.default_rng(0))
    func = packed.compute("matmul", (1, 1))
    wl = template.match(func, target)
    for bad in ({"units": 2, "tasks": 2, "unroll": 1},  # half a group of 128 per inner loop
                {"units": 64, "tasks": 2, "unroll": 2},  # more row pairs than the weight has
                {"units": 2, "tasks": 2, "unroll": 3}):
        assert not template.is_valid(wl, bad, target)
        with pytest.raises(ScheduleConfigError):
            template.apply(func, wl, bad, target)
    rows8 = packed.compute("matmul", (1, 8))
    wl8 = template.match(rows8, target)
    with pytest.raises(ScheduleConfigError, match="accumulators"):
        template.apply(rows8, wl8, {"units": 2, "tasks": 2, "unroll": 2}, target)


def test_match_declines_targets_without_vnni(template):
    packed, _ = vnni_weights("Q4_1", 64, 576, np.random.default_rng(0))
    func = packed.compute("matmul", (1, 1))
    for name in ("x86-avx2", "arm64-neon", "riscv64-rvv", "cuda-sm80"):
        assert template.match(func, load_target(name)) is None
    # and the fp32 int4 template declines the VNNI layout everywhere
    from schedules.gemv_int4_cpu import TEMPLATE as OLD

    assert OLD.match(func, load_target("x86-avx512")) is None


def test_layouts_round_trip_bit_exact():
    rng = np.random.default_rng()
    for n, k in ((7, 96), (8, 64), (5, 576)):
        codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
        packed = pack_q4_pairs(codes)
        assert packed.shape == ((n + 1) // 2, -(-k // 64) * 64)
        assert np.array_equal(unpack_q4_pairs(packed, n, k), codes)
        c8 = rng.integers(-127, 128, (n, k)).astype(np.int8)
        assert np.array_equal(unpack_q8_offset(pack_q8_offset(c8), k), c8)
    codes = rng.integers(0, 16, (6, 576)).astype(np.uint8)
    d = rng.random((6, 18)).astype(np.float16)
    pk = q4_vnni_packed(codes, d, d, Q4_1)
    arrays = dict(pk.arrays)
    assert np.array_equal(arrays["_q4_scale"][:, :18].view(np.uint16), d.view(np.uint16))
    assert not arrays["_q4_scale"][:, 18:].any()


@needs_vnni
@pytest.mark.parametrize("fmt", ["Q4_1", "g128", "q8"])
def test_dequant_and_take_read_the_layout(template, target, fmt):
    import tvm

    rng = np.random.default_rng()
    packed, wd = vnni_weights(fmt, 37, 576, rng)
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(a, dev) for _, a in packed.arrays]
    for kind in ("dequant", "take"):
        func = packed.compute(kind, (None, None))
        wl = template.match(func, target)
        rt = build_func(template.apply(func, wl, template.default_config(wl, target), target), target)
        if kind == "dequant":
            out = tvm.runtime.tensor(np.zeros((37, 576), np.float32), dev)
            rt["main"](*args, out)
            np.testing.assert_allclose(out.numpy(), wd, rtol=1e-6, atol=1e-7)
        else:
            ids = np.array([[36, 0, 5]], dtype=np.int64)
            out = tvm.runtime.tensor(np.zeros((1, 3, 576), np.float32), dev)
            rt["main"](*args, tvm.runtime.tensor(ids, dev), out)
            np.testing.assert_allclose(out.numpy()[0], wd[ids[0]], rtol=1e-6, atol=1e-7)


@needs_vnni
@pytest.mark.parametrize("fmt,n,k", [("Q4_1", 40, 576), ("g128", 24, 576), ("q8", 18, 1536)])
def test_reference_func_has_kernel_semantics(template, target, fmt, n, k):
    """The tagged reference PrimFunc quantizes x like the kernel: the tuner's 1e-4 check passes,
    and both equal the numpy int8 reference."""
    from perfx_compiler.tune.measure import random_inputs, run_func

    rng = np.random.default_rng()
    packed, wd = vnni_weights(fmt, n, k, rng)
    group = {"q8": 32, "Q4_1": 32, "g128": 128}[fmt]
    func = packed.compute("matmul", (1, 2))
    wl = template.match(func, target)
    sched = template.apply(func, wl, template.default_config(wl, target), target)
    arrays = random_inputs(func, 1, seed=int(rng.integers(1 << 30)))
    arrays = [arrays[0], *[a for _, a in packed.arrays], arrays[-1]]
    want = run_func(build_func(func, target), func, [a.copy() for a in arrays])[0]
    got = run_func(build_func(sched, target), func, [a.copy() for a in arrays])[0]
    ref = quantize_activations(arrays[0], k, group) @ wd.T
    assert np.abs(want - ref).max() <= 1e-5 * np.abs(ref).max()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@needs_vnni
@pytest.mark.parametrize("fmt", ["Q4_1", "Q4_0"])
def test_tuner_measures_vnni_configs(template, target, fmt):
    """perfx-tune's measurer: candidates verified against the reference (1e-4), a bad one refused.
    Q4_0 (symmetric): the reference reads the zero array the kernel takes as 8, so the measurer pins
    it (random zeros failed every candidate of TinyLlama's GEMVs)."""
    from perfx_compiler.tune.measure import LocalMeasurer

    packed, _ = vnni_weights(fmt, 128, 576, np.random.default_rng(1))
    func = packed.compute("matmul", (1, 1))
    wl = template.match(func, target)
    measurer = LocalMeasurer(target, workers=2, build_timeout_s=120, repeat=2, min_repeat_ms=1)
    good = [template.default_config(wl, target), {"units": 1, "tasks": 4, "unroll": 8}]
    res = measurer.measure(func, template.name, wl.key, [*good, {"units": 2, "tasks": 4, "unroll": 3}], m_value=1)
    assert all(r.ok and r.extra["max_rel_error"] < 1e-5 for r in res[:2])
    assert not res[2].ok and "ScheduleConfigError" in res[2].error


@needs_vnni
def test_scale_prefetch_default_knob_and_code(template, target):
    """sprefetch defaults on for N <= 4096 only (docs/decisions/gemv-qvnni-cpu.md), --knob overrides it,
    and it really emits prefetches."""
    import dataclasses

    import tvm

    rng = np.random.default_rng(0)
    small = template.match(vnni_weights("Q4_0", 64, 576, rng)[0].compute("matmul", (1, 1)), target)
    big = template.match(vnni_weights("Q4_0", 4098, 64, rng)[0].compute("matmul", (1, 1)), target)
    assert template.builtin_default(small, target)["sprefetch"] == 1
    assert template.builtin_default(big, target)["sprefetch"] == 0
    knobbed = dataclasses.replace(target, knobs={"gemv_qvnni_cpu": {"sprefetch": 0}})
    assert template.default_config(small, knobbed)["sprefetch"] == 0
    for bad in ({"sprefetch": 2}, {"tquant": 2}):
        assert not template.is_valid(small, {**template.builtin_default(small, target), **bad}, target)
    packed, _ = vnni_weights("Q4_1", 64, 576, rng)  # Q4_1: the min stream is prefetched too
    func = packed.compute("matmul", (1, 1))
    wl = template.match(func, target)
    cfg = {"units": 1, "tasks": 2, "unroll": 1, "prefetch": 16}

    def n_prefetch(extra: dict) -> int:
        f = template.apply(func, wl, {**cfg, **extra}, target).with_attr("global_symbol", "main")
        return tvm.compile(tvm.IRModule({"main": f}), target.tvm()).mod.inspect_source("asm").count("prefetch")

    assert n_prefetch({"sprefetch": 1}) >= n_prefetch({"sprefetch": 0}) + 2  # scale and min, per chunk


@needs_vnni
def test_per_task_quantization_is_the_one_row_default(template, target):
    """One activation row: tquant=1 with a task per core, and the kernel quantizes x inside its parallel
    loop (no quantization before the fork); several rows keep 16 tasks and the caller's quantization."""
    rng = np.random.default_rng(0)
    packed, _ = vnni_weights("Q4_0", 64, 576, rng)
    one = template.match(packed.compute("matmul", (1, 1)), target)
    batched = template.match(packed.compute("matmul", (1, 3)), target)
    cfg = template.builtin_default(one, target)
    assert cfg["tquant"] == 1 and cfg["tasks"] == target.cores
    assert template.builtin_default(batched, target)["tquant"] == 0

    def quantizes_before_fork(config: dict) -> bool:
        text = template.apply(packed.compute("matmul", (1, 1)), one, config, target).script()
        return text.index("T.round(") < text.index("T.parallel(")

    assert not quantizes_before_fork(cfg)
    assert quantizes_before_fork({**cfg, "tquant": 0})


@needs_vnni
@pytest.mark.parametrize("fmt,n,k", [("Q4_1", 66, 2048), ("Q4_0", 34, 5632)])
def test_long_rows_default_is_hinib_and_matches_reference(template, target, fmt, n, k):
    """One-unit ("long") rows default to split=1, hinib=1 (docs/decisions/gemv-qvnni-cpu.md); the
    searched alternatives (split=1, hinib=0 and split=2, hinib=1) compute the same. Each against the
    numpy references on fresh weights (K=5632: a tail chunk); short rows (one unit too) keep split=2, hinib=1."""
    rng = np.random.default_rng()
    packed, wd = vnni_weights(fmt, n, k, rng)
    wl = template.match(packed.compute("matmul", (1, 1)), target)
    default = template.builtin_default(wl, target)
    assert (default["units"], default["split"], default["hinib"]) == (1, 1, 1)
    assert default["nta"] == 1  # long rows prefetch their codes with prefetchnta
    for cfg in (default, {**default, "hinib": 0}, {**default, "split": 2}):
        if cfg is default:
            import tvm

            f = template.apply(packed.compute("matmul", (1, 1)), wl, cfg, target).with_attr("global_symbol", "main")
            asm = tvm.compile(tvm.IRModule({"main": f}), target.tvm()).mod.inspect_source("asm")
            assert "prefetchnta" in asm and "prefetcht0" in asm  # codes non-temporal, scales (sprefetch) t0
        _run(template, target, packed, wd, (1, 1), cfg, rng, 32)
    # several activation rows (units drops to 1 for the accumulators at 8) keep hinib: not measured
    for rows in ((1, 2), (1, 8)):
        multi = template.builtin_default(template.match(packed.compute("matmul", rows), target), target)
        assert multi["hinib"] == 1, rows
    short = template.match(vnni_weights(fmt, 64, 576, rng)[0].compute("matmul", (1, 1)), target)
    assert {k: template.builtin_default(short, target)[k] for k in ("units", "split", "hinib", "nta")} == \
        {"units": 1, "split": 2, "hinib": 1, "nta": 0}


@needs_vnni
@pytest.mark.parametrize("prologue", ["add_rms_norm", "swiglu"])
@pytest.mark.parametrize("fmt,n,k", [("Q4_0", 70, 576), ("Q4_1", 96, 1536), ("Q8_0", 40, 576)])
def test_fused_prologue_gemv_matches_reference(template, target, prologue, fmt, n, k):
    """A GEMV with add_rms_norm or swiglu fused in front (passes/fuse_gemv_prologue.py): the default
    (each task makes and quantizes x, task 0 stores a + b) and x made on the calling thread (tquant 0)
    both multiply with the int8 quantization of the float64 prologue's x, and return a + b exactly; the
    workload is keyed as the plain GEMV of its shape (its tuning records apply)."""
    import tvm

    from perfx_compiler.formats.vnni import vnni_compute

    rng = np.random.default_rng()
    packed, wd = vnni_weights(fmt, n, k, rng)
    args = (n, k, 32, 8 if fmt == "Q8_0" else 4, fmt != "Q4_1", fmt == "Q4_1", "matmul", (1, 1))
    func = vnni_compute(*args, prologue=prologue, eps=1e-5)
    wl = template.match(func, target)
    plain = template.match(vnni_compute(*args).with_attr("op_pattern", 8), target)
    assert wl.key == plain.key and wl.info["prologue"] == prologue
    default = template.default_config(wl, target)
    assert default["tquant"] == 1
    if prologue == "swiglu":
        inputs = [(rng.standard_normal((1, 1, 2 * k)) * 3).astype(np.float32)]
    else:
        inputs = [rng.standard_normal((1, 1, k)).astype(np.float32) for _ in range(2)]
        inputs.append((1 + 0.3 * rng.standard_normal(k)).astype(np.float32))
    x = prologue_x(prologue, inputs, k)
    ref = quantize_activations(x, k, 32) @ wd.T
    slack = int8_rounding_slack(x, wd, 32)
    dev = tvm.cpu()
    for cfg in (default, {**default, "tquant": 0, "tasks": 4}):
        rt = build_func(template.apply(func, wl, cfg, target), target)
        tensors = [tvm.runtime.tensor(v, dev) for v in inputs] + [tvm.runtime.tensor(a, dev) for _, a in packed.arrays]
        total = tvm.runtime.tensor(np.zeros((1, 1, k), np.float32), dev)
        y = tvm.runtime.tensor(np.zeros((1, 1, n), np.float32), dev)
        rt["main"](*tensors, *([total] if prologue == "add_rms_norm" else []), y)
        assert (np.abs(y.numpy()[0, 0] - ref[0, 0]) <= 1e-5 * np.abs(ref).max() + slack).all(), cfg
        if prologue == "add_rms_norm":
            assert np.array_equal(total.numpy(), inputs[0] + inputs[1]), cfg


@needs_vnni
@pytest.mark.parametrize("prologue", ["", "add_rms_norm"])
@pytest.mark.parametrize("fmt,n,k", [("Q4_0", 136, 576), ("Q4_1", 192, 1536), ("Q8_0", 84, 576)])
def test_swiglu_epilogue_gemv_matches_reference(template, target, prologue, fmt, n, k):
    """A gate|up GEMV with the swiglu epilogue (passes/fuse_gemv_prologue.py): each task takes the same
    range of gate and up rows, so y must still be the plain GEMV's and h = silu(gate) * up of that y,
    for the default (one task per core), an uneven task count, x quantized on the calling thread and two
    units per iteration; keyed as the plain GEMV. F = n/2 rows per half, not a multiple of 16 for Q4_0
    and Q8_0 (a short last chunk of h)."""
    import tvm

    from perfx_compiler.formats.vnni import vnni_compute

    rng = np.random.default_rng()
    packed, wd = vnni_weights(fmt, n, k, rng)
    args = (n, k, 32, 8 if fmt == "Q8_0" else 4, fmt != "Q4_1", fmt == "Q4_1", "matmul", (1, 1))
    func = vnni_compute(*args, prologue=prologue, eps=1e-5, epilogue="swiglu")
    wl = template.match(func, target)
    plain = template.match(vnni_compute(*args).with_attr("op_pattern", 8), target)
    assert wl.key == plain.key and wl.info["epilogue"] == "swiglu"
    default = template.default_config(wl, target)
    if prologue:
        inputs = [rng.standard_normal((1, 1, k)).astype(np.float32) for _ in range(2)]
        inputs.append((1 + 0.3 * rng.standard_normal(k)).astype(np.float32))
        x = prologue_x(prologue, inputs, k)
    else:
        inputs = [rng.standard_normal((1, 1, k)).astype(np.float32)]
        x = inputs[0]
    ref = quantize_activations(x, k, 32) @ wd.T
    slack = int8_rounding_slack(x, wd, 32) if prologue else 0.0
    f = n // 2
    dev = tvm.cpu()
    configs = [default, {**default, "tasks": 3}, {**default, "tquant": 0, "tasks": 4}, {**default, "units": 2}]
    for cfg in configs:
        assert template.is_valid(wl, cfg, target), cfg
        rt = build_func(template.apply(func, wl, cfg, target), target)
        tensors = [tvm.runtime.tensor(v, dev) for v in inputs] + [tvm.runtime.tensor(a, dev) for _, a in packed.arrays]
        total = tvm.runtime.tensor(np.zeros((1, 1, k), np.float32), dev)
        y = tvm.runtime.tensor(np.zeros((1, 1, n), np.float32), dev)
        h = tvm.runtime.tensor(np.full((1, 1, f), np.nan, np.float32), dev)
        rt["main"](*tensors, *([total] if prologue else []), y, h)
        yv = y.numpy()
        assert (np.abs(yv[0, 0] - ref[0, 0]) <= 1e-5 * np.abs(ref).max() + slack).all(), cfg
        g, u = yv[..., :f].astype(np.float64), yv[..., f:].astype(np.float64)
        want = g / (1 + np.exp(-g)) * u
        herr = np.abs(h.numpy() - want).max() / np.abs(want).max()
        assert herr < 1e-5, (cfg, herr)
    assert not template.is_valid(wl, {**default, "units": n}, target)


@pytest.mark.parametrize("vendor,want", [("GenuineIntel", (0, 2)), ("AuthenticAMD", (1, 3)), ("", (1, 3))])
def test_host_vendor_picks_the_prefetch_locality(template, monkeypatch, vendor, want):
    """`host` takes targets/x86-avx512.json's vendor_templates for its CPU vendor: on Intel the long-row
    decode GEMVs prefetch their codes into L2 (ploc 2, no nta; docs/decisions/gemv-qvnni-cpu.md), elsewhere non-temporally as before. A --knob still wins, and
    a tuning record without `ploc` is built with the target's."""
    import dataclasses

    import tvm

    from perfx_compiler import targets

    monkeypatch.setattr(targets, "_detect_host", lambda: "x86-avx512")
    monkeypatch.setattr(targets, "_cpu_vendor", lambda: vendor)
    host = targets.load_target("host")
    assert host.raw["cpu_vendor"] == vendor
    rng = np.random.default_rng()
    packed, _ = vnni_weights("Q4_0", 34, 2048, rng)
    func = packed.compute("matmul", (1, 1))
    wl = template.match(func, host)
    cfg = template.default_config(wl, host)
    assert (cfg["nta"], cfg["ploc"]) == want
    knobbed = dataclasses.replace(host, knobs={"gemv_qvnni_cpu": {"nta": 1, "ploc": 3}})
    assert (template.default_config(wl, knobbed)["nta"], template.default_config(wl, knobbed)["ploc"]) == (1, 3)
    if vendor == "GenuineIntel":
        record = {k: v for k, v in cfg.items() if k not in ("ploc", "nta")}
        f = template.apply(func, wl, record, host).with_attr("global_symbol", "main")
        asm = tvm.compile(tvm.IRModule({"main": f}), host.tvm()).mod.inspect_source("asm")
        assert "prefetcht1" in asm and "prefetchnta" not in asm
    assert not template.is_valid(wl, {**cfg, "ploc": 4}, host)


@needs_vnni
def test_l2_prefetch_gemv_matches_reference(template, target):
    """The codes prefetched into L2 (ploc 2) or L3 (1): the same numbers as any other config."""
    rng = np.random.default_rng()
    packed, wd = vnni_weights("Q4_0", 34, 2048, rng)
    base = template.builtin_default(template.match(packed.compute("matmul", (1, 1)), target), target)
    for ploc in (1, 2):
        _run(template, target, packed, wd, (1, 1), {**base, "nta": 0, "ploc": ploc}, rng, 32)
