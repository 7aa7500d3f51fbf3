"""adreno: the texture variant of GEMV (weights read through an RGBA image2d_array_t, lowered by the
project's assembled Adreno TIR pipeline with TextureFlatten) runs on PoCL's images and matches numpy."""

from __future__ import annotations

import re

import numpy as np
import pytest

pytestmark = pytest.mark.targets


@pytest.fixture(scope="module")
def launcher():
    from perfx_compiler.targets_exec.opencl import OpenCLLauncher, opencl_available

    why = opencl_available()
    if why is not None:
        pytest.skip(why)
    return OpenCLLauncher()


@pytest.mark.parametrize(("n", "k"), [(128, 64), (100, 40), (1536, 576)])  # last: SmolLM2's MLP up-projection
def test_texture_gemv_on_pocl_images(n: int, k: int, launcher) -> None:
    from perfx_compiler.kernels.gemv_texture import adreno_tir_pipeline, texture_gemv_kernel, to_texels
    from perfx_compiler.targets import load_target
    from perfx_compiler.targets_exec.kernels import compile_primfunc
    from perfx_compiler.targets_exec.opencl import texture_params

    cf = compile_primfunc(
        "texture_gemv", texture_gemv_kernel(n, k), load_target("adreno").tvm(), pipeline=adreno_tir_pipeline()
    )
    assert "image2d_array_t" in cf.source and "READ_IMAGEF" in cf.source, cf.source[:2000]
    assert not re.search(r"for \([^)]*\) \{\s*\}", cf.source), "empty loop in the OpenCL source"
    assert texture_params(cf) == {1}
    rng = np.random.default_rng(n + k)
    x = rng.standard_normal(k).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    got = launcher.run_numpy(cf, [x, to_texels(w), np.zeros(n, np.float32)])[2]
    want = w.astype(np.float64) @ x
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, float(np.abs(want).max())) * np.sqrt(k)


def test_registered_adreno_pipeline_is_not_a_triple() -> None:
    """Why the project assembles its own: TVM 0.27's registered pipeline cannot be unpacked by callers."""
    import tvm

    with pytest.raises(TypeError):
        _pipeline, _host, _device = tvm.tirx.get_tir_pipeline("adreno")
