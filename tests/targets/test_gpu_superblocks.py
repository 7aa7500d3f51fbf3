"""GGUF superblock weights (K-quants, IQ4_XS) kept as blocks on GPU targets: the GPU layout of
``formats/superblocks.py`` (group values int8 or uint32 words, superblock d as float32 bits) through the
GPU templates (dlight GEMV; take / dequant by the fallback) on PoCL (OpenCL) and lavapipe (WGSL) vs
float64 numpy on fresh random blocks; a llama.cpp Q4_K_M model decoded on PoCL = the x86 build; the
CUDA kernels of the new layout built by nvcc without spills."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from targets_common import MAX_CONTEXT, TOKENS, gpu_launcher, gpu_packed, random_blocks

pytestmark = pytest.mark.targets
N, K = 48, 512  # two superblocks a row
KINDS = {"matmul": (1, 1), "take": (1, None), "dequant": (None, None)}


def scheduled(func, target_name: str):
    """The GPU templates' kernel of a reference PrimFunc for ``target_name`` (vulkan: int32 indices)."""
    import tvm

    from perfx_compiler.gpu_adapt import bind_host_kernels
    from perfx_compiler.kernels.tir_queries import has_device_launch
    from perfx_compiler.narrow_index import narrow_to_int32
    from perfx_compiler.schedule import apply_schedules
    from perfx_compiler.targets import load_target

    target = load_target(target_name)
    mod = apply_schedules(tvm.IRModule({"q": func}), target, None)
    mod, adapted = bind_host_kernels(mod, target)
    if target_name == "vulkan":
        mod = narrow_to_int32(mod)
    assert has_device_launch(mod["q"]) and not adapted, f"{target_name}: no GPU schedule"
    return mod["q"], target


def check_kernel(qtype: str, kind: str, target_name: str, launcher, seed: int | None = None, k: int = K) -> str:
    """Compile ``kind`` of a random ``qtype`` weight [N, k] for the target, run it, compare with float64
    numpy; returns the kernel source."""
    from perfx_compiler.targets_exec.kernels import compile_primfunc

    seed = int(np.random.default_rng().integers(1 << 30)) if seed is None else seed
    rng = np.random.default_rng(seed)
    words = target_name == "vulkan"
    raw = random_blocks(qtype, N, k, rng)
    pk, w = gpu_packed(qtype, raw, (N, k), words)
    w = w.astype(np.float64)
    ids_dtype = "int32" if words else "int64"
    func = pk.compute(kind, KINDS[kind], ids_dtype)
    info = json.loads(str(func.attrs["perfx.quant"]))
    assert info.get("gpu_factors", False) == bool(info.get("sb")) and info.get("words", False) == words
    gpu, target = scheduled(func, target_name)
    cf = compile_primfunc("q", gpu, target.tvm())
    assert cf.launches
    arrays = dict(pk.arrays)
    x = rng.standard_normal((1, 3, k)).astype(np.float32)
    ids = np.array([[0, N - 1, 17]], dtype=ids_dtype)
    args, shapes = [], {"matmul": (1, 1, N), "take": (1, 3, k), "dequant": (N, k)}
    for name, _, dtype in cf.param_info():
        suffix = name.replace("scale", "_scale").replace("min", "_min").replace("q_hi", "_hi")
        if name == "x":
            args.append(x[:, :1])
        elif name == "ids":
            args.append(ids)
        elif name.startswith(("matmul", "take", "dequant")):
            args.append(np.full(shapes[kind], np.nan, dtype=np.float32))
        else:
            a = arrays[f"_{pk.family}" + ("" if name == "q" else suffix)]
            assert str(a.dtype) == dtype, (name, a.dtype, dtype)
            args.append(a.copy())
    got = launcher.run_numpy(cf, args)[-1].astype(np.float64)
    want = {"matmul": lambda: x[:, :1].astype(np.float64) @ w.T, "take": lambda: w[ids.astype(np.int64)[0]][None],
            "dequant": lambda: w}[kind]()
    err = float(np.abs(got - want).max())
    tol = 1e-5 * max(1.0, float(np.abs(want).max()))
    assert err <= tol, f"{qtype} {kind} on {target_name} (seed {seed}): max error {err:g}"
    return cf.source


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("target", ["mali", "vulkan"])
def test_q4k_q6k_kernels(target: str, qtype: str, kind: str) -> None:
    launcher = gpu_launcher(target)
    src = check_kernel(qtype, kind, target, launcher)
    assert "half" not in src and "f16" not in src  # PoCL has no cl_khr_fp16: d is read as float32 bits
    if target == "vulkan":
        assert not re.search(r"\b[iu](8|64)\b", src)


