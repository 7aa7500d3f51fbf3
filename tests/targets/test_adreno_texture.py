"""adreno: weights that decode GEMVs read through OpenCL images live only as images
(passes/texture_weights.py): decode's GEMVs (kernels/gemv_texture.py), the prefill / paged GEMMs and
the tied-embedding gathers (kernels/gemm_texture.py) all read them, lowered by the project's assembled
Adreno TIR pipeline with TextureFlatten. Every texture kernel runs on PoCL's images against numpy
(SmolLM2's shapes, and every texture kernel of SmolLM2's adreno decode), whole decode, prefill and
batched paged decode steps through the launcher match the x86 build, and the weight table and the
device hold one copy of each weight (byte counts against the buffer-only mali build)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from targets_common import MAX_CONTEXT, TOKENS, compile_texture

pytestmark = pytest.mark.targets
LIMITS = {"max_width": 16384, "max_height": 16384, "max_layers": 2048}  # targets/adreno.json


def _limits(launcher, max_height: int | None = None) -> dict[str, int]:
    """Adreno's image limits (``max_height`` lowered for a test), within what this OpenCL device takes:
    PoCL's image sizes depend on the machine (16384 rows on one, 8192 on another)."""
    dev = launcher.device
    lim = {**LIMITS, "max_height": max_height or LIMITS["max_height"]}
    return {"max_width": min(lim["max_width"], dev.image2d_max_width),
            "max_height": min(lim["max_height"], dev.image2d_max_height),
            "max_layers": min(lim["max_layers"], dev.image_max_array_size)}


@pytest.fixture(scope="module")
def launcher():
    from perfx_compiler.targets_exec.opencl import OpenCLLauncher, opencl_available

    why = opencl_available()
    if why is not None:
        pytest.skip(why)
    return OpenCLLauncher()


def _check(got: np.ndarray, want: np.ndarray, k: int) -> None:
    err = np.abs(got.reshape(-1).astype(np.float64) - want).max()
    assert err <= 2e-6 * max(1.0, float(np.abs(want).max())) * np.sqrt(k), err


