"""The contiguous CPU attention kernel over float16 and int8 KV caches (kernels/_kv_cache.py): every body
(prefill rows and tiled, decode split with one and more chunks), GQA (4 heads over 2 kv heads), plain and
sliding-window, on fresh random inputs.

* tight: out and the appended cache rows equal a float64 reference that stores the cache the same way
  (int8: per-row absmax / 127 scale, round half to even; float16: rounded) and attends over the
  dequantized rows;
* loose: out stays near the float32-cache result (the float64 reference over unquantized new rows);
* negative control: the int8 output is far further from a reference that ignores the row scales
  than the tight tolerance, so a kernel dropping a scale fails.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.schedules.test_attention_cpu import attention_reference, build, rope_tables

H, KVH, D, MAXC = 4, 2, 16, 64
TIGHT = 2e-4  # vs the same-storage reference, relative to max(1, |ref|)
LOOSE = {"int8": 0.05, "float16": 2e-3}  # vs the float32 cache
CASES = [(12, 0, 0), (7, 20, 0), (7, 20, 5), (1, 30, 0), (1, 30, 5)]  # (seq, past, window)


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of x (last axis) -> int8 values and float32 scales (absmax / 127), as the kernel stores them."""
    x32 = x.astype(np.float32)
    amax = np.abs(x32).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.round(x32 * inv), -127, 127).astype(np.int8)
    return q, (amax / np.float32(127)).astype(np.float32)