@pytest.mark.parametrize("qtype", ["Q5_K", "Q3_K", "Q2_K", "IQ4_XS"])
@pytest.mark.parametrize("target", ["adreno", "intel-igpu", "vulkan"])
def test_other_superblock_gemvs(target: str, qtype: str) -> None:
    check_kernel(qtype, "matmul", target, gpu_launcher(target))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "IQ4_XS"])
def test_rows_of_whole_superblocks_not_words(qtype: str) -> None:
    """K = 2816 (TinyLlama's FFN down: 88 groups of 32, not a whole number of 2-bit plane words): the
    group-value planes are padded to whole words and read right."""
    check_kernel(qtype, "matmul", "mali", gpu_launcher("mali"), k=2816)


@pytest.mark.parametrize("kind", ["matmul", "take"])
@pytest.mark.parametrize("qtype", ["IQ4_NL", "Q5_1", "Q5_0"])
def test_one_level_types_on_lavapipe(qtype: str, kind: str) -> None:
    """IQ4_NL (table indices), Q5_1 and Q5_0 (5-bit word planes), float16 scale (and min) tables, on WGSL.
    (Not on PoCL: their float16 tables need cl_khr_fp16, as Q4_1 / Q8_0 do.)"""
    check_kernel(qtype, kind, "vulkan", gpu_launcher("vulkan"))


@pytest.mark.parametrize("qtype", ["Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ4_NL", "Q5_1", "Q5_0"])
def test_gpu_layout_holds_the_files_bytes(qtype: str) -> None:
    """The GPU layout's arrays (codes in word planes, factors in gpu_factors' uint32 arrays) take at most
    1.03x the blocks' bytes (issue #25's bound), every array 32-bit (WGSL) but the one-level types' float16
    tables; the codes come back from the planes exactly."""
    from perfx_compiler.formats import bitplanes, ggml

    n, k = 8, 2816
    raw = random_blocks(qtype, n, k, np.random.default_rng(3))
    pk, _ = gpu_packed(qtype, raw, (n, k), False)
    assert pk.nbytes <= 1.03 * raw.nbytes, (qtype, pk.nbytes / raw.nbytes)
    assert all(a.dtype in (np.uint32, np.float16) for _, a in pk.arrays), [(nm, a.dtype) for nm, a in pk.arrays]
    info = json.loads(str(pk.compute("matmul", (1, 1)).attrs["perfx.quant"]))
    if qtype in ggml.FORMATS and pk.family == "q8":
        bits = info["code_bits"]
        planes = [a for nm, a in pk.arrays if nm in ("_q8", "_q8_hi")]
        codes = bitplanes.unpack_word_planes(planes, k, bits).astype(np.int16)
        want = ggml.unpack(qtype, raw, (n, k)).codes.astype(np.int16)
        if bits == 4:
            from perfx_compiler.formats.vnni import table_indices

            want = table_indices(want.astype(np.int8), "iq4nl")
        elif not info.get("offset"):
            want = want + (1 << (bits - 1))
        assert np.array_equal(codes, want)


def test_half_bits_every_finite_float16() -> None:
    """kernels/half_bits.te_half (float16 bits -> float32 by integer operations, for devices without float16)
    equals numpy's conversion for every finite float16, subnormals and both zeros included."""
    import tvm
    from tvm import te

    from perfx_compiler.kernels.half_bits import te_half

    bits = np.arange(1 << 16, dtype=np.uint32)
    bits = bits[np.isfinite(bits.astype(np.uint16).view(np.float16))]
    h = te.placeholder((bits.size,), "uint32", name="h")
    out = te.compute((bits.size,), lambda i: te_half(h[i]), name="out")
    f = tvm.compile(te.create_prim_func([h, out]), target="llvm")
    dev = tvm.cpu()
    got = tvm.runtime.tensor(np.zeros(bits.size, np.float32), dev)
    f(tvm.runtime.tensor(bits, dev), got)
    want = bits.astype(np.uint16).view(np.float16).astype(np.float32)
    assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))


def test_gemv_is_the_dlight_gemv() -> None:
    """The decode GEMV is dlight's GEMV (K split over threads, a cross-thread reduction), not the fallback."""
    from perfx_compiler.formats import ggml
    from perfx_compiler.formats.superblocks import subscaled_packed

    raw = random_blocks("Q4_K", N, K, np.random.default_rng(0))
    func = subscaled_packed(ggml.unpack("Q4_K", raw, (N, K)), "Q4_K", gpu=True).compute("matmul", (1, 1))
    gpu, _ = scheduled(func, "mali")
    script = gpu.script()
    assert "_rf_local" in script and "threadIdx.x" in script, script  # rfactor: K over threads


