"""vulkan (WebGPU/WGSL): the model compiles with int32 indices; every kernel runs on lavapipe through wgpu
and matches the host; whole decode steps through our WGSL launcher match the x86 build's logits."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from targets_common import MAX_CONTEXT, TOKENS

pytestmark = pytest.mark.targets
SIZES = {"n": 1, "bsz": 1, "batch": 2, "pages": 8}


@pytest.fixture(scope="module")
def launcher():
    from perfx_compiler.targets_exec.webgpu import WebGPULauncher, webgpu_available

    why = webgpu_available()
    if why is not None:
        pytest.skip(why)
    return WebGPULauncher()


@pytest.fixture(scope="module")
def vulkan_module(tiny_gguf: Path):
    from perfx_compiler.targets_exec.reference import lowered_module

    return lowered_module(str(tiny_gguf), "vulkan", max_context=MAX_CONTEXT)


@pytest.fixture(scope="module")
def cpu_reference(tiny_gguf: Path) -> dict:
    """Host-runnable kernels: the vulkan module before scheduling (CPU builds pre-pack weights, so the
    x86 module's kernels differ) plus the x86 module's CPU attention for the GPU attention kernel."""
    from perfx_compiler.targets_exec.reference import lowered_module

    x86 = lowered_module(str(tiny_gguf), "x86-avx2", max_context=MAX_CONTEXT, schedule=False)[1]
    funcs = dict(lowered_module(str(tiny_gguf), "vulkan", max_context=MAX_CONTEXT, schedule=False)[1])
    funcs.update({n: f for n, f in x86.items() if n.startswith(("cached_attention", "paged_attention"))})
    return funcs


def reference_name(name: str) -> str:
    """The host-runnable kernel of a vulkan kernel (attention: the x86 CPU kernel, without the int32 suffix)."""
    for gpu in ("cached_attention_gpu", "paged_attention_gpu"):
        if name.startswith(gpu):
            return name.replace(gpu, gpu[: -len("_gpu")]).replace("_int32", "")
    return name


def test_vulkan_bundle_has_no_int64(tiny_gguf: Path, tmp_path: Path) -> None:
    from perfx_compiler.pipeline import compile_model

    out = compile_model(str(tiny_gguf), "vulkan", tmp_path / "vk", progress=False, max_context=MAX_CONTEXT)
    manifest = json.loads((out / "perfx-config.json").read_text())
    assert manifest["index_dtype"] == "int32"
    wgsl = (out / "kernels.wgsl").read_text()
    assert not re.search(r"\bi64\b|\bu64\b", wgsl)
    assert wgsl.count("@compute") >= 10


@pytest.mark.parametrize("seq", [1, 3])
def test_every_kernel_on_lavapipe(seq: int, vulkan_module, cpu_reference: dict, launcher) -> None:
    from perfx_compiler.targets_exec.kernels import compile_primfunc, func_param_info, random_inputs
    from perfx_compiler.targets_exec.reference import host_reference

    state, funcs = vulkan_module
    tgt = state.target.tvm()
    checked = []
    for i, (name, func) in enumerate(funcs.items()):
        cf = compile_primfunc(name, func, tgt)
        assert cf.launches, f"{name} has no device launch on vulkan"
        assert "i64" not in cf.source, f"{name}: WGSL with 64-bit integers"
        ins = random_inputs(cf, {**SIZES, "seq": seq}, seed=i)
        for k, (pname, _, _) in enumerate(cf.param_info()):
            if pname == "PAST":
                ins[k][:] = 7  # attention: 7 cached positions before the chunk
            if pname == "PT":  # paged attention: distinct pages per sequence, as the runtime allocates them
                ins[k][:] = np.random.default_rng(i).permutation(SIZES["pages"])[: ins[k].size].reshape(ins[k].shape)
        got = launcher.run_numpy(cf, [a.copy() if isinstance(a, np.ndarray) else a for a in ins])
        ref_func = cpu_reference[reference_name(name)]
        # the CPU module takes int64 indices where vulkan's take int32
        ref_ins = [
            a.astype(dt) if isinstance(a, np.ndarray) else a
            for a, (_, _, dt) in zip(ins, func_param_info(ref_func), strict=True)
        ]
        ref = host_reference(ref_func, ref_ins)
        for g, r in zip(got, ref, strict=True):
            if isinstance(g, np.ndarray) and g.size:
                tol = 1e-4 * max(1.0, float(np.abs(r).max()))
                err = np.abs(g.astype(np.float64) - r).max()
                assert err <= tol, f"vulkan {name} seq={seq}: max error {err}"
        checked.append(name)
    assert any(n.startswith("cached_attention_gpu") for n in checked)
    assert any(n.startswith("paged_attention_gpu") for n in checked)
    print(f"vulkan seq={seq}: {len(checked)} kernels on {launcher.adapter.info['device']} match the host")


def test_decode_steps_through_wgsl_launcher(vulkan_module, launcher, host_logits) -> None:
    from perfx_compiler.targets_exec.relax_exec import run_decode_steps

    state, _ = vulkan_module
    before = launcher.launches
    got = np.stack(run_decode_steps(state, launcher, TOKENS, state.weights))
    err = np.abs(got - host_logits).max()
    assert err < 1e-4, f"vulkan: decode logits differ from x86 by {err}"
    assert (got.argmax(-1) == host_logits.argmax(-1)).all()
    print(f"vulkan decode: {len(TOKENS)} steps, {launcher.launches - before} WGSL launches, max |logit - x86| = {err:.2e}")


@pytest.fixture(scope="module")
def tiny_q4_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GGUF quantized as SmolLM2's file is: Q4_1 linears, Q8_0 embedding (tied lm_head)."""
    from perfx_compiler.model.testing import write_tiny_gguf

    path, _ = write_tiny_gguf(
        tmp_path_factory.mktemp("tinyq") / "tiny-q4_1.gguf", qtype="Q4_1", embed_qtype="Q8_0", context_length=128
    )
    return path


def test_gguf_int4_decode_on_lavapipe_matches_x86(tiny_q4_gguf: Path, launcher, tmp_path: Path) -> None:
    """--quantization auto keeps the GGUF blocks on vulkan: int4 GEMVs, int8 gather/lm_head read as uint32
    words, int32 ids; decode logits through the WGSL launcher = the x86 build of the same file."""
    from perfx_compiler.pipeline import compile_model
    from perfx_compiler.runtime.engine import Engine
    from perfx_compiler.targets_exec.reference import lowered_module
    from perfx_compiler.targets_exec.relax_exec import run_decode_steps

    state, funcs = lowered_module(str(tiny_q4_gguf), "vulkan", max_context=MAX_CONTEXT)
    assert state.options.quantization == "gguf"
    quant = {n: f for n, f in funcs.items() if f.attrs is not None and "perfx.quant" in f.attrs}
    kinds = {json.loads(str(f.attrs["perfx.quant"]))["bits"] for f in quant.values()}
    assert kinds == {4, 8}, sorted(funcs)  # int4 linears and the int8 embedding are kernels of their own
    assert any("take" in n for n in quant), sorted(quant)
    for name, f in quant.items():
        dtypes = {str(p.ty.dtype) for p in f.params if hasattr(p.ty, "dtype") and hasattr(p.ty, "shape")}
        assert not dtypes & {"int8", "uint8", "int64"}, (name, dtypes)
    got = np.stack(run_decode_steps(state, launcher, TOKENS, state.weights))
    host = compile_model(  # float activations, as on vulkan (VNNI hosts would default to int8)
        str(tiny_q4_gguf), "host", tmp_path / "x86", progress=False, max_context=MAX_CONTEXT, activations="f32"
    )
    engine = Engine(host)
    want = np.stack([engine.decode(t) for t in TOKENS])
    err = np.abs(got - want).max()
    assert err < 1e-4 * max(1.0, float(np.abs(want).max())), f"vulkan gguf: decode logits differ from x86 by {err}"
    assert (got.argmax(-1) == want.argmax(-1)).all()
    print(f"vulkan gguf Q4_1/Q8_0: {len(quant)} quantized kernels, max |logit - x86| = {err:.2e}")


def test_int4_zero_words_kernel_matches_numpy() -> None:
    """Zero points as uint32 words (4 groups a word, the last one padded): the reference kernel reads each
    group's own byte; random asymmetric codes and zeros, 5 groups a row (a ragged last word), vs numpy."""
    import tvm

    from perfx_compiler.formats.int4 import Int4Format, dequantize_int4, int4_packed, quantize_int4

    rng = np.random.default_rng()
    n, k, fmt = 24, 160, Int4Format(32, symmetric=False)
    w = rng.standard_normal((n, k)).astype(np.float32) + rng.uniform(-2, 2, (n, 1)).astype(np.float32)
    codes, scale, zero = quantize_int4(w, fmt)
    assert len(np.unique(zero)) > 3  # zeros that differ between groups: a wrong byte would show
    packed = int4_packed(codes, scale, zero, fmt, words=True)
    arrays = dict(packed.arrays)
    assert arrays["_q4_zero"].dtype == np.uint32 and arrays["_q4_zero"].shape == (n, 2)
    func = packed.compute("matmul", (1, 1), "int32")
    assert json.loads(str(func.attrs["perfx.quant"]))["words"] is True
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), "llvm")
    x = rng.standard_normal((1, 1, k)).astype(np.float32)
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.zeros((1, 1, n), np.float32), dev)
    lib["main"](*[tvm.runtime.tensor(a, dev) for a in (x, *arrays.values())], out)
    want = x[0].astype(np.float64) @ dequantize_int4(codes, scale, zero, 32).astype(np.float64).T
    assert np.abs(out.numpy()[0] - want).max() < 1e-4 * max(1.0, float(np.abs(want).max()))


