"""Sliding-window (``window``) and soft-capped (``softcap``) attention in the CPU kernels: every body
(prefill rows and tiled, decode split with one and more chunks, paged) and the kernels the
attention_cpu template rebuilds from a variant's tag compute what a float64 numpy reference of
rotate-half RoPE + GQA attention with those semantics computes, and write the same caches; fresh
random inputs on every run. Negative controls: on the same inputs the result is far from the
reference without the window (or without the cap), so a kernel ignoring either fails.

Semantics (HF / llama.cpp): the query at position p sees keys j with p - window < j <= p (window 0:
plain causal); a score s = (q . k) / sqrt(D) becomes softcap * tanh(s / softcap) before the mask.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.schedules.test_attention_cpu import attention_reference as variant_reference
from tests.schedules.test_attention_cpu import build, rope_tables

H, KVH, D, MAXC = 4, 2, 16, 64
TOL = 1e-4  # fp32 kernel vs float64 reference, relative to the largest |value|
# With a cap, q and every key get OFFSET on the lowest-frequency RoPE dimension (rotated < 0.02 rad
# over the cache), so scores sit near OFFSET^2 / sqrt(D) = 45 (spread ~3.5) where a 30 cap's slope is
# ~0.2: capped weights are far flatter than uncapped ones. On unit-normal inputs (scores ~N(0, 1))
# the cap is near identity, and so a kernel ignoring it would pass.
OFFSET = 13.4
LOW = D // 2 - 1
CASES = [(12, 0), (1, 20), (7, 20)]  # (seq, past): the window cuts keys in each
VARIANTS = [(w, c) for w in (0, 5) for c in (0.0, 30.0)]


def _rel(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / max(1.0, np.abs(ref).max()))


def _inputs(rng: np.random.Generator, batch: int, seq: int, softcap: float,
            cache_shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """q, k, v [batch, seq, heads * D] and a k and v cache of ``cache_shape`` (D last), unit normal;
    with a cap, OFFSET added to q and the keys (new and cached) on dimension LOW of every head."""
    q = rng.standard_normal((batch, seq, H * D))
    k = rng.standard_normal((batch, seq, KVH * D))
    v = rng.standard_normal((batch, seq, KVH * D))
    kc = rng.standard_normal(cache_shape)
    vc = rng.standard_normal(cache_shape)
    if softcap:
        q[..., LOW::D] += OFFSET
        k[..., LOW::D] += OFFSET
        kc[..., LOW] += OFFSET
    return tuple(a.astype(np.float32) for a in (q, k, v, kc, vc))


def check_contiguous(lib: Any, seq: int, past: int, window: int, softcap: float, rng: np.random.Generator,
                     qkv: bool = False) -> None:
    """Run the [1, KVH, MAXC, D]-cache kernel once; out and both caches (read back from the tensors
    passed in: the in-place contract) match the variant's reference, and out is far from the
    reference without the window / without the cap (when set)."""
    import tvm

    cos, sin = rope_tables(MAXC, D)
    q, k, v, kc, vc = _inputs(rng, 1, seq, softcap, (1, KVH, MAXC, D))
    dev = tvm.cpu()
    kct, vct = tvm.runtime.tensor(kc, dev), tvm.runtime.tensor(vc, dev)
    out = tvm.runtime.tensor(np.zeros_like(q), dev)
    ins = [np.concatenate([q, k, v], -1)] if qkv else [q, k, v]
    lib["main"](*[tvm.runtime.tensor(a, dev) for a in ins], kct, vct, tvm.runtime.tensor(np.array([past], np.int64), dev),
                tvm.runtime.tensor(cos, dev), tvm.runtime.tensor(sin, dev), out)
    want, wk, wv = variant_reference(q, k, v, kc, vc, past, cos, sin, H, KVH, window, softcap)
    got = out.numpy()
    tag = f"window={window} softcap={softcap} seq={seq} past={past}"
    for name, g, w in (("out", got, want), ("k cache", kct.numpy(), wk), ("v cache", vct.numpy(), wv)):
        err = _rel(g, w)
        assert err < TOL, f"{tag}: {name} max relative error {err:.2e}"
    if window and past + seq > window:  # some query has keys outside its window
        plain = variant_reference(q, k, v, kc, vc, past, cos, sin, H, KVH, 0, softcap)[0]
        assert _rel(got, plain) > 100 * TOL, f"{tag}: the window changed nothing"
    if softcap and past + seq > 1:  # one key alone has weight 1 whatever its score
        uncapped = variant_reference(q, k, v, kc, vc, past, cos, sin, H, KVH, window, 0.0)[0]
        assert _rel(got, uncapped) > 100 * TOL, f"{tag}: the cap changed nothing"


# Bodies of kernels/attention.py, small tiles so that windows and contexts span several tiles
# (and tiled tasks hold rows whose windows start in different tiles).
BODIES = {
    "rows": {"body": "rows", "k_tile": 8, "lanes": 8},
    "tiled": {"body": "tiled", "k_tile": 8, "q_tile": 4, "heads_per_task": 2, "key_block": 2, "lanes": 16},
    "tiled_q8_h1": {"body": "tiled", "k_tile": 16, "q_tile": 8, "heads_per_task": 1, "key_block": 4, "lanes": 8},
    # key tiles shorter than a query tile: a row's window can start past a whole tile the task scores
    # (rows 20..26 from key 16: tile 16..19 is masked out entirely for rows 24..26)
    "tiled_k4_q8": {"body": "tiled", "k_tile": 4, "q_tile": 8, "heads_per_task": 2, "key_block": 4, "lanes": 16},
    "split1": {"body": "split", "k_tile": 8, "splits": 1, "lanes": 16, "prefetch": 2},
    "split3": {"body": "split", "k_tile": 4, "splits": 3, "lanes": 8, "prefetch": 0},
}
DECODE_PASTS = [0, 3, 4, 5, 20, 31, MAXC - 1]  # under, at and past the window; chunk and tile edges


@pytest.mark.parametrize("window,softcap", VARIANTS)
@pytest.mark.parametrize("body", list(BODIES))
def test_bodies_match_numpy(cpu_target, body, window, softcap) -> None:
    from perfx_compiler.kernels.attention import cached_attention_kernel

    lib = build(cached_attention_kernel(H, KVH, D, MAXC, config=BODIES[body], window=window, softcap=softcap),
                cpu_target)
    rng = np.random.default_rng()
    for seq, past in CASES:  # the split kernels take their rows body for seq > 1
        check_contiguous(lib, seq, past, window, softcap, rng)
    if BODIES[body]["body"] == "split":
        for past in DECODE_PASTS:
            check_contiguous(lib, 1, past, window, softcap, rng)


@pytest.mark.parametrize("window,softcap", VARIANTS)
@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_template_rebuilds_the_variant(template_and_target, kind, window, softcap) -> None:
    """The untuned kernel records the variant in its tag (nothing for a plain kernel), the template's
    workload carries it, and the kernels it builds for the default and other configurations compute
    the variant, on the separate and the fused QKV signature."""
    import json

    from perfx_compiler.kernels.attention import ATTR, untuned_attention_kernel
    from perfx_compiler.kernels.attention_qkv import attention_over_qkv

    template, cpu_target = template_and_target
    func = untuned_attention_kernel(kind, H, KVH, D, MAXC, window=window, softcap=softcap)
    info = json.loads(str(func.attrs[ATTR]))
    assert ("window" in info) == bool(window) and ("softcap" in info) == bool(softcap), info
    wl = template.match(func, cpu_target)
    assert wl.info.get("window", 0) == window and wl.info.get("softcap", 0.0) == softcap, wl.info
    if window or softcap:  # another function than the plain kernel: its own tuning records
        assert wl.key != template.match(untuned_attention_kernel(kind, H, KVH, D, MAXC), cpu_target).key
    rng = np.random.default_rng()
    lib = build(func, cpu_target)  # the untuned (rows) kernel itself
    for seq, past in CASES:
        check_contiguous(lib, seq, past, window, softcap, rng)
    default = template.builtin_default(wl, cpu_target)
    configs = [default, {**default, "k_tile": 16}]
    if kind == "prefill":
        configs.append({**default, "q_tile": 4, "k_tile": 16, "heads_per_task": 1})
    else:
        configs.append({**default, "splits": 4, "k_tile": 16})
    for cfg in configs:
        lib = build(template.apply(func, wl, cfg, cpu_target), cpu_target)
        for seq, past in CASES:
            check_contiguous(lib, seq, past, window, softcap, rng)
    qfunc = attention_over_qkv(func)
    assert qfunc is not None
    qwl = template.match(qfunc, cpu_target)
    assert qwl.info["qkv"] and qwl.info.get("window", 0) == window
    lib = build(template.apply(qfunc, qwl, default, cpu_target), cpu_target)
    for seq, past in CASES:
        check_contiguous(lib, seq, past, window, softcap, rng, qkv=True)


@pytest.fixture(scope="module")
def template_and_target(cpu_target):
    from perfx_compiler.schedule_template import template_by_name

    return template_by_name("attention_cpu"), cpu_target


@pytest.mark.parametrize("window,softcap", VARIANTS)
def test_paged_variant_matches_numpy(cpu_target, window, softcap) -> None:
    """Two sequences at different positions, 4-slot pages scattered in the pools (the window crosses
    pages); each sequence's output and pages equal the contiguous reference of the variant."""
    import tvm

    from perfx_compiler.kernels.paged_attention import paged_attention_kernel

    ps = 4
    npp = MAXC // ps
    lib = build(paged_attention_kernel(H, KVH, D, MAXC, ps, window=window, softcap=softcap), cpu_target)
    rng = np.random.default_rng()
    cos, sin = rope_tables(MAXC, D)
    dev = tvm.cpu()
    for seq, positions in ((12, [0, 9]), (1, [20, 3]), (7, [20, 41])):
        pages = 2 * npp + 3
        table = rng.permutation(pages)[: 2 * npp].reshape(2, npp).astype(np.int64)
        q, k, v, kp, vp = _inputs(rng, 2, seq, softcap, (pages, ps, KVH, D))
        kpt, vpt, out = (tvm.runtime.tensor(a, dev) for a in (kp, vp, np.zeros_like(q)))
        lib["main"](*(tvm.runtime.tensor(a, dev) for a in (q, k, v)), kpt, vpt,
                    *(tvm.runtime.tensor(a, dev) for a in (np.array(positions, np.int64), table, cos, sin)), out)
        got_k, got_v, got = kpt.numpy(), vpt.numpy(), out.numpy()
        for b, past in enumerate(positions):
            def contiguous(pool: np.ndarray, b: int = b, table: np.ndarray = table) -> np.ndarray:
                return pool[table[b]].reshape(1, MAXC, KVH, D).transpose(0, 2, 1, 3)  # the sequence's cache

            args = (q[b : b + 1], k[b : b + 1], v[b : b + 1], contiguous(kp), contiguous(vp), past, cos, sin, H, KVH)
            want, wk, wv = variant_reference(*args, window, softcap)
            tag = f"paged window={window} softcap={softcap} seq={seq} b={b} past={past}"
            for name, g, w in (("out", got[b : b + 1], want), ("k pages", contiguous(got_k), wk),
                               ("v pages", contiguous(got_v), wv)):
                err = _rel(g, w)
                assert err < TOL, f"{tag}: {name} max relative error {err:.2e}"
            if window and past + seq > window:  # some query has keys outside its window
                assert _rel(got[b : b + 1], variant_reference(*args, 0, softcap)[0]) > 100 * TOL, tag
            if softcap and past + seq > 1:
                assert _rel(got[b : b + 1], variant_reference(*args, window, 0.0)[0]) > 100 * TOL, tag


def test_negative_window_or_cap_is_rejected() -> None:
    from perfx_compiler.kernels.attention import cached_attention_kernel
    from perfx_compiler.kernels.paged_attention import paged_attention_kernel

    with pytest.raises(ValueError):
        cached_attention_kernel(H, KVH, D, MAXC, window=-1)
    with pytest.raises(ValueError):
        cached_attention_kernel(H, KVH, D, MAXC, softcap=-1.0)
    with pytest.raises(ValueError):
        paged_attention_kernel(H, KVH, D, MAXC, 4, window=-1)