@pytest.fixture(scope="module")
def q4_k_m_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random model quantized by llama.cpp itself to Q4_K_M (Q4_K + Q6_K)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (llama.cpp's quantizer) not installed")
    from perfx_compiler.bench.models import llama_quantize
    from perfx_compiler.model.testing import write_tiny_gguf

    tmp = tmp_path_factory.mktemp("q4km")
    f32, _ = write_tiny_gguf(tmp / "f32.gguf", qtype="F32", hidden=256, ffn=512, heads=4, kv_heads=2, vocab=320,
                             tied=False, context_length=128, seed=7)
    return llama_quantize(f32, tmp / "q4_k_m.gguf", "Q4_K_M")


@pytest.fixture(scope="module")
def q4_k_m_x86_logits(q4_k_m_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    """Decode logits of TOKENS from the x86 build of the Q4_K_M file (float activations, as on GPUs)."""
    from perfx_compiler.pipeline import compile_model
    from perfx_compiler.runtime.engine import Engine

    host = compile_model(str(q4_k_m_gguf), "host", tmp_path_factory.mktemp("q4kmx86") / "a", progress=False,
                         max_context=MAX_CONTEXT, activations="f32")
    engine = Engine(host)
    return np.stack([engine.decode(t) for t in TOKENS])


@pytest.mark.parametrize("target", ["mali", "adreno", "vulkan"])
def test_float_model_quantized_to_q4_k_on_gpu_matches_x86(target: str, tmp_path: Path) -> None:
    """``--quantization q4_k`` on a GPU target: a float model's linears and its (untied, gathered) embedding become
    Q4_K blocks (llama.cpp's quantizer) in the GPU superblock layout, the same kernels a Q4_K file runs (no float32
    matrix); decode logits on PoCL (mali; adreno: the linears as images) / lavapipe (vulkan: 32-bit words only)
    = the x86 build of the same quantization with float activations."""
    from perfx_compiler.model.gguf import load_gguf
    from perfx_compiler.model.testing import write_tiny_gguf
    from perfx_compiler.pipeline import compile_model
    from perfx_compiler.runtime.engine import Engine
    from perfx_compiler.targets_exec.reference import lowered_module
    from perfx_compiler.targets_exec.relax_exec import run_decode_steps

    f32, _ = write_tiny_gguf(tmp_path / "f32.gguf", qtype="F32", hidden=256, ffn=512, heads=4, kv_heads=2, vocab=320,
                             tied=False, context_length=128, seed=9)
    desc = load_gguf(f32)
    host = Engine(compile_model(desc, "host", tmp_path / "x86", progress=False, max_context=MAX_CONTEXT,
                                quantization="q4_k", activations="f32"))
    want = np.stack([host.decode(t) for t in TOKENS])
    state, funcs = lowered_module(desc, target, max_context=MAX_CONTEXT, quantization="q4_k")
    quant = [json.loads(str(f.attrs["perfx.quant"])) for f in funcs.values()
             if f.attrs is not None and "perfx.quant" in f.attrs]
    assert quant and all(q.get("sb") and q["bits"] == 4 for q in quant), quant  # every linear: Q4_K blocks
    floats = [n for n, w in state.weights.items()
              if np.ndim(w) == 2 and np.asarray(w).dtype == np.float32 and not n.startswith("rope_")]
    assert floats == [], floats  # the gathered embedding too: blocks
    if target == "adreno":  # 2 layers x (qkv, o, gate_up, down) and the lm_head
        assert sum(n.endswith("_q4_sb__tex") for n in state.weights) == 9, sorted(state.weights)
    got = np.stack(run_decode_steps(state, gpu_launcher(target), TOKENS, state.weights))
    err = np.abs(got - want).max()
    assert err < 1e-4 * max(1.0, float(np.abs(want).max())), f"{target} q4_k: decode logits differ from x86 by {err}"
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.parametrize("target", ["mali", "adreno", "vulkan"])
def test_q4_k_m_decode_matches_x86(target: str, q4_k_m_gguf: Path, q4_k_m_x86_logits: np.ndarray,
                                   tmp_path: Path) -> None:
    """Every linear and the embedding of a llama.cpp Q4_K_M file stay blocks (Q4_K int4, Q6_K int8 kernels;
    no float32 matrix in the bundle's manifest); decode logits through the OpenCL launcher on PoCL (mali)
    or the WGSL launcher on lavapipe (vulkan: 32-bit words only) = the x86 build of the same file. On Adreno
    every linear's Q4_K / Q6_K blocks are images only (kernels/texture_superblocks.py), read by the texture
    GEMVs; the embedding, only gathered, keeps its buffers."""
    from perfx_compiler.model.gguf_header import read_gguf_header
    from perfx_compiler.pipeline import compile_model
    from perfx_compiler.targets_exec.reference import lowered_module
    from perfx_compiler.targets_exec.relax_exec import run_decode_steps

    launcher = gpu_launcher(target)
    types = {t.tensor_type.name for t in read_gguf_header(q4_k_m_gguf).tensors if len(t.shape) == 2}
    assert {"Q4_K", "Q6_K"} <= types, types
    state, funcs = lowered_module(str(q4_k_m_gguf), target, max_context=MAX_CONTEXT)
    assert state.options.quantization == "gguf"
    quant = {n: json.loads(str(f.attrs["perfx.quant"])) for n, f in funcs.items()
             if f.attrs is not None and "perfx.quant" in f.attrs}
    assert {q["bits"] for q in quant.values() if q.get("sb")} == {4, 8}, sorted(funcs)  # Q4_K and Q6_K
    assert any(q["kind"] == "take" and q.get("sb") for q in quant.values())  # the Q4_K embedding
    if target == "adreno":
        from perfx_compiler.kernels.tir_queries import has_texture_params

        images = {n for n in state.weights if n.endswith("_sb__tex")}
        assert any("_q4_" in n for n in images) and any("_q8_" in n for n in images), sorted(state.weights)
        buffers = {n for n, w in state.weights.items() if np.ndim(w) == 2 and not n.endswith("__tex")
                   and not n.startswith(("rope_", "model_embed_tokens"))}
        assert not buffers, sorted(buffers)  # every linear: images only
        kernels = {n for n, f in funcs.items() if n.startswith("texture_") and has_texture_params(f)}
        for fmt in ("q4", "q8"):  # Q4_K and Q6_K: decode GEMVs and prefill's multi-row kernels on the images
            assert any(n.startswith(f"texture_{fmt}_matmul") for n in kernels), sorted(kernels)
            assert any(n.startswith(f"texture_{fmt}_dequant") and n.endswith("_rows") for n in kernels), sorted(kernels)
    if target == "vulkan":
        for name in quant:
            dtypes = {str(p.ty.dtype) for p in funcs[name].params if hasattr(p.ty, "dtype") and hasattr(p.ty, "shape")}
            assert not dtypes & {"int8", "uint8", "int64", "float16"}, (name, dtypes)
    out = compile_model(str(q4_k_m_gguf), target, tmp_path / target, progress=False, max_context=MAX_CONTEXT)
    stored = json.loads((out / "perfx-config.json").read_text())["weights"]
    floats = [w["name"] for w in stored if w["dtype"] == "float32" and len(w["shape"]) == 2
              and not w["name"].startswith("rope_")]
    assert not floats, floats
    got = np.stack(run_decode_steps(state, launcher, TOKENS, state.weights))
    want = q4_k_m_x86_logits
    err = np.abs(got - want).max()
    assert err < 1e-4 * max(1.0, float(np.abs(want).max())), f"{target} Q4_K_M: decode logits differ from x86 by {err}"
    assert (got.argmax(-1) == want.argmax(-1)).all()
    print(f"{target} Q4_K_M: {len(quant)} quantized kernels, max |logit - x86| = {err:.2e}")


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_K"])
def test_cuda_superblock_gemv_no_spills(qtype: str, tmp_path: Path) -> None:
    """The GEMV and take kernels of the GPU layout for cuda-sm80: CUDA C that nvcc builds (``-Xptxas -v``)
    without spills."""
    from perfx_compiler.device_export import nvcc_cubin, parse_ptxas
    from perfx_compiler.formats import ggml
    from perfx_compiler.formats.superblocks import subscaled_packed
    from perfx_compiler.targets_exec.kernels import compile_primfunc

    if shutil.which("nvcc") is None and not Path("/usr/local/bin/nvcc").exists():
        pytest.skip("nvcc not found (CUDA toolkit)")
    raw = random_blocks(qtype, N, K, np.random.default_rng(1))
    pk = subscaled_packed(ggml.unpack(qtype, raw, (N, K)), qtype, gpu=True)
    for kind in ("matmul", "take"):
        gpu, target = scheduled(pk.compute(kind, KINDS[kind]), "cuda-sm80")
        src = compile_primfunc("q", gpu, target.tvm()).source
        assert "__global__" in src and "half" not in src, src[:2000]
        res = nvcc_cubin(src, "sm_80", tmp_path, stem=kind)
        assert "error" not in res, res["error"]
        stats = parse_ptxas(res["log"])
        assert stats, res["log"]
        assert not any(v["spill_stores"] or v["spill_loads"] for v in stats.values()), stats
        print(qtype, kind, {k: v["registers"] for k, v in stats.items()})


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_rocm_superblock_gemv_no_scratch(qtype: str) -> None:
    """The GEMV and take kernels of the GPU layout for rocm-gfx942: AMDGPU assembly without scratch (spills)."""
    import os

    from perfx_compiler.device_export import parse_amdgpu_asm, prepare_build_env
    from perfx_compiler.formats import ggml
    from perfx_compiler.formats.superblocks import subscaled_packed
    from perfx_compiler.targets import load_target
    from perfx_compiler.targets_exec.kernels import compile_primfunc

    prepare_build_env(load_target("rocm-gfx942"))
    if not os.environ.get("ROCM_PATH"):
        pytest.skip("no ROCm bitcode / ld.lld-19 (run tests/setup.sh)")
    raw = random_blocks(qtype, N, K, np.random.default_rng(2))
    pk = subscaled_packed(ggml.unpack(qtype, raw, (N, K)), qtype, gpu=True)
    for kind in ("matmul", "take"):
        gpu, target = scheduled(pk.compute(kind, KINDS[kind]), "rocm-gfx942")
        stats = parse_amdgpu_asm(compile_primfunc("q", gpu, target.tvm()).runtime_module.inspect_source("asm"))
        assert stats and not [k for k, v in stats.items() if v["scratch_bytes"]], stats
        print(qtype, kind, {k: v["vgpr"] for k, v in stats.items()})


def test_q4_k_m_cuda_bundle_no_spills(q4_k_m_gguf: Path, tmp_path: Path) -> None:
    """The whole Q4_K_M model for cuda-sm80: blocks kept (no float32 matrix), every kernel in the nvcc-built
    cubin, the GEMV / matmul / attention kernels without spills (as test_cuda_rocm_codegen.py)."""
    from perfx_compiler.device_export import parse_ptxas
    from perfx_compiler.pipeline import compile_model

    if shutil.which("nvcc") is None and not Path("/usr/local/bin/nvcc").exists():
        pytest.skip("nvcc not found (CUDA toolkit)")
    out = compile_model(str(q4_k_m_gguf), "cuda-sm80", tmp_path / "cuda", progress=False, max_context=MAX_CONTEXT)
    manifest = json.loads((out / "perfx-config.json").read_text())
    assert not [w["name"] for w in manifest["weights"] if w["dtype"] == "float32" and len(w["shape"]) == 2
                and not w["name"].startswith("rope_")]
    facts = manifest["device_code"]["cubin"]
    assert "error" not in facts, facts
    stats = parse_ptxas((out / f"kernels.{facts['arch']}.ptxas.txt").read_text())
    hot = {k: v for k, v in stats.items() if any(h in k for h in ("matmul", "attention", "gemv", "take"))}
    assert any("q4" in k for k in hot) and any("q8" in k for k in hot), sorted(stats)
    assert not {k: v for k, v in hot.items() if v["spill_stores"] or v["spill_loads"]}


def test_adreno_keeps_bit_plane_weights_in_buffers(tmp_path: Path) -> None:
    """Q5_0 codes travel in word planes on GPUs (``code_bits`` 5): Adreno's image path (texture_weights) has no
    layout for them and leaves them buffers, read by the buffer GEMVs. (PoCL has no cl_khr_fp16 to run Q5_0's float16 scales: lavapipe runs them, above.)"""
    from perfx_compiler.kernels.tir_queries import has_texture_params
    from perfx_compiler.model.testing import write_tiny_gguf
    from perfx_compiler.targets_exec.reference import lowered_module

    path, _ = write_tiny_gguf(tmp_path / "q5_0.gguf", qtype="Q5_0", hidden=128, ffn=256, vocab=320)
    state, funcs = lowered_module(str(path), "adreno", max_context=MAX_CONTEXT)
    quant = {n: json.loads(str(f.attrs["perfx.quant"])) for n, f in funcs.items()
             if f.attrs is not None and "perfx.quant" in f.attrs}
    planes = [n for n, q in quant.items() if q.get("code_bits") == 5]
    assert planes, sorted(quant)
    assert not any(has_texture_params(funcs[n]) for n in planes), planes
    assert not any(n.endswith("__tex") for n in state.weights), sorted(state.weights)
