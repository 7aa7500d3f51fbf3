"""schedules/attention_cpu.py: every configuration drawn from the template's space computes RoPE +
causal GQA attention as a float64 numpy reference does, writes the new k/v into the caches it is
given (in place), for prefill from position 0 and from a non-zero cache position and for decode
at positions 1, 37 and 1000; fresh random inputs on every run."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

H, KVH, D, MAXC = 9, 3, 64, 1024  # SmolLM2-135M's attention
TOL = 2e-5  # fp32 kernel vs float64 reference, relative to the largest |value|


def rope_tables(maxc: int, d: int, theta: float = 10000.0) -> tuple[np.ndarray, np.ndarray]:
    ang = np.arange(maxc)[:, None] / theta ** (np.arange(0, d, 2) / d)[None]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def attention_reference(q, k, v, kc, vc, past, cos, sin, heads, kv_heads, window=0, softcap=0.0):
    """float64: (out [1, seq, H*D], k cache, v cache) after appending the rotated k and v; ``window`` > 0:
    keys at least that far behind a query are masked; ``softcap`` > 0: scores become c * tanh(s / c)."""
    seq, d = q.shape[1], kc.shape[-1]
    half, group = d // 2, heads // kv_heads
    c = cos[past : past + seq].astype(np.float64)[:, None]
    s = sin[past : past + seq].astype(np.float64)[:, None]

    def rot(x: np.ndarray) -> np.ndarray:
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    kc, vc = kc.astype(np.float64), vc.astype(np.float64)
    kc[0, :, past : past + seq] = rot(k[0].astype(np.float64).reshape(seq, kv_heads, d)).transpose(1, 0, 2)
    vc[0, :, past : past + seq] = v[0].astype(np.float64).reshape(seq, kv_heads, d).transpose(1, 0, 2)
    qr = rot(q[0].astype(np.float64).reshape(seq, heads, d))
    n = past + seq
    j, p = np.arange(n)[None], (past + np.arange(seq))[:, None]
    mask = j > p
    if window:
        mask |= p - j >= window
    out = np.zeros((seq, heads, d))
    for h in range(heads):
        sc = qr[:, h] @ kc[0, h // group, :n].T / np.sqrt(d)
        if softcap:
            sc = softcap * np.tanh(sc / softcap)
        sc[mask] = -np.inf
        w = np.exp(sc - sc.max(-1, keepdims=True))
        out[:, h] = (w / w.sum(-1, keepdims=True)) @ vc[0, h // group, :n]
    return out.reshape(1, seq, heads * d), kc, vc


def run_case(lib: Any, seq: int, past: int, rng: np.random.Generator, qkv: bool = False, shift: int = 0,
             shape: tuple[int, int, int, int] = (H, KVH, D, MAXC)) -> float:
    """Run the kernel on fresh inputs; max relative error of out and both caches (caches passed
    as tensors and read back from the same objects: the in-place contract). ``shift`` feeds the
    kernel a wrong position (negative control)."""
    import tvm

    H, KVH, D, MAXC = shape  # noqa: N806 (the module's names, for another model's shape)
    cos, sin = rope_tables(MAXC, D)
    q = rng.standard_normal((1, seq, H * D)).astype(np.float32)
    k = rng.standard_normal((1, seq, KVH * D)).astype(np.float32)
    v = rng.standard_normal((1, seq, KVH * D)).astype(np.float32)
    kc = rng.standard_normal((1, KVH, MAXC, D)).astype(np.float32)
    vc = rng.standard_normal((1, KVH, MAXC, D)).astype(np.float32)
    want, wk, wv = attention_reference(q, k, v, kc, vc, past, cos, sin, H, KVH)
    dev = tvm.cpu()
    kct, vct = tvm.runtime.tensor(kc, dev), tvm.runtime.tensor(vc, dev)
    out = tvm.runtime.tensor(np.zeros_like(q), dev)
    pt = tvm.runtime.tensor(np.array([past + shift], np.int64), dev)
    tabs = [tvm.runtime.tensor(cos, dev), tvm.runtime.tensor(sin, dev)]
    inputs = [np.concatenate([q, k, v], -1)] if qkv else [q, k, v]
    lib["main"](*[tvm.runtime.tensor(a, dev) for a in inputs], kct, vct, pt, *tabs, out)
    err = 0.0
    for got, ref in ((out.numpy(), want), (kct.numpy(), wk), (vct.numpy(), wv)):
        err = max(err, float(np.abs(got - ref).max() / max(1.0, np.abs(ref).max())))
    return err


def build(func: Any, target: Any) -> Any:
    import tvm

    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target.tvm())


def untuned(kind: str, qkv: bool = False) -> Any:
    from perfx_compiler.kernels.attention import untuned_attention_kernel
    from perfx_compiler.kernels.attention_qkv import attention_over_qkv

    func = untuned_attention_kernel(kind, H, KVH, D, MAXC)
    return attention_over_qkv(func) if qkv else func


def draw(space: dict[str, list], n: int, seed: int) -> list[dict[str, Any]]:
    """n distinct configurations drawn at random from the space (the corners included)."""
    rnd = random.Random(seed)
    out = [{k: v[0] for k, v in space.items()}, {k: v[-1] for k, v in space.items()}]
    while len(out) < n:
        cfg = {k: rnd.choice(v) for k, v in space.items()}
        if cfg not in out:
            out.append(cfg)
    return out


PREFILL_CASES = [(1, 0), (7, 0), (40, 0), (33, 19), (5, 700)]  # (seq, past)
DECODE_CASES = [(1, 1), (1, 37), (1, 1000), (3, 37)]  # seq 3 on the decode kernel: the general body


@pytest.fixture(scope="module")
def template():
    from perfx_compiler.schedule_template import template_by_name

    return template_by_name("attention_cpu")


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_template_matches_tagged_kernels_only(template, cpu_target, kind) -> None:
    from perfx_compiler.kernels.attention import cached_attention_kernel
    from perfx_compiler.schedule_template import find_template

    func = untuned(kind)
    wl = template.match(func, cpu_target)
    assert wl is not None and wl.info["kind"] == kind
    assert (wl.symbolic is None) == (kind == "decode")
    assert find_template(func, cpu_target)[0] is template  # first by priority
    assert template.match(cached_attention_kernel(H, KVH, D, MAXC), cpu_target) is None  # untagged
    space = template.space(wl, cpu_target)
    assert template.is_valid(wl, template.builtin_default(wl, cpu_target), cpu_target)
    assert ("splits" in space) == (kind == "decode") and ("q_tile" in space) == (kind == "prefill")
    assert not template.is_valid(wl, {**template.builtin_default(wl, cpu_target), "lanes": 3}, cpu_target)


@pytest.mark.parametrize("kind,n", [("prefill", 8), ("decode", 6)])
def test_configs_from_the_space_match_numpy(template, cpu_target, kind, n) -> None:
    func = untuned(kind)
    wl = template.match(func, cpu_target)
    rng = np.random.default_rng()
    configs = [template.builtin_default(wl, cpu_target)] + draw(template.space(wl, cpu_target), n, int(rng.integers(1 << 30)))
    cases = PREFILL_CASES if kind == "prefill" else DECODE_CASES
    for cfg in configs:
        lib = build(template.apply(func, wl, cfg, cpu_target), cpu_target)
        for seq, past in cases:
            err = run_case(lib, seq, past, rng)
            assert err < TOL, f"{kind} {cfg} seq={seq} past={past}: max relative error {err:.2e}"


@pytest.mark.parametrize("splits", [1, 2, 3])
@pytest.mark.parametrize("qkv", [False, True])
def test_decode_splits_append_and_merge_match_numpy(template, cpu_target, splits, qkv) -> None:
    """Every decode split count, on the separate and the fused QKV signature: with one split the task
    writes its heads' output directly (no partials), with more the partials are merged; in both the
    task whose chunk holds the new position appends that kv head's k/v row (the caches are checked
    too: a row appended late, twice or not at all reads wrong). Positions hit a chunk's first key, a
    tile edge and the cache's last row."""
    func = untuned("decode", qkv=qkv)
    wl = template.match(func, cpu_target)
    cfg = {**template.builtin_default(wl, cpu_target), "splits": splits, "k_tile": 16}
    lib = build(template.apply(func, wl, cfg, cpu_target), cpu_target)
    rng = np.random.default_rng()
    for past in (0, 1, 15, 16, 47, 500, MAXC - 1):
        err = run_case(lib, 1, past, rng, qkv=qkv)
        assert err < TOL, f"splits={splits} qkv={qkv} past={past}: max relative error {err:.2e}"


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_cache_prefetch_matches_numpy(template, cpu_target, splits) -> None:
    """The decode kernel prefetches cached k/v rows a few keys ahead (first rows in a prologue, the
    rest from the score loop, never past the chunk's last key): the default does, and distances
    longer than a short context, 1 and 3 all compute what the reference computes, at positions
    under, at and past the distance and at the cache's last row."""
    func = untuned("decode")
    wl = template.match(func, cpu_target)
    default = template.builtin_default(wl, cpu_target)
    assert default["prefetch"] > 0, default
    rng = np.random.default_rng()
    for prefetch in (1, 3):
        cfg = {**default, "splits": splits, "k_tile": 16, "prefetch": prefetch}
        kernel = template.apply(func, wl, cfg, cpu_target)
        assert "llvm.prefetch" in kernel.script()
        lib = build(kernel, cpu_target)
        for past in (0, 1, 2, 3, 4, 17, 500, MAXC - 1):
            err = run_case(lib, 1, past, rng)
            assert err < TOL, f"splits={splits} prefetch={prefetch} past={past}: max relative error {err:.2e}"


