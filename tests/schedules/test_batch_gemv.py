"""The int4/int8 GEMV kernels over a symbolic batch of single rows (``paged_decode``'s x [B, 1, K],
B bound at run time) equal x @ W^T in float64 numpy for every format, on fresh random codes and
inputs, at batch sizes 1, 3 and 8 of one compiled kernel."""

from __future__ import annotations

import numpy as np
import pytest

from tests.schedules.test_packed_dequant import K, N, _template, _weights

FORMATS = ["Q4_0", "Q4_1", "Q8_0", "q4_sym_g32", "q4_g128"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_batched_gemv_matches_numpy(cpu_target, fmt):
    import tvm

    from perfx_compiler.tune.measure import build_func

    rng = np.random.default_rng()
    pk, wd = _weights(fmt, rng)
    func = pk.compute("matmul", (None, 1))
    template, wl = _template(func, cpu_target)
    assert wl.info.get("batch"), wl.info  # the batched regime, not the many-row refusal
    sched = template.apply(func, wl, template.builtin_default(wl, cpu_target), cpu_target)
    rt = build_func(sched, cpu_target)
    dev = tvm.cpu()
    packed = [tvm.runtime.tensor(a, dev) for _, a in pk.arrays]
    for batch in (1, 3, 8):
        x = rng.standard_normal((batch, 1, K)).astype(np.float32)
        out = tvm.runtime.tensor(np.full((batch, 1, N), np.nan, np.float32), dev)
        rt["main"](tvm.runtime.tensor(x, dev), *packed, out)
        want = x.astype(np.float64) @ wd.T
        err = np.abs(out.numpy() - want).max()
        assert err <= 1e-5 * np.abs(want).max(), (fmt, batch, err)
