"""kernels/paged_attention_gpu.py (batched serving's attention on GPU targets): one block per (query
tile, sequence, head) with tree reductions across its threads. On lavapipe (vulkan: WGSL, int32
indices) and PoCL (mali / adreno / intel-igpu OpenCL), with SmolLM2's attention shape (GQA 9/3) and a
second GQA shape (8/2, head_dim 32, 8-token pages), random page tables (distinct pages, as the serving
runtime allocates them) and fresh random inputs: output and both pools vs a float64 numpy reference.
Cases: decode (one query per sequence, one of them at position 0); chunks shorter than a query tile,
of several tiles with a partial last one (including a last tile of one query, the decode path inside
a prefill launch), spanning several pages, starting mid-sequence and mid-page, and a 250-token chunk.
Whole ``paged_decode`` steps and ``paged_prefill`` chunks of the tiny model through the WGSL and OpenCL
launchers = the x86 build's logits."""

from __future__ import annotations

import numpy as np
import pytest
from targets_common import gpu_launcher

pytestmark = pytest.mark.targets

MAXC = 256
SHAPES = {"smollm2": (9, 3, 64, 16), "gqa4": (8, 2, 32, 8)}  # (heads, kv heads, head_dim, page size)
TOL = 2e-5  # relative to the largest |value|
# (batch, chunk, first position of sequence 1 or None = random): decode; a chunk inside one query
# tile; 21 = 8 + 8 + 5 and 17 = 8 + 8 + 1 queries (partial last tiles) starting mid-page, over pages;
# a 250-token chunk from position 0 (the per-query loop kernel this replaced went wrong on lavapipe
# from query 234 of a 256-token chunk)
CASES = ((3, 1, None), (2, 5, None), (2, 21, 37), (3, 17, 100), (1, 250, None))


def paged_reference(q, k, v, kp, vp, pos, table, cos, sin, shape=SHAPES["smollm2"]):
    """float64: (out, k pool, v pool) after appending the rotated k and v at (page, slot)."""
    H, KVH, D, PS = shape
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


