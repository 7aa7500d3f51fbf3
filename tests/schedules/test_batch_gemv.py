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


# (format, N, K): K=192 at g128 is one whole group and a ragged half group (8 lanes); N=200 and 104
# leave the row tile at 1 or 2 rows per task; 576 is SmolLM2's width
TAILS = [("q4_g128", 200, 192), ("Q4_1", 104, 320), ("Q4_0", 576, 576), ("q4_sym_g32", 96, 256)]


def _tail_weights(fmt: str, n: int, k: int, rng: np.random.Generator):
    from perfx_compiler.formats.gguf_blocks import Q4_0, Q4_1
    from perfx_compiler.formats.int4 import Int4Format, dequantize_int4, int4_packed, quantize_int4

    if fmt == "Q4_1":
        codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
        d = (rng.random((n, k // 32)) * 0.01 + 1e-3).astype(np.float16)
        mn = (-rng.random((n, k // 32)) * 0.08).astype(np.float16)
        idx = np.arange(k) // 32
        return int4_packed(codes, d, mn, Q4_1), codes * d.astype(np.float64)[:, idx] + mn.astype(np.float64)[:, idx]
    f = {"Q4_0": Q4_0, "q4_sym_g32": Int4Format(32, True), "q4_g128": Int4Format(128, False)}[fmt]
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    codes, scale, zero = quantize_int4(w, f)
    return int4_packed(codes, scale, zero, f), dequantize_int4(codes, scale, zero, f.group).astype(np.float64)


@pytest.mark.parametrize("unpack_once", [1, 0])
@pytest.mark.parametrize("fmt,n,k", TAILS)
def test_multi_row_gemv_matches_numpy(cpu_target, fmt, n, k, unpack_once):
    """Static M = 1..8 (decode of M rows) and the symbolic batch at 1..8 rows, each weight unpacked
    once for all rows (unpack_once=1, the default from M = 2) or once per row (0), against float64
    numpy on fresh codes and inputs, with ragged groups and row tiles."""
    import tvm

    from perfx_compiler.tune.measure import build_func

    rng = np.random.default_rng()
    pk, wd = _tail_weights(fmt, n, k, rng)
    dev = tvm.cpu()
    packed = [tvm.runtime.tensor(a, dev) for _, a in pk.arrays]

    def check(rt, x):
        out = tvm.runtime.tensor(np.full(x.shape[:2] + (n,), np.nan, np.float32), dev)
        rt["main"](tvm.runtime.tensor(x, dev), *packed, out)
        want = x.astype(np.float64) @ wd.T
        err = np.abs(out.numpy() - want).max()
        assert err <= 1e-5 * np.abs(want).max(), (fmt, x.shape, unpack_once, err)

    for m in range(1, 9):
        func = pk.compute("matmul", (1, m))
        template, wl = _template(func, cpu_target)
        config = template.builtin_default(wl, cpu_target)
        assert config.get("unpack_once") == (1 if m > 1 else None), config
        if m > 1:
            config["unpack_once"] = unpack_once
        rt = build_func(template.apply(func, wl, config, cpu_target), cpu_target)
        check(rt, rng.standard_normal((1, m, k)).astype(np.float32))
    func = pk.compute("matmul", (None, 1))
    template, wl = _template(func, cpu_target)
    config = {**template.builtin_default(wl, cpu_target), "unpack_once": unpack_once}
    rt = build_func(template.apply(func, wl, config, cpu_target), cpu_target)
    for batch in (1, 3, 8, 11):  # 11: a second chunk of rows, 3 of them past the batch
        check(rt, rng.standard_normal((batch, 1, k)).astype(np.float32))


def test_space_enumerates_the_per_row_kernel_once(cpu_target):
    """'chunk' only shapes the unpack-once kernel: the tuner's enumeration of a symbolic-batch GEMV
    holds each unpack-once chunk and a single per-row candidate per task count (no re-measuring
    one kernel under three chunk values)."""
    import random

    from perfx_compiler.tune.search import enumerate_space
    from perfx_compiler.tune.workloads import TuningTask

    pk, _ = _weights("Q4_1", np.random.default_rng(0))
    func = pk.compute("matmul", (None, 1))
    template, wl = _template(func, cpu_target)
    configs = enumerate_space(TuningTask("q4_gemv_batch", func, template, wl, 1), cpu_target, random.Random(0))
    space = template.space(wl, cpu_target)
    per_row = [c for c in configs if c["unpack_once"] == 0]
    once = [c for c in configs if c["unpack_once"] == 1]
    assert len(per_row) == len(space["tasks"]), per_row
    assert len(once) == len(space["tasks"]) * len(space["chunk"]), once
    assert template.builtin_default(wl, cpu_target) in configs
