"""kernels/paged_attention_gpu.py (batched serving's attention on GPU targets): one block per (head,
sequence) with tree reductions across its threads. On lavapipe (vulkan: WGSL, int32 indices) and PoCL
(mali / adreno / intel-igpu OpenCL), with SmolLM2's attention shape, random page tables (distinct pages,
as the serving runtime allocates them) and fresh random inputs: output and both pools vs a float64
numpy reference; decode (one query per sequence, one of them at position 0) and a 5-token chunk."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.targets

H, KVH, D, MAXC, PS = 9, 3, 64, 256, 16  # SmolLM2-135M's attention, 16-token pages
TOL = 2e-5  # relative to the largest |value|


def paged_reference(q, k, v, kp, vp, pos, table, cos, sin):
    """float64: (out, k pool, v pool) after appending the rotated k and v at (page, slot)."""
    B, S, _ = q.shape
    half, G = D // 2, H // KVH
    kp, vp = kp.astype(np.float64), vp.astype(np.float64)
    out = np.zeros(q.shape)

    def rot(x: np.ndarray, p: int) -> np.ndarray:
        c, s = cos[p].astype(np.float64), sin[p].astype(np.float64)
        return np.concatenate([x[:half] * c - x[half:] * s, x[half:] * c + x[:half] * s])

    for b in range(B):
        for s in range(S):
            p = pos[b] + s
            for kh in range(KVH):
                kp[table[b, p // PS], p % PS, kh] = rot(k[b, s, kh * D : (kh + 1) * D].astype(np.float64), p)
                vp[table[b, p // PS], p % PS, kh] = v[b, s, kh * D : (kh + 1) * D]
    for b in range(B):
        for s in range(S):
            p = pos[b] + s
            idx = np.arange(p + 1)
            keys, vals = kp[table[b, idx // PS], idx % PS], vp[table[b, idx // PS], idx % PS]
            for h in range(H):
                qr = rot(q[b, s, h * D : (h + 1) * D].astype(np.float64), p) / np.sqrt(D)
                sc = keys[:, h // G] @ qr
                w = np.exp(sc - sc.max())
                out[b, s, h * D : (h + 1) * D] = (w / w.sum()) @ vals[:, h // G]
    return out, kp, vp


def _launcher(target: str):
    if target == "vulkan":
        from perfx_compiler.targets_exec.webgpu import WebGPULauncher, webgpu_available

        why = webgpu_available()
        if why is not None:
            pytest.skip(why)
        return WebGPULauncher()
    from perfx_compiler.targets_exec.opencl import OpenCLLauncher, opencl_available

    why = opencl_available()
    if why is not None:
        pytest.skip(why)
    return OpenCLLauncher()


@pytest.mark.parametrize("target", ["vulkan", "mali", "adreno", "intel-igpu"])
def test_paged_attention_gpu_matches_numpy(target: str) -> None:
    import tvm

    from perfx_compiler.kernels.paged_attention_gpu import paged_attention_kernel_gpu, paged_threads
    from perfx_compiler.narrow_index import narrow_to_int32
    from perfx_compiler.targets import load_target
    from perfx_compiler.targets_exec.kernels import compile_primfunc

    launcher = _launcher(target)
    index_dtype = "int32" if target == "vulkan" else "int64"
    func = paged_attention_kernel_gpu(H, KVH, D, MAXC, PS, "float32", index_dtype)
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    if index_dtype == "int32":
        mod = narrow_to_int32(mod)
    cf = compile_primfunc("paged_attention_gpu", mod["main"], load_target(target).tvm())
    if target == "vulkan":
        assert "i64" not in cf.source

    rng = np.random.default_rng()
    npp = -(-MAXC // PS)
    ang = np.arange(MAXC)[:, None] / 10000.0 ** (np.arange(0, D, 2) / D)[None]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    for batch, seq in ((3, 1), (2, 5)):
        pages = batch * npp + 3
        table = rng.permutation(pages)[: batch * npp].reshape(batch, npp)
        pos = rng.integers(0, MAXC - seq, size=batch)
        pos[0] = 0  # a sequence's first token: a one-key softmax
        q = rng.standard_normal((batch, seq, H * D)).astype(np.float32)
        k = rng.standard_normal((batch, seq, KVH * D)).astype(np.float32)
        v = rng.standard_normal((batch, seq, KVH * D)).astype(np.float32)
        kp = rng.standard_normal((pages, PS, KVH, D)).astype(np.float32)
        vp = rng.standard_normal((pages, PS, KVH, D)).astype(np.float32)
        args = [q, k, v, kp, vp, pos.astype(index_dtype), table.astype(index_dtype), cos, sin, np.zeros_like(q)]
        launches = cf.plan(args)
        attention = launches[-1]  # the append launch comes first
        assert attention.grid[:2] == (H, batch) and attention.block[0] == paged_threads(D), attention
        got = dict(zip([n for n, _, _ in cf.param_info()], launcher.run_numpy(cf, [a.copy() for a in args]), strict=True))
        want = dict(zip(("OUT", "KP", "VP"), paged_reference(q, k, v, kp, vp, pos, table, cos, sin), strict=True))
        for name, ref in want.items():
            err = np.abs(got[name] - ref).max() / max(1.0, np.abs(ref).max())
            assert err < TOL, f"{target} batch={batch} seq={seq} {name}: error {err:.2e}"


@pytest.fixture(scope="module")
def host_streams(tiny_gguf, tmp_path_factory) -> dict:
    """x86 decode logits of two token streams (each from an empty cache): the batched step's reference."""
    from targets_common import MAX_CONTEXT, TOKENS

    from perfx_compiler.pipeline import compile_model
    from perfx_compiler.runtime.engine import Engine

    out = compile_model(str(tiny_gguf), "host", tmp_path_factory.mktemp("ps") / "a", progress=False,
                        max_context=MAX_CONTEXT)
    streams = [TOKENS, TOKENS[::-1]]
    refs = []
    for stream in streams:
        engine = Engine(out)
        refs.append(np.stack([engine.decode(t) for t in stream]))
    return {"streams": streams, "logits": np.stack(refs, axis=1)}  # [steps, sequences, vocab]


@pytest.mark.parametrize("target", ["vulkan", "mali"])
def test_paged_decode_steps_match_x86(target: str, tiny_gguf, host_streams) -> None:
    """Whole batched decode steps (``paged_decode``: two sequences, different tokens, each on its own
    shuffled pages) through our launcher = the x86 build's logits of each stream on its own."""
    from targets_common import MAX_CONTEXT

    from perfx_compiler.targets_exec.reference import lowered_module
    from perfx_compiler.targets_exec.relax_exec import run_paged_decode_steps

    launcher = _launcher(target)
    state, funcs = lowered_module(str(tiny_gguf), target, max_context=MAX_CONTEXT)
    assert any(n.startswith("paged_attention_gpu") for n in funcs), sorted(funcs)
    got = np.stack(run_paged_decode_steps(state, launcher, host_streams["streams"], state.weights))
    want = host_streams["logits"]
    err = np.abs(got - want).max()
    assert err < 1e-4 * max(1.0, float(np.abs(want).max())), f"{target} paged decode: logits differ from x86 by {err}"
    assert (got.argmax(-1) == want.argmax(-1)).all()
