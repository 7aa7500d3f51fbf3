"""The VNNI int8 GEMM (``schedules/gemm_qvnni_cpu.py``, prefill) on the GGUF superblock layouts of
``formats/vnni.py`` (K-quants and IQ4_XS: int8 group values times a float16 d per 256 columns, G = 16
or 32; Q5_1 / Q5_K: unsigned int8 codes with a min): fresh random weights of each type
(``test_vnni_superblocks.fake_subscaled``) against x quantized to int8 per group (Q6_K: per 256-column
superblock, as llama.cpp's Q8_K) times the float64 weights. The integer dots are exact; float32 group
sums and scale products stay within 2e-5 of max |y| (a wrong group, superblock d or min is of order 1e-2 and more)."""

from __future__ import annotations

import numpy as np
import pytest
from sched_helpers import needs_vnni
from test_vnni_superblocks import TYPES, fake_subscaled

from perfx_compiler.formats.vnni import quantize_activations, subscaled_vnni_packed
from perfx_compiler.tune.measure import build_func


@pytest.fixture(scope="module")
def template():
    from schedules.gemm_qvnni_cpu import TEMPLATE

    return TEMPLATE


@needs_vnni
@pytest.mark.parametrize("qtype", sorted(TYPES))
@pytest.mark.parametrize("n,k,rows,m", [(64, 512, (1, 37), 37), (48, 2304, (1, None), 70)])
def test_gemm_matches_int8_reference(template, target, qtype, n, k, rows, m):
    import tvm

    rng = np.random.default_rng()
    sub, w = fake_subscaled(qtype, n, k, rng)
    pk = subscaled_vnni_packed(sub, qtype)
    func = pk.compute("matmul", rows)
    wl = template.match(func, target)
    assert pk.int8_gemm  # prefill of these weights is routed to the GEMM (passes/_quantized_linears)
    assert wl is not None and wl.dims["G"] == sub.group
    assert wl.symbolic == (None if rows[1] else "M")
    configs = [template.default_config(wl, target), {"mr": 6, "nr": 1, "tasks": 3}]
    dev = tvm.cpu()
    x = rng.standard_normal((1, m, k)).astype(np.float32)
    x[..., :32] *= 20.0  # one loud group: per-group scales must not leak across groups
    # Q6_K: x quantized per superblock (llama.cpp's Q8_K; the GEMM's epilogue per superblock), else per group
    ref = quantize_activations(x, k, sub.sb if qtype == "Q6_K" else sub.group) @ w.astype(np.float64).T
    for cfg in configs:
        assert template.is_valid(wl, cfg, target), cfg
        rt = build_func(template.apply(func, wl, cfg, target), target)
        y = tvm.runtime.tensor(np.zeros((1, m, n), np.float32), dev)
        rt["main"](tvm.runtime.tensor(x, dev), *[tvm.runtime.tensor(a, dev) for _, a in pk.arrays], y)
        err = np.abs(y.numpy() - ref).max()
        assert err <= 2e-5 * np.abs(ref).max(), (qtype, cfg, err / np.abs(ref).max())
        if rows[1] is None:  # two rows alone give the bits they get among 70 (a decode step's rows)
            y2 = tvm.runtime.tensor(np.zeros((1, 2, n), np.float32), dev)
            rt["main"](tvm.runtime.tensor(x[:, :2].copy(), dev), *[tvm.runtime.tensor(a, dev) for _, a in pk.arrays], y2)
            assert np.array_equal(y2.numpy(), y.numpy()[:, :2]), (qtype, cfg)


def test_prepacked_declines_superblocks():
    """The benchmark-only compile-time repack takes float16 group scales only."""
    from schedules.gemm_qvnni_cpu import kernel, prepack

    sub, _ = fake_subscaled("Q4_K", 32, 512, np.random.default_rng(0))
    pk = subscaled_vnni_packed(sub, "Q4_K")
    with pytest.raises(ValueError, match="superblock"):
        kernel(4, 32, 512, 32, False, True, 4, 2, 1, prepacked=True, sb=256)
    with pytest.raises(ValueError, match="superblock"):
        prepack(4, 32, 512, 32, False, True, [a for _, a in pk.arrays], 2)