@pytest.mark.parametrize("target", ["vulkan", "mali", "adreno", "intel-igpu"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_paged_attention_gpu_matches_numpy(target: str, shape: str) -> None:
    import tvm

    from perfx_compiler.kernels.paged_attention_gpu import (
        paged_attention_kernel_gpu,
        paged_query_tile,
        paged_threads,
    )
    from perfx_compiler.narrow_index import narrow_to_int32
    from perfx_compiler.targets import load_target
    from perfx_compiler.targets_exec.kernels import compile_primfunc

    H, KVH, D, PS = SHAPES[shape]
    launcher = gpu_launcher(target)
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
    qt = paged_query_tile(D, paged_threads(D))
    assert qt == 8  # the cases below are sized for 8-query tiles
    ang = np.arange(MAXC)[:, None] / 10000.0 ** (np.arange(0, D, 2) / D)[None]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    for batch, seq, start in CASES:
        pages = batch * npp + 3
        table = rng.permutation(pages)[: batch * npp].reshape(batch, npp)
        pos = rng.integers(0, MAXC - seq, size=batch)
        pos[0] = 0  # a sequence's first token(s): a one-key softmax for its first query
        if start is not None:
            pos[1] = start
        q = rng.standard_normal((batch, seq, H * D)).astype(np.float32)
        k = rng.standard_normal((batch, seq, KVH * D)).astype(np.float32)
        v = rng.standard_normal((batch, seq, KVH * D)).astype(np.float32)
        kp = rng.standard_normal((pages, PS, KVH, D)).astype(np.float32)
        vp = rng.standard_normal((pages, PS, KVH, D)).astype(np.float32)
        args = [q, k, v, kp, vp, pos.astype(index_dtype), table.astype(index_dtype), cos, sin, np.zeros_like(q)]
        _, single, multi = cf.plan(args)  # append, then the 1-query and the multi-query attention kernels
        assert single.grid[:2] == (H, batch) and single.block[0] == paged_threads(D), single
        assert multi.grid[:2] == (-(-seq // qt), batch * H if seq > 1 else 1), multi
        got = dict(zip([n for n, _, _ in cf.param_info()], launcher.run_numpy(cf, [a.copy() for a in args]), strict=True))
        ref = paged_reference(q, k, v, kp, vp, pos, table, cos, sin, SHAPES[shape])
        for name, want in zip(("OUT", "KP", "VP"), ref, strict=True):
            err = np.abs(got[name] - want).max() / max(1.0, np.abs(want).max())
            assert err < TOL, f"{target} {shape} batch={batch} seq={seq} pos={pos} {name}: error {err:.2e}"


def test_paged_attention_gpu_bad_shapes_are_one_line_errors() -> None:
    from perfx_compiler.errors import UnsupportedModelError
    from perfx_compiler.kernels.paged_attention_gpu import paged_attention_kernel_gpu, paged_query_tile

    with pytest.raises(UnsupportedModelError, match="multiple of kv_heads"):
        paged_attention_kernel_gpu(9, 2, 64, MAXC, 16)
    with pytest.raises(UnsupportedModelError, match="head_dim 300 needs 512 threads"):
        paged_attention_kernel_gpu(4, 4, 300, MAXC, 16)
    # the query tile shrinks so that a block's shared memory fits WebGPU's 16 KiB
    assert [paged_query_tile(d, t) for d, t in ((64, 64), (128, 128), (256, 256))] == [8, 8, 4]


LONG_STREAM = [(7 * i + 3) % 100 for i in range(20)]  # prefilled as chunks of 11 (8 + 3) and 9 (8 + 1)


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
    engine = Engine(out)
    long = np.stack([engine.decode(t) for t in LONG_STREAM])
    return {"streams": streams, "logits": np.stack(refs, axis=1), "long": long}  # [steps, sequences, vocab]


@pytest.mark.parametrize("target", ["vulkan", "mali"])
def test_paged_decode_steps_match_x86(target: str, tiny_gguf, host_streams) -> None:
    """Whole batched decode steps (``paged_decode``: two sequences, different tokens, each on its own
    shuffled pages) through our launcher = the x86 build's logits of each stream on its own."""
    from targets_common import MAX_CONTEXT

    from perfx_compiler.targets_exec.reference import lowered_module
    from perfx_compiler.targets_exec.relax_exec import run_paged_decode_steps

    launcher = gpu_launcher(target)
    state, funcs = lowered_module(str(tiny_gguf), target, max_context=MAX_CONTEXT)
    assert any(n.startswith("paged_attention_gpu") for n in funcs), sorted(funcs)
    got = np.stack(run_paged_decode_steps(state, launcher, host_streams["streams"], state.weights))
    want = host_streams["logits"]
    err = np.abs(got - want).max()
    assert err < 1e-4 * max(1.0, float(np.abs(want).max())), f"{target} paged decode: logits differ from x86 by {err}"
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.parametrize("target", ["vulkan", "mali"])
def test_paged_prefill_chunks_match_x86(target: str, tiny_gguf, host_streams) -> None:
    """Whole ``paged_prefill`` calls (batched serving's chunked prefill) through our launcher: a
    20-token prompt as a chunk of 11 from position 0 then one of 9 from position 11 (the second starts
    mid-sequence; both span query tiles, the last of them partial), on shuffled pages. Each chunk's
    last logits = the x86 build's decode logits of the same token after the same prefix."""
    from targets_common import MAX_CONTEXT

    from perfx_compiler.model.onnx_emit import pages_per_sequence, pool_shape
    from perfx_compiler.targets import index_dtype_of
    from perfx_compiler.targets_exec.reference import lowered_module
    from perfx_compiler.targets_exec.relax_exec import RelaxKernelRunner

    launcher = gpu_launcher(target)
    state, _ = lowered_module(str(tiny_gguf), target, max_context=MAX_CONTEXT)
    cfg = state.desc.config
    index = np.dtype(index_dtype_of(state.target))
    runner = RelaxKernelRunner(state.mod, state.target.tvm(), launcher)
    npp = pages_per_sequence(cfg)
    table = np.random.default_rng().permutation(2 * npp)[:npp].reshape(1, npp).astype(index)
    pools = [launcher.to_device(np.zeros(pool_shape(cfg, 2 * npp), np.float32)) for _ in range(2 * cfg.num_layers)]
    weights = [launcher.to_device(np.asarray(w)) for w in state.weights.values()]
    want = host_streams["long"]
    for start, end in ((0, 11), (11, 20)):
        ids = launcher.to_device(np.array([LONG_STREAM[start:end]], index))
        pos = launcher.to_device(np.array([start], index))
        out = runner.run("paged_prefill", [ids, pos, launcher.to_device(table), *pools, *weights])
        got = launcher.to_host(out[0] if isinstance(out, list) else out).reshape(-1)[-want.shape[1] :]
        ref = want[end - 1]
        err = np.abs(got - ref).max()
        assert err < 1e-4 * max(1.0, float(np.abs(ref).max())), f"{target} chunk {start}:{end}: logits differ by {err}"
        assert got.argmax() == ref.argmax()