@pytest.mark.parametrize(("qtype", "quantization"), [("Q4_0", "auto"), ("F32", "q4_g32")])
def test_int4_zero_points_decode_on_lavapipe_matches_x86(
    qtype: str, quantization: str, launcher, tmp_path: Path
) -> None:
    """GGUF Q4_0 (zero 8, no array) and asymmetric q4_g32 (a zero per group) on vulkan: the zero points
    travel as uint32 words (no 8-bit tensors in WGSL); decode logits through the WGSL launcher = the x86 build."""
    from perfx_compiler.model.testing import write_tiny_gguf
    from perfx_compiler.pipeline import compile_model
    from perfx_compiler.runtime.engine import Engine
    from perfx_compiler.targets_exec.reference import lowered_module
    from perfx_compiler.targets_exec.relax_exec import run_decode_steps

    path, _ = write_tiny_gguf(
        tmp_path / f"tiny-{qtype}.gguf", qtype=qtype, embed_qtype="Q8_0" if qtype != "F32" else None,
        context_length=128,
    )
    state, funcs = lowered_module(str(path), "vulkan", max_context=MAX_CONTEXT, quantization=quantization)
    q4 = {n: f for n, f in funcs.items() if f.attrs is not None and '"bits": 4' in str(f.attrs.get("perfx.quant", ""))}
    assert q4, sorted(funcs)
    for name, f in q4.items():
        assert json.loads(str(f.attrs["perfx.quant"])).get("words") is True, name
        dtypes = {str(p.ty.dtype) for p in f.params if hasattr(p.ty, "dtype") and hasattr(p.ty, "shape")}
        assert not dtypes & {"int8", "uint8", "int64"}, (name, dtypes)
    zeros = [np.asarray(v).view(np.uint8) for k, v in state.weights.items() if k.endswith("_q4_zero")]
    if quantization == "q4_g32":
        assert zeros and all(z.dtype == np.uint8 for z in zeros)
        assert len(np.unique(np.concatenate([z.ravel() for z in zeros]))) > 3  # zeros differ per group
    else:
        assert not zeros  # Q4_0 is symmetric: zero point 8 in the kernels, no array
    got = np.stack(run_decode_steps(state, launcher, TOKENS, state.weights))
    host = compile_model(
        str(path), "host", tmp_path / "x86", progress=False, max_context=MAX_CONTEXT, activations="f32",
        quantization=quantization,
    )
    engine = Engine(host)
    want = np.stack([engine.decode(t) for t in TOKENS])
    err = np.abs(got - want).max()
    assert err < 1e-4 * max(1.0, float(np.abs(want).max())), f"vulkan {qtype}/{quantization}: logits differ by {err}"
    assert (got.argmax(-1) == want.argmax(-1)).all()
    print(f"vulkan {qtype}/{quantization}: {len(q4)} int4 kernels, max |logit - x86| = {err:.2e}")


def test_gemma3_decode_steps_on_lavapipe(gemma3_folder: Path, launcher, gemma3_host_logits) -> None:
    """A new family end to end through WGSL (int32 indices): windowed attention, QK-norm, GeGLU."""
    from perfx_compiler.targets_exec.reference import lowered_module
    from perfx_compiler.targets_exec.relax_exec import run_decode_steps

    state, _ = lowered_module(str(gemma3_folder), "vulkan", max_context=MAX_CONTEXT)
    got = np.stack(run_decode_steps(state, launcher, TOKENS, state.weights))
    err = np.abs(got.reshape(gemma3_host_logits.shape) - gemma3_host_logits).max()
    assert err < 1e-4, f"vulkan: Gemma 3 decode logits differ from x86 by {err}"
