"""Constants and random weights shared by the target checks."""

import re

import numpy as np

TOKENS = [5, 17, 42, 99, 3]
MAX_CONTEXT = 64


def gpu_launcher(target: str):
    """The launcher that runs ``target``'s kernels here: WGSL on lavapipe (vulkan), else OpenCL on PoCL;
    skips (a failure under CI=true) when that runtime is missing."""
    import pytest

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


def random_blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Uniformly random block bytes, d / dmin finite float16 of realistic size (1e-4..0.1, either sign;
    some subnormal, some zero)."""
    from perfx_compiler.formats import ggml

    fmt = ggml.FORMATS.get(qtype)
    weights, nbytes, fields = (fmt.block_weights, fmt.block_bytes, fmt.f16_fields) if fmt else (32, 22, (0,))  # Q5_0
    b = rng.integers(0, 256, size=(n, k // weights, nbytes), dtype=np.uint8)
    for at in fields:
        val = (10.0 ** rng.uniform(-6, -1, size=b.shape[:2]) * rng.choice([-1.0, 1.0, 0.0], size=b.shape[:2],
                                                                          p=[0.45, 0.45, 0.1]))
        b[:, :, at : at + 2] = val.astype(np.float16)[..., None].view(np.uint8)
    return b.reshape(n, -1)


def gpu_packed(qtype: str, raw: np.ndarray, shape: tuple[int, int], words: bool):
    """(the GPU layout's Packed, float64 weights) of random blocks."""
    from perfx_compiler.formats import ggml
    from perfx_compiler.formats.gguf_blocks import dequantize_blocks, packed_from_blocks
    from perfx_compiler.formats.superblocks import subscaled_packed

    if qtype not in ggml.FORMATS:
        return packed_from_blocks(qtype, raw, shape, words, gpu=True), dequantize_blocks(qtype, raw, shape)
    return (subscaled_packed(ggml.unpack(qtype, raw, shape), qtype, gpu=True, words=words),
            ggml.dequantize(qtype, raw, shape).astype(np.float64))


def compile_texture(func):
    """An Adreno texture kernel through the project's Adreno TIR pipeline: OpenCL source that reads images
    and prints no empty loop (TVM 0.27's codegen bug, kernels/gemv_texture.py)."""
    from perfx_compiler.kernels.gemv_texture import adreno_tir_pipeline
    from perfx_compiler.targets import load_target
    from perfx_compiler.targets_exec.kernels import compile_primfunc

    cf = compile_primfunc("texture", func, load_target("adreno").tvm(), pipeline=adreno_tir_pipeline())
    assert "image2d_array_t" in cf.source, cf.source[:2000]
    assert not re.search(r"for \([^)]*\) \{\s*\}", cf.source), "empty loop in the OpenCL source"
    return cf