def pack(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """int8 rows [..., D] and scales [..., 1] -> the cache's [..., D + 4] int8 rows."""
    return np.concatenate([q, np.ascontiguousarray(scale.astype(np.float32)).view(np.int8)], -1)


def dequantize(cache: np.ndarray) -> np.ndarray:
    """float64 values of an int8 cache's rows."""
    scale = np.ascontiguousarray(cache[..., D:]).view(np.float32).astype(np.float64)
    return cache[..., :D].astype(np.float64) * scale


def stored(x: np.ndarray, kvd: str) -> np.ndarray:
    """x as the cache stores it, read back (float64)."""
    if kvd == "int8":
        return dequantize(pack(*quantize(x)))
    return x.astype(np.float16).astype(np.float64)


def reference(q, k, v, kc, vc, past, cos, sin, window, kvd):
    """float64 (out, new k rows, new v rows) over caches kc, vc (float64, dequantized) whose new rows are
    stored as ``kvd``; and the float32-cache out (new rows unrounded)."""
    seq = q.shape[1]
    _, wk, wv = attention_reference(q, k, v, kc, vc, past, cos, sin, H, KVH, window)
    plain = attention_reference(q, k, v, kc, vc, past, cos, sin, H, KVH, window)[0]
    # the rotated new rows as the kernel computes them (float32), then stored as kvd
    rk = wk[0, :, past:past + seq].astype(np.float32)
    nk, nv = stored(rk, kvd), stored(wv[0, :, past:past + seq].astype(np.float32), kvd)
    kq, vq = wk.copy(), wv.copy()
    kq[0, :, past:past + seq], vq[0, :, past:past + seq] = nk, nv
    n, group = past + seq, H // KVH
    qr = _rotate(q[0].astype(np.float64).reshape(seq, H, D), cos, sin, past)
    j, p = np.arange(n)[None], (past + np.arange(seq))[:, None]
    mask = (j > p) | ((p - j >= window) if window else False)
    out = np.zeros((seq, H, D))
    for h in range(H):
        sc = qr[:, h] @ kq[0, h // group, :n].T / np.sqrt(D)
        sc[mask] = -np.inf
        w = np.exp(sc - sc.max(-1, keepdims=True))
        out[:, h] = (w / w.sum(-1, keepdims=True)) @ vq[0, h // group, :n]
    return out.reshape(1, seq, H * D), rk, wv[0, :, past:past + seq], plain


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, past: int) -> np.ndarray:
    c = cos[past:past + x.shape[0]].astype(np.float64)[:, None]
    s = sin[past:past + x.shape[0]].astype(np.float64)[:, None]
    half = D // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def _rel(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / max(1.0, np.abs(ref).max()))


def run(lib: Any, kvd: str, seq: int, past: int, window: int, rng: np.random.Generator) -> None:
    import tvm

    cos, sin = rope_tables(MAXC, D)
    q, k, v = (rng.standard_normal((1, seq, n * D)).astype(np.float32) for n in (H, KVH, KVH))
    raw = [rng.standard_normal((1, KVH, MAXC, D)).astype(np.float32) for _ in range(2)]
    if kvd == "int8":
        caches = [pack(*quantize(c)) for c in raw]
        values = [dequantize(c) for c in caches]
    else:
        caches = [c.astype(np.float16) for c in raw]
        values = [c.astype(np.float64) for c in caches]
    dev = tvm.cpu()
    kct, vct = (tvm.runtime.tensor(c, dev) for c in caches)
    out = tvm.runtime.tensor(np.zeros_like(q), dev)
    lib["main"](*(tvm.runtime.tensor(a, dev) for a in (q, k, v)), kct, vct,
                tvm.runtime.tensor(np.array([past], np.int64), dev), tvm.runtime.tensor(cos, dev),
                tvm.runtime.tensor(sin, dev), out)
    want, rk, rv, plain = reference(q, k, v, values[0], values[1], past, cos, sin, window, kvd)
    tag = f"{kvd} seq={seq} past={past} window={window}"
    got = out.numpy()
    assert _rel(got, want) < TIGHT, f"{tag}: out vs same-storage reference {_rel(got, want):.2e}"
    assert _rel(got, plain) < LOOSE[kvd], f"{tag}: out vs float32 cache {_rel(got, plain):.2e}"
    for name, t, new in (("k", kct, rk), ("v", vct, rv)):
        cache = t.numpy()
        read = dequantize(cache) if kvd == "int8" else cache.astype(np.float64)
        # the new rows hold the rotated k / the v as stored; a round-half case may differ by one step
        step = np.abs(new).max(-1, keepdims=True) / 127 if kvd == "int8" else np.abs(new) * 2.0 ** -10
        assert np.all(np.abs(read[0, :, past:past + seq] - new) <= 0.51 * step + 1e-7), f"{tag}: {name} rows"
        untouched = np.r_[0:past, past + seq:MAXC]
        assert np.array_equal(cache[0, :, untouched], caches[0 if name == "k" else 1][0, :, untouched]), tag
    if kvd == "int8" and past:  # negative control: the cached rows' scales matter
        unscaled = [c[..., :D].astype(np.float64) for c in caches]
        wrong = reference(q, k, v, unscaled[0], unscaled[1], past, cos, sin, window, kvd)[0]
        assert _rel(got, wrong) > 100 * TIGHT, f"{tag}: the scales changed nothing"


CONFIGS = {
    "rows": {"body": "rows", "k_tile": 16},
    "split1": {"body": "split", "k_tile": 16, "splits": 1, "prefetch": 8},
    "split3": {"body": "split", "k_tile": 16, "splits": 3},
    "tiled": {"body": "tiled", "k_tile": 16, "q_tile": 4, "heads_per_task": 2, "key_block": 4},
    "tiled_hpt1": {"body": "tiled", "k_tile": 8, "q_tile": 3, "heads_per_task": 1, "key_block": 2},
}


@pytest.mark.parametrize("kvd", ["int8", "float16"])
@pytest.mark.parametrize("body", sorted(CONFIGS))
def test_narrow_kv_cache_matches_numpy(cpu_target, kvd, body) -> None:
    from perfx_compiler.kernels.attention import cached_attention_kernel

    rng = np.random.default_rng()
    libs: dict[int, Any] = {}
    for seq, past, window in CASES:
        if window not in libs:
            libs[window] = build(cached_attention_kernel(H, KVH, D, MAXC, config=CONFIGS[body], window=window,
                                                         kv_cache=kvd), cpu_target)
        run(libs[window], kvd, seq, past, window, rng)


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_template_keeps_narrow_caches_apart(cpu_target, kind) -> None:
    """The attention_cpu template tags, searches and rebuilds a narrow-cache kernel as one: its workload
    differs from the float32 one (own tuning records), prefill defaults to the tiled body, and every
    configuration tried (default first, then the space's last and first values) builds a kernel that
    matches the reference."""
    from perfx_compiler.kernels.attention import untuned_attention_kernel
    from perfx_compiler.schedule_template import template_by_name

    template = template_by_name("attention_cpu")
    func = untuned_attention_kernel(kind, H, KVH, D, MAXC, kv_cache="int8")
    wl = template.match(func, cpu_target)
    plain = template.match(untuned_attention_kernel(kind, H, KVH, D, MAXC), cpu_target)
    assert wl.info["kv_cache"] == "int8" and "kv_cache" not in plain.info and wl.key != plain.key
    space = template.space(wl, cpu_target)
    if kind == "prefill":
        assert template._kernel_config(wl, template.builtin_default(wl, cpu_target))["body"] == "tiled"
    configs = [template.builtin_default(wl, cpu_target), {k: v[-1] for k, v in space.items()},
               {k: v[0] for k, v in space.items()}]
    rng = np.random.default_rng()
    for cfg in configs:
        lib = build(template.apply(func, wl, cfg, cpu_target), cpu_target)
        for seq, past in ([(9, 0), (5, 30)] if kind == "prefill" else [(1, 0), (1, 40)]):
            run(lib, "int8", seq, past, 0, rng)


@pytest.mark.parametrize("kvd", ["int8", "float16"])
def test_paged_narrow_pools_match_numpy(cpu_target, kvd) -> None:
    """The serving kernel over narrow pools (perfx-serve with --kv-cache int8|f16): two sequences at different
    positions, pages scattered through the pools (random page table), chunks of 1 and 5 new tokens, plain
    and sliding-window. Each sequence's output equals the same-storage float64 reference (tight) and stays
    near the float32-cache result (loose); its new rows hold the rotated k and the v as stored; every other
    pool row is untouched; and (int8) a reference ignoring the row scales is far off."""
    import tvm

    from perfx_compiler.kernels.paged_attention import paged_attention_kernel

    ps, npp = 4, MAXC // 4
    pages = 2 * npp + 3
    rng = np.random.default_rng()
    cos, sin = rope_tables(MAXC, D)
    dev = tvm.cpu()
    for window in (0, 5):
        lib = build(paged_attention_kernel(H, KVH, D, MAXC, ps, window=window, kv_cache=kvd), cpu_target)
        for seq, positions in ((1, [37, 20]), (5, [0, 40])):
            table = rng.permutation(pages)[: 2 * npp].reshape(2, npp).astype(np.int64)
            raw = [rng.standard_normal((pages, ps, KVH, D)).astype(np.float32) for _ in range(2)]
            pools = [pack(*quantize(r)) if kvd == "int8" else r.astype(np.float16) for r in raw]
            q, k, v = (rng.standard_normal((2, seq, n * D)).astype(np.float32) for n in (H, KVH, KVH))
            kpt, vpt = (tvm.runtime.tensor(p, dev) for p in pools)
            out = tvm.runtime.tensor(np.zeros_like(q), dev)
            lib["main"](*(tvm.runtime.tensor(a, dev) for a in (q, k, v)), kpt, vpt,
                        *(tvm.runtime.tensor(a, dev) for a in (np.array(positions, np.int64), table, cos, sin)), out)
            got, got_pools = out.numpy(), [kpt.numpy(), vpt.numpy()]
            written = np.zeros((pages, ps), bool)
            for b, past in enumerate(positions):
                tag = f"{kvd} paged window={window} seq={seq} b={b} past={past}"

                def contiguous(pool: np.ndarray, b: int = b, table: np.ndarray = table) -> np.ndarray:
                    # the sequence's rows as a [1, KVH, MAXC, row] cache, gathered through its page table
                    return pool[table[b]].reshape(1, MAXC, KVH, -1).transpose(0, 2, 1, 3)

                def values(cache: np.ndarray) -> np.ndarray:
                    return dequantize(cache) if kvd == "int8" else cache.astype(np.float64)

                before = [values(contiguous(p)) for p in pools]
                want, rk, rv, plain = reference(q[b:b + 1], k[b:b + 1], v[b:b + 1], *before, past, cos, sin, window,
                                                kvd)
                assert _rel(got[b:b + 1], want) < TIGHT, f"{tag}: out vs same-storage reference"
                assert _rel(got[b:b + 1], plain) < LOOSE[kvd], f"{tag}: out vs float32 pools"
                for name, pool, new in (("k", got_pools[0], rk), ("v", got_pools[1], rv)):
                    read = values(contiguous(pool))[0, :, past:past + seq]
                    step = np.abs(new).max(-1, keepdims=True) / 127 if kvd == "int8" else np.abs(new) * 2.0 ** -10
                    assert np.all(np.abs(read - new) <= 0.51 * step + 1e-7), f"{tag}: new {name} rows"
                for p in range(past, past + seq):
                    written[table[b, p // ps], p % ps] = True
                if kvd == "int8" and past:  # negative control: the cached rows' scales matter
                    unscaled = [contiguous(p)[..., :D].astype(np.float64) for p in pools]
                    wrong = reference(q[b:b + 1], k[b:b + 1], v[b:b + 1], *unscaled, past, cos, sin, window, kvd)[0]
                    assert _rel(got[b:b + 1], wrong) > 100 * TIGHT, f"{tag}: the scales changed nothing"
            for pool, orig in zip(got_pools, pools, strict=True):
                assert np.array_equal(pool[~written], orig[~written]), f"{kvd} window={window} seq={seq}: other rows"