def _q4_case(rng, n: int, k: int, variant: str, lim: dict[str, int]):
    """A random int4 weight with group 32 in one of its variants (``offset``: Q4_1's min, ``zero``: a
    uint8 zero point, ``sym``: Q4_0's zero point 8 and no array): (info, images, float64 W)."""
    from perfx_compiler.formats.int4 import Int4Format, pack_int4
    from perfx_compiler.kernels import gemv_texture as gt

    offset = variant == "offset"
    lanes = Int4Format(32, variant == "sym", offset).lanes(k)
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    scale = rng.standard_normal((n, k // 32)).astype(np.float16)
    third = (rng.standard_normal((n, k // 32)).astype(np.float16) if offset
             else rng.integers(0, 16, (n, k // 32)).astype(np.uint8))
    columns = [scale] if variant == "sym" else [scale, third]
    words = pack_int4(codes, lanes)
    cl = gt.image_layout(n, words.shape[1] // 4, "RGBA32UI", lim)
    sl = gt.scale_layout(n, k // 32, len(columns), lim)
    info = {"N": n, "K": k, "group": 32, "lanes": lanes, "offset": offset, "sym": variant == "sym"}
    s, t = (np.repeat(a.astype(np.float64), 32, axis=1) for a in (scale, third))
    c = codes.astype(np.float64)
    w = c * s + t if offset else (c - (8 if variant == "sym" else t)) * s
    return info, (cl, sl), [gt.pack_image(words, cl), gt.pack_scales(columns, sl)], w


Q4_VARIANTS = ["offset", "zero", "sym"]


# N x K of SmolLM2's decode GEMVs (qkv, o, gate_up, down); small ones fold rows into layers
@pytest.mark.parametrize(("n", "k", "max_height"), [(960, 576, 16384), (576, 576, 16384), (3072, 576, 1000),
                                                     (576, 1536, 16384), (100, 64, 30)])
@pytest.mark.parametrize("variant", Q4_VARIANTS)
def test_q4_texture_gemv(n: int, k: int, max_height: int, variant: str, launcher) -> None:
    from perfx_compiler.kernels import gemv_texture as gt

    lim = _limits(launcher, max_height)
    rng = np.random.default_rng(n * 7 + k + len(variant))
    info, (cl, sl), images, w = _q4_case(rng, n, k, variant, lim)
    assert cl.layers == -(-n // lim["max_height"])
    cf = compile_texture(gt.texture_q4_gemv_kernel(info, cl, sl))
    assert "read_imageui" in cf.source and "as_uint4(READ_IMAGEF" not in cf.source
    x = rng.standard_normal((1, 1, k)).astype(np.float32)
    got = launcher.run_numpy(cf, [x, *images, np.zeros((1, 1, n), np.float32)])[3]
    _check(got, w @ x.reshape(-1).astype(np.float64), k)


@pytest.mark.parametrize(("n", "k"), [(49152, 576), (300, 64)])  # SmolLM2's lm_head: 3 layers of 16384 rows
def test_q8_texture_gemv(n: int, k: int, launcher) -> None:
    from perfx_compiler.kernels import gemv_texture as gt

    rng = np.random.default_rng(n + k)
    codes = rng.integers(-127, 128, (n, k)).astype(np.int8)
    scale = rng.standard_normal((n, k // 32)).astype(np.float16)
    cl = gt.image_layout(n, k // 16, "RGBA32UI", _limits(launcher))
    sl = gt.scale_layout(n, k // 32, 1, _limits(launcher))
    cf = compile_texture(gt.texture_q8_gemv_kernel({"N": n, "K": k, "group": 32}, cl, sl))
    x = rng.standard_normal((1, 1, k)).astype(np.float32)
    got = launcher.run_numpy(cf, [x, gt.pack_image(codes.view(np.uint32), cl), gt.pack_scales([scale], sl),
                                  np.zeros((1, 1, n), np.float32)])[3]
    _check(got, (codes * np.repeat(scale.astype(np.float64), 32, axis=1)) @ x.reshape(-1).astype(np.float64), k)


@pytest.mark.parametrize(("n", "k", "max_height"), [(128, 64, 16384), (100, 40, 16384), (1536, 576, 16384),
                                                     (300, 64, 128)])
def test_f32_texture_gemv(n: int, k: int, max_height: int, launcher) -> None:
    from perfx_compiler.kernels import gemv_texture as gt
    from perfx_compiler.targets_exec.opencl import texture_params

    if k % 8:
        with pytest.raises(gt.TextureLimitError):
            gt.texture_gemv_kernel(n, k)
        return
    lay = gt.image_layout(n, k // 4, "RGBA32F", _limits(launcher, max_height))
    cf = compile_texture(gt.texture_gemv_kernel(n, k, layout=lay))
    assert texture_params(cf) == {1}
    rng = np.random.default_rng(n + k)
    x = rng.standard_normal((1, 1, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    got = launcher.run_numpy(cf, [x, gt.pack_image(w, lay), np.zeros((1, 1, n), np.float32)])[2]
    _check(got, w.astype(np.float64) @ x.reshape(-1), k)


ROWS = [(1, 7), (3, 1), (1, 1), (2, 5)]  # x [b, s, K]: prefill chunks, paged decode batches, and both


def _run_rows(launcher, cf, images: list[np.ndarray], k: int, n: int, want_w: np.ndarray, seed: int) -> None:
    """Run a multi-row texture matmul at every (b, s) of ROWS against x @ W.T in float64."""
    rng = np.random.default_rng(seed)
    for b, s in ROWS:
        x = rng.standard_normal((b, s, k)).astype(np.float32)
        got = launcher.run_numpy(cf, [x, *images, np.zeros((b, s, n), np.float32)])[-1]
        _check(got, (x.reshape(-1, k).astype(np.float64) @ want_w.T).reshape(-1), k)


# SmolLM2's prefill GEMMs (qkv, gate_up folded into 4 layers, down) and a small odd one (rows not a multiple of 4)
@pytest.mark.parametrize(("n", "k", "max_height"), [(960, 576, 16384), (3072, 576, 1000), (576, 1536, 16384),
                                                     (102, 64, 30)])
@pytest.mark.parametrize("variant", Q4_VARIANTS)
def test_q4_texture_gemm(n: int, k: int, max_height: int, variant: str, launcher) -> None:
    from perfx_compiler.kernels import gemm_texture as gm

    rng = np.random.default_rng(n * 5 + k + len(variant))
    info, (cl, sl), images, w = _q4_case(rng, n, k, variant, _limits(launcher, max_height))
    cf = compile_texture(gm.texture_q4_gemm_kernel(info, cl, sl))
    _run_rows(launcher, cf, images, k, n, w, n + k)


@pytest.mark.parametrize(("n", "k", "max_height"), [(49152, 576, 16384), (300, 64, 128)])
def test_q8_texture_gemm(n: int, k: int, max_height: int, launcher) -> None:
    from perfx_compiler.kernels import gemm_texture as gm
    from perfx_compiler.kernels import gemv_texture as gt

    lim = _limits(launcher, max_height)
    rng = np.random.default_rng(n + k + 1)
    codes = rng.integers(-127, 128, (n, k)).astype(np.int8)
    scale = rng.standard_normal((n, k // 32)).astype(np.float16)
    cl = gt.image_layout(n, k // 16, "RGBA32UI", lim)
    sl = gt.scale_layout(n, k // 32, 1, lim)
    cf = compile_texture(gm.texture_q8_gemm_kernel({"N": n, "K": k, "group": 32}, cl, sl))
    w = codes * np.repeat(scale.astype(np.float64), 32, axis=1)
    _run_rows(launcher, cf, [gt.pack_image(codes.view(np.uint32), cl), gt.pack_scales([scale], sl)], k, n, w, n)


@pytest.mark.parametrize(("n", "k", "max_height"), [(1536, 576, 16384), (300, 64, 128)])
def test_f32_texture_gemm(n: int, k: int, max_height: int, launcher) -> None:
    from perfx_compiler.kernels import gemm_texture as gm
    from perfx_compiler.kernels import gemv_texture as gt

    lay = gt.image_layout(n, k // 4, "RGBA32F", _limits(launcher, max_height))
    cf = compile_texture(gm.texture_gemm_kernel(n, k, lay))
    w = np.random.default_rng(n + k).standard_normal((n, k)).astype(np.float32)
    _run_rows(launcher, cf, [gt.pack_image(w, lay)], k, n, w.astype(np.float64), n + 2)


@pytest.mark.parametrize("fmt", ["f32", "q8", *(f"q4-{v}" for v in Q4_VARIANTS)])
@pytest.mark.parametrize(("n", "k", "max_height"), [(49152, 576, 16384), (300, 640, 128)])
def test_texture_take(fmt: str, n: int, k: int, max_height: int, launcher) -> None:
    """Embedding gather from the images (a tied embedding: SmolLM2's Q8_0 token_embd is its lm_head)."""
    from perfx_compiler.kernels import gemm_texture as gm
    from perfx_compiler.kernels import gemv_texture as gt

    lim = _limits(launcher, max_height)
    rng = np.random.default_rng(n + k + len(fmt))
    scale = rng.standard_normal((n, k // 32)).astype(np.float16)
    if fmt == "f32":
        w = rng.standard_normal((n, k)).astype(np.float32)
        lay = gt.image_layout(n, k // 4, "RGBA32F", lim)
        cf, images, want = compile_texture(gm.texture_take_kernel("f32", k, lay)), [gt.pack_image(w, lay)], w
    elif fmt == "q8":
        codes = rng.integers(-127, 128, (n, k)).astype(np.int8)
        cl, sl = gt.image_layout(n, k // 16, "RGBA32UI", lim), gt.scale_layout(n, k // 32, 1, lim)
        cf = compile_texture(gm.texture_take_kernel("q8", k, cl, sl, {"N": n, "K": k, "group": 32}))
        images = [gt.pack_image(codes.view(np.uint32), cl), gt.pack_scales([scale], sl)]
        want = codes * np.repeat(scale.astype(np.float64), 32, axis=1)
    else:
        info, (cl, sl), images, want = _q4_case(rng, n, k, fmt.split("-")[1], lim)
        cf = compile_texture(gm.texture_take_kernel("q4", k, cl, sl, info))
    for b, s in ROWS:
        ids = rng.integers(0, n, (b, s)).astype(np.int64)
        ids.flat[0] = n - 1  # the last row: the last layer of a folded image
        got = launcher.run_numpy(cf, [*images, ids, np.zeros((b, s, k), np.float32)])[-1]
        np.testing.assert_allclose(got, want[ids], rtol=1e-6, atol=1e-6 * float(np.abs(want).max()))


def test_registered_adreno_pipeline_is_not_a_triple() -> None:
    """Why the project assembles its own: TVM 0.27's registered pipeline cannot be unpacked by callers."""
    import tvm

    with pytest.raises(TypeError):
        _pipeline, _host, _device = tvm.tirx.get_tir_pipeline("adreno")


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Q4_1 linears and a tied Q8_0 embedding / lm_head, as SmolLM2's file. The embedding is an image
    (the lm_head's), so its gather reads fp32 scales from the image: PoCL 3.1 (no cl_khr_fp16) runs it,
    where the buffer gather's fp16 scales could not run."""
    from perfx_compiler.model.testing import write_tiny_gguf

    path, _ = write_tiny_gguf(tmp_path_factory.mktemp("tq") / "q4.gguf", qtype="Q4_1", embed_qtype="Q8_0",
                              context_length=128)
    return path


@pytest.fixture(scope="module")
def tiny_q4_0(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Q4_0 linears and a tied Q4_0 embedding: int4 with zero points, and the int4 gather from the image."""
    from perfx_compiler.model.testing import write_tiny_gguf

    path, _ = write_tiny_gguf(tmp_path_factory.mktemp("tq0") / "q4_0.gguf", qtype="Q4_0", embed_qtype="Q4_0",
                              context_length=128)
    return path


def _tiny_q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tied model quantized by llama.cpp to Q4_K_M: Q4_K linears, Q6_K in some, the tied embedding /
    lm_head Q6_K (kernels/texture_superblocks.py: its gather reads the image). K a multiple of 256."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (llama.cpp's quantizer) not installed")
    from perfx_compiler.bench.models import llama_quantize
    from perfx_compiler.model.testing import write_tiny_gguf

    tmp = tmp_path_factory.mktemp("tqkm")
    f32, _ = write_tiny_gguf(tmp / "f32.gguf", qtype="F32", hidden=256, ffn=512, vocab=320, context_length=128, seed=5)
    return llama_quantize(f32, tmp / "q4_k_m.gguf", "Q4_K_M")


@pytest.fixture(scope="module", params=["f32", "q4_1", "q4_0", "q4_k_m"])
def adreno_tiny(request, tiny_gguf: Path, tiny_q4: Path, tiny_q4_0: Path, tmp_path_factory: pytest.TempPathFactory):
    """(quant, model, adreno state, its PrimFuncs, the x86 host engine) of a tiny model, built once per module."""
    from perfx_compiler.pipeline import compile_model
    from perfx_compiler.runtime.engine import Engine
    from perfx_compiler.targets_exec.reference import lowered_module

    if request.param == "q4_k_m":
        model = _tiny_q4_k_m(tmp_path_factory)
    else:
        model = {"f32": tiny_gguf, "q4_1": tiny_q4, "q4_0": tiny_q4_0}[request.param]
    state, funcs = lowered_module(str(model), "adreno", max_context=MAX_CONTEXT)
    host = Engine(compile_model(str(model), "host", tmp_path_factory.mktemp("h") / "h", progress=False,
                                max_context=MAX_CONTEXT, activations="f32"))
    return request.param, model, state, funcs, host


def _texture_calls(state, funcs, fn: str) -> list[str]:
    from tvm import relax

    from perfx_compiler.kernels.tir_queries import has_texture_params

    return [b.value.args[0].name_hint for block in state.mod[fn].body.blocks for b in block.bindings
            if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == "relax.call_tir"
            and has_texture_params(funcs[b.value.args[0].name_hint])]


def test_decode_with_texture_weights_matches_x86(adreno_tiny, launcher) -> None:
    from perfx_compiler.targets_exec.relax_exec import run_decode_steps

    quant, _, state, funcs, host = adreno_tiny
    images = [k for k in state.weights if k.endswith("__tex")]
    # every decode linear and the lm_head read images, and the tied embedding is gathered from its image
    tex = _texture_calls(state, funcs, "decode")
    assert len(tex) == _linears(quant) + 1, tex  # and the gather
    assert len(set(tex)) == 6 or quant == "q4_k_m", tex  # (Q4_K_M: a layer's Q6_K linears have kernels of their own)
    assert sum("_take_" in n for n in tex) == 1, tex
    assert len(_weight_images(images)) == _linears(quant), images
    host.reset()
    want = np.stack([host.decode(t) for t in TOKENS])
    got = np.stack(run_decode_steps(state, launcher, TOKENS, state.weights))
    err = np.abs(got - want).max()
    assert err < 1e-4 * max(1.0, float(np.abs(want).max())), f"adreno textures ({quant}): logits differ by {err}"
    assert (got.argmax(-1) == want.argmax(-1)).all()


def _linears(quant: str) -> int:
    """Decode's linears: qkv, o, gate_up, down a layer and the lm_head. Q4_K_M's layer 1 has a Q6_K v
    beside Q4_K q and k: three projections, not merged."""
    return 2 * 4 + 1 + (2 if quant == "q4_k_m" else 0)


def _weight_images(images: list[str]) -> list[str]:
    """The images holding a weight's codes (or float values): one a weight group, its scale images aside."""
    return [n for n in images if not n.endswith(("_scale__tex", "_scale_d__tex"))]


def test_prefill_and_paged_decode_read_the_images(adreno_tiny, launcher) -> None:
    """prefill / prefill_all (texture GEMMs over the chunk) and batched paged decode (texture GEMMs over
    the batch) on the same images as decode: logits = the x86 build's."""
    from perfx_compiler.model.onnx_emit import cache_shape
    from perfx_compiler.targets_exec.relax_exec import RelaxKernelRunner, run_paged_decode_steps, upload_weights

    quant, _, state, funcs, host = adreno_tiny
    for fn in ("prefill", "prefill_all", "paged_decode", "paged_prefill"):
        tex = _texture_calls(state, funcs, fn)
        assert len(tex) == _linears(quant) + 1, (fn, tex)  # the same linears and the gather as decode
        assert any("_rows" in n or n.startswith("texture_gemm_") for n in tex), (fn, tex)
    cfg = state.desc.config
    runner = RelaxKernelRunner(state.mod, state.target.tvm(), launcher)
    weights = upload_weights(launcher, state.weights)
    tol = 1e-4
    for fn in ("prefill", "prefill_all"):
        caches = [launcher.to_device(np.zeros(cache_shape(cfg), np.float32)) for _ in range(2 * cfg.num_layers)]
        ids, past = launcher.to_device(np.array([TOKENS], np.int64)), launcher.to_device(np.array([0], np.int64))
        out = runner.run(fn, [ids, past, *caches, *weights])
        host.reset()
        want = getattr(host, fn)(TOKENS)
        got = launcher.to_host(out[0] if isinstance(out, list) else out).reshape(want.shape)
        err = np.abs(got - want).max()
        assert err < tol * max(1.0, float(np.abs(want).max())), f"adreno {fn} ({quant}): logits differ by {err}"
    streams = [TOKENS, TOKENS[::-1]]
    got = np.stack(run_paged_decode_steps(state, launcher, streams, state.weights, runner=runner))
    want = []
    for s in streams:
        host.reset()
        want.append(np.stack([host.decode(t) for t in s]))
    want = np.stack(want, 1)
    err = np.abs(got - want).max()
    assert err < tol * max(1.0, float(np.abs(want).max())), f"adreno paged_decode ({quant}): logits differ by {err}"


def _device_bytes(launcher, weights: dict) -> int:
    """Bytes the OpenCL device allocated for the weights as the launcher uploads them (images and buffers)."""
    from perfx_compiler.targets_exec.relax_exec import upload_weights

    arrays = upload_weights(launcher, weights)
    return sum(int(a.image.size if hasattr(a, "image") else a.buffer.size) for a in arrays)


def _image_growth(weights: dict, buffers: dict) -> tuple[int, int]:
    """(bytes the images add over the buffers they replace, the most they may add). Code and float images
    must be exactly their buffers' bytes; scale images hold the float16 scales / mins as they are and
    uint8 zeros as float16, each row padded to whole texels (q8: 8 groups a texel, q4: 4 pairs)."""
    from perfx_compiler.passes.texture_weights import texture_manifest

    growth = allowed = 0
    for name, t in texture_manifest(weights).items():
        src = t["source"]
        parts = [src]
        if src.endswith("_scale_d") and src.removesuffix("_scale_d") + "_sb__tex" in weights:
            continue  # a K-quant's d image: with its superblock image, below
        if src.endswith("_sb"):  # a K-quant: its image (and d image) for its code planes and factor arrays
            stem = src.removesuffix("_sb")
            parts = [k for k in buffers if k.startswith(stem) and k[len(stem):] in SB_ARRAYS]
            d_image = weights.get(stem + "_scale_d__tex")
            grew = weights[name].nbytes + (d_image.nbytes if d_image is not None else 0)
            grew -= sum(np.asarray(buffers[p]).nbytes for p in parts)
            # the file's bits: less than the GPU arrays (their group planes padded to whole words) but
            # for the d image's last texel a row
            if d_image is not None:
                allowed += d_image.nbytes - np.asarray(buffers[stem + "_scale_d"]).nbytes
            growth += grew
            continue
        if src.endswith("_scale"):
            parts += [p for p in (src.removesuffix("_scale") + s for s in ("_min", "_zero")) if p in buffers]
            # float16 bits as they are: only uint8 zeros widened to float16 and the padding to a whole
            # last texel a row (and the last layer's rows) may grow
            zeros = src.removesuffix("_scale") + "_zero"
            allowed += (np.asarray(buffers[zeros]).nbytes if zeros in buffers else 0) + 16 * t["layers"] * t["height"]
            allowed += (t["layers"] * t["height"] - np.asarray(buffers[src]).shape[0]) * 16 * t["width"]
        grew = weights[name].nbytes - sum(np.asarray(buffers[p]).nbytes for p in parts)
        assert src.endswith("_scale") or grew == 0, (name, grew)
        assert grew >= 0, (name, grew)
        growth += grew
    return growth, allowed


SB_ARRAYS = ("", "_hi", "_scale", "_scale_hi", "_min", "_min_hi", "_scale_d")  # formats/gpu_factors.py names


def _assert_one_copy(weights: dict, buffers: dict) -> int:
    """The table holds each weight once: ``buffers`` (the quantized model as a buffer-only build holds
    it) with each imaged group's buffers swapped for its images. Returns the table's bytes."""
    from perfx_compiler.passes.texture_weights import texture_manifest

    sources = {t["source"] for t in texture_manifest(weights).values()}
    both = sorted(sources & weights.keys())
    assert not both, f"weights kept as buffer and image: {both}"
    stems = {s.removesuffix("_scale") for s in sources}  # scale, min, zero of an imaged linear go too
    left = sorted(k for k in weights if not k.endswith("__tex") and k.rsplit("_", 1)[0] in stems)
    assert not left, left
    sb = [s.removesuffix("_sb") for s in sources if s.endswith("_sb")]  # a K-quant's planes and factors go
    left = sorted(k for k in weights if not k.endswith("__tex") for s in sb if k.startswith(s) and k[len(s):] in SB_ARRAYS)
    assert not left, left
    growth, allowed = _image_growth(weights, buffers)
    have = sum(np.asarray(w).nbytes for w in weights.values())
    assert have == sum(np.asarray(w).nbytes for w in buffers.values()) + growth, (have, growth)
    # (a q8 scale texel holds 8 groups, SmolLM2's 18 -> 24; a q4 one 4 pairs, 18 -> 20; float32 scale
    # images grew 1x-3x the scale bytes; K-quant images are smaller than the GPU arrays)
    assert growth <= allowed, (growth, allowed)
    return have


def test_texture_weights_are_one_copy(adreno_tiny, launcher) -> None:
    """No weight is both an image and a buffer: the adreno weight table (= weights.bin) and the device
    hold the buffer-only mali build's bytes (the model's quantized weight bytes), plus only the image
    scales' padding to whole texels. The duplicate (PR #5: images as a second copy) doubled them."""
    from perfx_compiler.passes.texture_weights import texture_manifest
    from perfx_compiler.targets_exec.reference import lowered_module

    quant, model, state, _, _ = adreno_tiny
    mali, _ = lowered_module(str(model), "mali", max_context=MAX_CONTEXT, schedule=False)
    manifest = texture_manifest(state.weights)
    assert len(manifest) == (9 if quant == "f32" else 18) or quant == "q4_k_m"
    assert len(_weight_images(list(manifest))) == _linears(quant)
    have = _assert_one_copy(state.weights, mali.weights)
    assert _device_bytes(launcher, state.weights) == have
    if quant == "f32":  # float images are exactly the float weights
        assert have == sum(np.asarray(w).nbytes for w in mali.weights.values())


@pytest.mark.parametrize("target", ["mali", "intel-igpu"])
def test_textures_only_where_the_target_file_enables_them(target: str, tiny_gguf: Path) -> None:
    from perfx_compiler.passes.texture_weights import texture_options
    from perfx_compiler.targets import load_target
    from perfx_compiler.targets_exec.reference import lowered_module

    assert texture_options(load_target(target)) is None
    assert texture_options(load_target("adreno")) is not None
    state, _ = lowered_module(str(tiny_gguf), target, max_context=MAX_CONTEXT, schedule=False)
    assert not [k for k in state.weights if k.endswith("__tex")]


def _reference_weight(kernel: str, image_names: list[str], weights: dict) -> np.ndarray:
    """float64 W [N, K] from the *buffer* weights the images of a texture call were packed from
    (``weights``: the table as it entered passes/texture_weights.py, which then drops these buffers)."""
    from perfx_compiler.formats.int4 import Int4Format, unpack_int4

    src = image_names[0].removesuffix("__tex")
    m = re.match(r"texture_(?:take_q4_\d+_(\d+)_l\d+_[a-z0-9]+|q4_(?:matmul|dequant)_\d+_(\d+))_g(\d+)(s?)(m?)", kernel)
    if m is not None:
        k, g = int(m.group(1) or m.group(2)), int(m.group(3))
        fmt = Int4Format(g, bool(m.group(4)), bool(m.group(5)))
        codes = unpack_int4(weights[src], k, fmt.lanes(k)).astype(np.float64)
        s = np.repeat(weights[src + "_scale"].astype(np.float64), g, axis=1)[:, :k]
        if fmt.offset:
            return codes * s + np.repeat(weights[src + "_min"].astype(np.float64), g, axis=1)[:, :k]
        return (codes - np.repeat(weights[src + "_zero"].astype(np.float64), g, axis=1)[:, :k]) * s
    if re.match(r"texture_(take_q8_|q8_(matmul|dequant)_)", kernel):
        g = weights[src].shape[1] // weights[src + "_scale"].shape[1]
        return weights[src].astype(np.float64) * np.repeat(weights[src + "_scale"].astype(np.float64), g, axis=1)
    assert kernel.startswith(("texture_gemv_", "texture_gemm_", "texture_take_f32_")), kernel
    return weights[src].astype(np.float64)


def _run_texture_call(launcher, cf, name: str, args: list, weights: dict, buffers: dict, rows: tuple, rng) -> None:
    """Run one texture call of the model on its own images; check it against numpy on the buffers."""
    images = [a.name for a in args if a.name.endswith("__tex")]
    w = _reference_weight(name, images, buffers)
    n, k = w.shape
    if name.startswith("texture_take_"):
        ids = rng.integers(0, n, rows).astype(np.int64)
        ids.flat[-1] = n - 1
        got = launcher.run_numpy(cf, [*(weights[i] for i in images), ids, np.zeros((*rows, k), np.float32)])[-1]
        np.testing.assert_allclose(got, w[ids], rtol=1e-6, atol=1e-6 * float(np.abs(w).max()))
        return
    x = rng.standard_normal((*rows, k)).astype(np.float32)
    got = launcher.run_numpy(cf, [x, *(weights[i] for i in images), np.zeros((*rows, n), np.float32)])[-1]
    _check(got, (x.reshape(-1, k).astype(np.float64) @ w.T).reshape(-1), k)


def test_every_texture_kernel_of_smollm2_on_pocl(launcher, monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2's adreno build (GGUF Q4_1 linears, tied Q8_0 embedding / lm_head): every texture call of
    ``decode`` (121 GEMVs and the embedding gather), with the model's own packed images, matches numpy on
    the buffer weights they were packed from; so does each distinct texture kernel of ``prefill`` (the
    multi-row GEMMs, 3 rows). The build keeps one copy: no buffer of an imaged weight, and the table
    holds the quantized weights' bytes plus only the image scales' padding to whole texels."""
    from tvm import relax

    from perfx_compiler.kernels.tir_queries import has_texture_params
    from perfx_compiler.passes import texture_weights
    from perfx_compiler.targets_exec.kernels import compile_primfunc
    from perfx_compiler.targets_exec.reference import lowered_module

    entering: dict = {}
    apply = texture_weights.apply

    def keep_buffers(mod, weights, ctx):  # the table as the pass gets it: the reference, then dropped
        entering.update(weights)
        return apply(mod, weights, ctx)

    monkeypatch.setattr(texture_weights, "apply", keep_buffers)
    try:
        state, funcs = lowered_module("smollm2-135m", "adreno", max_context=MAX_CONTEXT, schedule=False)
    except Exception as err:  # noqa: BLE001 - the model package is an optional install
        pytest.skip(f"smollm2-135m not loadable: {err}")
    tex = texture_weights.texture_manifest(state.weights)
    assert len(tex) == 2 * (30 * 4 + 1), len(tex)  # codes + scales of 30 x (qkv, o, gate_up, down) + the embedding
    _assert_one_copy(state.weights, entering)
    tgt = state.target.tvm()
    compiled: dict[str, object] = {}
    rng = np.random.default_rng(0)
    checked: dict[str, int] = {}
    for fn, rows in (("decode", (1, 1)), ("prefill", (1, 3))):
        for block in state.mod[fn].body.blocks:
            for b in block.bindings:
                v = b.value
                if not (isinstance(v, relax.Call) and getattr(v.op, "name", "") == "relax.call_tir"):
                    continue
                name = v.args[0].name_hint
                if not has_texture_params(funcs[name]) or (fn == "prefill" and name in compiled):
                    continue
                if name not in compiled:
                    compiled[name] = compile_primfunc(name, funcs[name], tgt)
                call_rows = rows if fn == "prefill" or not name.startswith("texture_take_") else (1, 1)
                _run_texture_call(launcher, compiled[name], name, list(v.args[1].fields), state.weights, entering,
                                  call_rows, rng)
                checked[fn] = checked.get(fn, 0) + 1
    # decode: 30 layers x (qkv, o, gate_up, down) + the lm_head + the gather; prefill: its 4 GEMMs
    # + its lm_head (last token only: the decode GEMV, already built) + the gather of 3 tokens
    assert checked["decode"] == 30 * 4 + 2, checked
    assert len(compiled) == 6 + checked["prefill"], sorted(compiled)
    assert checked["prefill"] >= 4, checked