def test_decode_prefetch_knob(template, cpu_target) -> None:
    """``--knob attention_cpu.prefetch=0`` builds the decode kernel without a prefetch, from the default
    config and from a record (which carries no prefetch: it gets the default distance); a negative
    distance is not a valid config."""
    import dataclasses

    func = untuned("decode")
    wl = template.match(func, cpu_target)
    record = {"k_tile": 32, "splits": 2, "lanes": 16}  # a tuned decode record carries no prefetch
    assert "llvm.prefetch" in template.apply(func, wl, record, cpu_target).script()
    assert not template.is_valid(wl, {**record, "prefetch": -1}, cpu_target)
    knobbed = dataclasses.replace(cpu_target, knobs={"attention_cpu": {"prefetch": 0}})
    assert template.default_config(wl, knobbed)["prefetch"] == 0
    assert template.default_config(wl, cpu_target)["prefetch"] > 0
    with_knob = template.with_knobs(wl, record, knobbed)
    assert with_knob == {**record, "prefetch": 0}
    assert "llvm.prefetch" not in template.apply(func, wl, with_knob, knobbed).script()


@pytest.mark.parametrize("shape", [(4, 2, 8, 12), (2, 1, 4, 6), (32, 4, 64, 40)])
def test_odd_tiles_and_lanes_match_numpy(template, cpu_target, shape) -> None:
    """Tiles that are not a multiple of 16 keys and rows narrower than 16 lanes: the scores and the
    tile softmax fold 8-, 4- and 2-lane vectors (a cache of 12 or 6 positions makes the tile 12 or
    6 keys; head_dim 8 or 4 makes the vectors 8 or 4 lanes); TinyLlama's 8 query heads per kv head."""
    from perfx_compiler.kernels.attention import untuned_attention_kernel

    rng = np.random.default_rng()
    maxc = shape[3]
    for kind, cases in (("prefill", [(maxc // 2, 0), (3, maxc // 2)]), ("decode", [(1, 0), (1, maxc // 2), (1, maxc - 1)])):
        func = untuned_attention_kernel(kind, *shape)
        wl = template.match(func, cpu_target)
        space = template.space(wl, cpu_target)
        default = template.builtin_default(wl, cpu_target)
        assert template.is_valid(wl, default, cpu_target), default
        drawn = [c for c in draw(space, 6, int(rng.integers(1 << 30))) if template.is_valid(wl, c, cpu_target)]
        for cfg in [default, *drawn[:3]]:
            lib = build(template.apply(func, wl, cfg, cpu_target), cpu_target)
            for seq, past in cases:
                err = run_case(lib, seq, past, rng, shape=shape)
                assert err < TOL, f"{shape} {kind} {cfg} seq={seq} past={past}: max relative error {err:.2e}"


def test_check_fails_on_a_wrong_kernel(template, cpu_target) -> None:
    """Negative control: the same check rejects a kernel fed the wrong position, and the
    untuned (reference) kernel passes it."""
    rng = np.random.default_rng()
    func = untuned("prefill")
    lib = build(func, cpu_target)
    assert run_case(lib, 9, 20, rng) < TOL
    assert run_case(lib, 9, 20, rng, shift=1) > 100 * TOL
    wl = template.match(func, cpu_target)
    tuned = build(template.apply(func, wl, template.builtin_default(wl, cpu_target), cpu_target), cpu_target)
    assert run_case(tuned, 9, 20, rng, shift=1) > 100 * TOL


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_fused_qkv_signature_is_kept(template, cpu_target, kind) -> None:
    """After merge_projections the kernel reads one [1, seq, q+k+v] tensor; the template's kernel
    keeps that signature."""
    func = untuned(kind, qkv=True)
    wl = template.match(func, cpu_target)
    assert wl.info["qkv"]
    lib = build(template.apply(func, wl, template.builtin_default(wl, cpu_target), cpu_target), cpu_target)
    rng = np.random.default_rng()
    for seq, past in ((1, 37), (6, 0), (12, 50)):
        assert run_case(lib, seq, past, rng, qkv=True) < TOL


def test_tuner_measures_attention_configs(template, cpu_target) -> None:
    """perfx-tune's measurer builds, verifies (against the untuned kernel) and times configurations
    of the decode kernel over a half-full cache; an invalid configuration is recorded as failed."""
    from perfx_compiler.tune.measure import LocalMeasurer, pinned_inputs

    func = untuned("decode")
    assert pinned_inputs(func) == {"PAST": MAXC // 2}
    wl = template.match(func, cpu_target)
    good = [{"k_tile": 32, "splits": 1, "lanes": 16}, {"k_tile": 64, "splits": 4, "lanes": 8}]
    with LocalMeasurer(cpu_target, workers=1, repeat=2, min_repeat_ms=1) as measurer:
        results = measurer.measure(func, template.name, wl.key, [*good, {"k_tile": 32, "splits": 2, "lanes": 3}], 1)
    assert [r.ok for r in results] == [True, True, False], [r.error for r in results]
    assert all(0 < r.mean_s < 0.1 and r.extra["max_rel_error"] < 1e-4 for r in results[:2])


def test_paged_kernel_matches_numpy_per_sequence(cpu_target) -> None:
    """The serving kernel: two sequences at different positions, pages scattered in the pools
    (random page table), chunks of 1 and 3 new tokens; each sequence's output and its pages
    equal the contiguous float64 reference."""
    import tvm

    from perfx_compiler.kernels.paged_attention import paged_attention_kernel

    ps, maxc, npp = 16, 256, 16
    lib = build(paged_attention_kernel(H, KVH, D, maxc, ps), cpu_target)
    rng = np.random.default_rng()
    cos, sin = rope_tables(maxc, D)
    dev = tvm.cpu()
    for seq, positions in ((1, [37, 200]), (3, [0, 90]), (37, [0, 150])):  # 37: tiled, past page and key tiles
        pages = 2 * npp + 3
        table = rng.permutation(pages)[: 2 * npp].reshape(2, npp).astype(np.int64)
        kp = rng.standard_normal((pages, ps, KVH, D)).astype(np.float32)
        vp = rng.standard_normal((pages, ps, KVH, D)).astype(np.float32)
        q = rng.standard_normal((2, seq, H * D)).astype(np.float32)
        k = rng.standard_normal((2, seq, KVH * D)).astype(np.float32)
        v = rng.standard_normal((2, seq, KVH * D)).astype(np.float32)
        kpt, vpt, out = (tvm.runtime.tensor(a, dev) for a in (kp, vp, np.zeros_like(q)))
        lib["main"](*(tvm.runtime.tensor(a, dev) for a in (q, k, v)), kpt, vpt,
                    *(tvm.runtime.tensor(a, dev) for a in (np.array(positions, np.int64), table, cos, sin)), out)
        got_k, got_v, got = kpt.numpy(), vpt.numpy(), out.numpy()
        for b, past in enumerate(positions):
            # the sequence's cache as contiguous [1, KVH, maxc, D] (gathered through its pages)
            kc = kp[table[b]].reshape(1, maxc, KVH, D).transpose(0, 2, 1, 3)
            vc = vp[table[b]].reshape(1, maxc, KVH, D).transpose(0, 2, 1, 3)
            want, wk, wv = attention_reference(q[b : b + 1], k[b : b + 1], v[b : b + 1], kc, vc, past, cos, sin, H, KVH)
            gk = got_k[table[b]].reshape(1, maxc, KVH, D).transpose(0, 2, 1, 3)
            gv = got_v[table[b]].reshape(1, maxc, KVH, D).transpose(0, 2, 1, 3)
            for g, w in ((got[b : b + 1], want), (gk, wk), (gv, wv)):
                err = np.abs(g - w).max() / max(1.0, np.abs(w).max())
                assert err < TOL, f"paged seq={seq} b={b} past={past}: {err:.2e}"
