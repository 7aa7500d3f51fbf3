"""Every CPU template vs numpy on fresh random inputs, over shapes and configurations of its space.

Symbolic-M functions run at M = 1, 7, 33, 130 (tails of every tile size); configurations are
the default plus a seeded sample of the space, so a template that breaks for some knob fails here.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import tvm
from sched_helpers import (
    check_func,
    elementwise_reference,
    linear_reference,
    rmsnorm_reference,
    sample_configs,
)

from perfx_compiler.schedule_template import (
    ScheduleConfigError,
    find_template,
    registered_templates,
)
from perfx_compiler.tune.workloads import (
    elementwise_module,
    linear_module,
    matmul_func,
    rmsnorm_module,
    single_func,
)

SYMBOLIC_MS = [1, 7, 33, 130]


def test_registry_order_and_names():
    names = [t.name for t in registered_templates()]
    order = ["gemv_cpu", "gemm_cpu", "reduction_cpu", "elementwise_cpu", "fallback_cpu"]
    assert set(order) <= set(names)
    assert [names.index(n) for n in order] == sorted(names.index(n) for n in order)
    assert all(names.index("fallback_cpu") > names.index(n) for n in names if n.endswith("_cpu") and n != "fallback_cpu")


@pytest.mark.parametrize(
    ("M", "K", "N", "epilogue", "nt"),
    [
        (None, 64, 192, "silu_mul", False),  # pipeline order: weights transposed [K, N]
        (None, 96, 128, "add", True),  # FuseTransposeMatmul first: NT_matmul, weights [N, K]
        (None, 48, 96, None, True),
        (24, 64, 64, "bias", False),  # static M not a multiple of most mr: pad path
        (32, 32, 64, None, False),  # static M divisible: register accumulator path
    ],
)
def test_gemm_cpu(cpu_target, M, K, N, epilogue, nt):
    func = matmul_func(linear_module(M, K, N, epilogue, nt))
    template, workload = find_template(func, cpu_target)
    assert template.name == "gemm_cpu"
    assert workload.symbolic == ("M" if M is None else None)
    ms = SYMBOLIC_MS if M is None else [M]
    for i, config in enumerate(sample_configs(template, workload, cpu_target, 2, seed=K + N)):
        scheduled = template.apply(func, workload, config, cpu_target)
        ref = functools.partial(linear_reference, func, epilogue=epilogue)
        check_func(scheduled, func, cpu_target, ms, lambda a, ref=ref: ref(a), seed=i)


@pytest.mark.parametrize(
    ("M", "K", "N", "epilogue", "nt"),
    [
        (1, 128, 96, None, True),
        (1, 64, 192, "silu_mul", True),
        (4, 64, 48, "bias", True),
        (1, 96, 128, None, False),
        (3, 64, 192, "add", False),
    ],
)
def test_gemv_cpu(cpu_target, M, K, N, epilogue, nt):
    func = matmul_func(linear_module(M, K, N, epilogue, nt))
    template, workload = find_template(func, cpu_target)
    assert template.name == "gemv_cpu"
    for i, config in enumerate(sample_configs(template, workload, cpu_target, 3, seed=K * N)):
        scheduled = template.apply(func, workload, config, cpu_target)
        ref = functools.partial(linear_reference, func, epilogue=epilogue)
        check_func(scheduled, func, cpu_target, [M], lambda a, ref=ref: ref(a), seed=i)


@pytest.mark.parametrize("M", [None, 1, 5])
def test_reduction_cpu_rmsnorm(cpu_target, M):
    func = single_func(rmsnorm_module(M, hidden=96))
    template, workload = find_template(func, cpu_target)
    assert template.name == "reduction_cpu"
    for i, config in enumerate(sample_configs(template, workload, cpu_target, 3, seed=3)):
        scheduled = template.apply(func, workload, config, cpu_target)
        check_func(scheduled, func, cpu_target, SYMBOLIC_MS if M is None else [M], rmsnorm_reference, seed=i)


def test_reduction_cpu_every_config(cpu_target):
    """The whole (small) space: chunk == lanes once vectorized the row loop by mistake."""
    func = single_func(rmsnorm_module(None, hidden=64))
    template, workload = find_template(func, cpu_target)
    space = template.space(workload, cpu_target)
    configs = [dict(zip(space, v, strict=True)) for v in itertools.product(*space.values())]
    for i, config in enumerate(c for c in configs if template.is_valid(workload, c, cpu_target)):
        scheduled = template.apply(func, workload, config, cpu_target)
        check_func(scheduled, func, cpu_target, [1, 17], rmsnorm_reference, seed=i)


@pytest.mark.parametrize(("op", "width"), [("silu_mul", 96), ("add", 64), ("take", 48)])
def test_elementwise_cpu(cpu_target, op, width):
    func = single_func(elementwise_module(None, width, op))
    template, workload = find_template(func, cpu_target)
    assert template.name == "elementwise_cpu"
    for i, config in enumerate(sample_configs(template, workload, cpu_target, 2, seed=5)):
        scheduled = template.apply(func, workload, config, cpu_target)
        check_func(
            scheduled, func, cpu_target, SYMBOLIC_MS, functools.partial(elementwise_reference, op), seed=i
        )


def test_fallback_keeps_transpose_correct(cpu_target):
    mod = linear_module(None, 32, 48, None, False)
    gv = next(g for g in mod.functions if g.name_hint == "transpose")
    func = mod[gv]
    template, _ = find_template(func, cpu_target)
    # The transpose is injective: the elementwise template takes it before the fallback.
    assert template.name in ("elementwise_cpu", "fallback_cpu")
    fallback = next(t for t in registered_templates() if t.name == "fallback_cpu")
    for tmpl in {template, fallback}:
        wl = tmpl.match(func, cpu_target)
        scheduled = tmpl.apply(func, wl, tmpl.default_config(wl, cpu_target), cpu_target)
        check_func(scheduled, func, cpu_target, [1], lambda a: a[0].T.copy())


def test_invalid_config_raises(cpu_target):
    func = matmul_func(linear_module(None, 64, 96, None, False))
    template, workload = find_template(func, cpu_target)
    with pytest.raises(ScheduleConfigError):
        template.apply(func, workload, {"mr": 4, "nr": 24, "nc": 48, "parallel": "n"}, cpu_target)
    with pytest.raises(ScheduleConfigError):
        template.apply(func, workload, {"mr": 4, "nr": 32, "nc": 64, "parallel": "sideways"}, cpu_target)


def test_broken_schedule_is_detected(cpu_target):
    """The checker must catch a wrong kernel: accumulator initialised to 0.5 instead of 0."""
    func = matmul_func(linear_module(None, 64, 96, None, False))
    template, workload = find_template(func, cpu_target)
    good = template.apply(func, workload, template.default_config(workload, cpu_target), cpu_target)
    text = good.script()
    assert "T.float32(0.0)" in text
    broken = tvm.script.from_source(text.replace("T.float32(0.0)", "T.float32(0.5)"))
    ref = functools.partial(linear_reference, func, epilogue=None)
    check_func(good, func, cpu_target, [7], ref)
    with pytest.raises(AssertionError, match="relative error"):
        check_func(broken, func, cpu_target, [7], ref)


def test_declines_foreign_targets(cpu_target):
    from dataclasses import replace

    gpu = replace(cpu_target, family="gpu", tvm_target={"kind": "cuda", "arch": "sm_80"})
    func = matmul_func(linear_module(None, 64, 96, None, False))
    cpu_templates = [t for t in registered_templates() if t.name.endswith("_cpu")]
    assert cpu_templates and all(t.match(func, gpu) is None for t in cpu_templates)


def test_workload_key_tracks_structure_and_target(cpu_target):
    from dataclasses import replace

    f1 = matmul_func(linear_module(None, 64, 96, None, False))
    f2 = matmul_func(linear_module(None, 64, 96, None, False))
    f3 = matmul_func(linear_module(None, 64, 128, None, False))

    def key(f, t):
        return find_template(f, t)[1].key

    assert key(f1, cpu_target) == key(f2, cpu_target)
    assert key(f1, cpu_target) != key(f3, cpu_target)
    other = replace(cpu_target, name="x86-other", tvm_target={**cpu_target.tvm_target, "mcpu": "haswell"})
    assert key(f1, cpu_target) != key(f1, other)


@pytest.mark.parametrize("op", ["silu_mul", "gelu_tanh_mul"])
def test_fast_activations_accuracy_over_range(cpu_target, op):
    import numpy as np

    from perfx_compiler.kernels.fastmath import fast_activations

    func = single_func(elementwise_module(None, 64, op))
    fast = fast_activations(func)
    assert "sigmoid" not in fast.script() and "tanh" not in fast.script()

    from perfx_compiler.tune.measure import build_func, random_inputs, run_func

    rt = build_func(fast, cpu_target)
    arrays = random_inputs(func, 33, seed=int(np.random.default_rng().integers(1 << 30)))
    arrays[0][0, :16] *= 40.0  # spans the clamp at +-88 and both exp tails
    arrays[0][0, 16:24] *= 1e-4  # tanh near 0, where (1 - e) cancels
    got = run_func(rt, func, [a.copy() for a in arrays])[0]
    x, u = arrays[0].astype(np.float64), arrays[1].astype(np.float64)
    if op == "silu_mul":
        want = x / (1 + np.exp(-x)) * u
    else:
        want = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))) * u
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-6
    # elementwise too, where fp32 itself can hold the value (past |x| ~ 3, GELU's 1 + tanh cancels
    # in any fp32 form): an error scaled to the biggest value would hide a wrong sign on the small ones
    small = (np.abs(x) < 3) & (np.abs(want) > 0)
    assert (np.abs(got - want)[small] / np.abs(want)[small]).max() < 1e-3


def test_target_file_defaults_override_builtin(cpu_target):
    from dataclasses import replace

    func = matmul_func(linear_module(None, 64, 192, None, False))
    template, wl = find_template(func, cpu_target)
    tuned = replace(cpu_target, templates={"gemm_cpu": {"mr": 6, "nr": 32, "nc": 96}})
    config = template.default_config(wl, tuned)
    assert (config["mr"], config["nr"], config["nc"]) == (6, 32, 96)
    bad = replace(cpu_target, templates={"gemm_cpu": {"nr": 24}})  # not in this workload's space
    assert template.default_config(wl, bad) == template.default_config(wl, cpu_target)


@pytest.mark.parametrize(("M", "K", "N", "epilogue"), [(1, 128, 96, None), (3, 64, 192, "silu_mul")])
def test_gemv_cpu_split_k(cpu_target, M, K, N, epilogue):
    func = matmul_func(linear_module(M, K, N, epilogue, False))
    template, workload = find_template(func, cpu_target)
    lanes = 16 if cpu_target.vector_bits >= 512 else 8
    for i, (splits, k_block) in enumerate([(1, 1), (2, 4), (4, 2), (8, 8)]):
        config = {"kernel": "splitk", "nr": 2 * lanes, "nc": N, "k_outer": True, "splits": splits, "k_block": k_block}
        assert template.is_valid(workload, config, cpu_target)
        scheduled = template.apply(func, workload, config, cpu_target)
        ref = functools.partial(linear_reference, func, epilogue=epilogue)
        check_func(scheduled, func, cpu_target, [M], lambda a, ref=ref: ref(a), seed=i)


LAST_TOKEN_LOGITS = '''
@T.prim_func(private=True, s_tir=True)
def main(x: T.Buffer((T.int64(1), "T.min(T.int64(9223372036854775807), seq) - T.min(T.max(seq - T.int64(1), T.int64(0)), seq)", T.int64(64)), "float32"), w: T.Buffer((T.int64(96), T.int64(64)), "float32"), seq: T.int64, NT_matmul: T.Buffer((T.int64(1), T.min(T.int64(9223372036854775807), seq) - T.min(T.max(seq - T.int64(1), T.int64(0)), seq), T.int64(96)), "float32")):
    T.func_attr({"op_pattern": 4, "tirx.noalias": True})
    for i0, i1, i2, k in T.grid(T.int64(1), T.min(T.int64(9223372036854775807), seq) - T.min(T.max(seq - T.int64(1), T.int64(0)), seq), T.int64(96), T.int64(64)):
        with T.sblock("NT_matmul"):
            v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
            with T.init():
                NT_matmul[v_i0, v_i1, v_i2] = T.float32(0.0)
            NT_matmul[v_i0, v_i1, v_i2] = NT_matmul[v_i0, v_i1, v_i2] + x[v_i0, v_i1, v_k] * w[v_i2, v_k]
'''


def test_last_token_logits_expression_extent(cpu_target):
    """The prefill lm_head of the pipeline: M is an expression of seq that equals 1, and seq is
    an explicit scalar parameter. It must go to the GEMV template and run for any seq."""
    func = tvm.script.from_source(LAST_TOKEN_LOGITS)
    template, workload = find_template(func, cpu_target)
    assert template.name == "gemv_cpu" and workload.dims["M"] == 1
    for i, config in enumerate(sample_configs(template, workload, cpu_target, 2, seed=1)):
        scheduled = template.apply(func, workload, config, cpu_target)
        # arrays: x [1, 1, 64], w [96, 64], seq (scalar), out
        check_func(scheduled, func, cpu_target, [1, 9, 40], lambda a: a[0] @ a[1].T, seed=i)
