"""OpenCL targets (adreno, mali, intel-igpu): every kernel on PoCL vs the host, then whole decode steps
through our launcher vs the x86 build's logits."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from targets_common import MAX_CONTEXT, TOKENS

pytestmark = pytest.mark.targets
OPENCL_TARGETS = ["adreno", "mali", "intel-igpu"]


@pytest.fixture(scope="module")
def launcher():
    from perfx_compiler.targets_exec.opencl import OpenCLLauncher, opencl_available

    why = opencl_available()
    if why is not None:
        pytest.skip(why)
    return OpenCLLauncher()


def _reference_func(name: str, cpu_funcs: dict, unscheduled: dict):
    """The host-runnable version of a kernel: attention's CPU kernel (x86 module), else the same
    PrimFunc before the schedule phase (hand-scheduled CPU kernels are still the CPU ones there; the
    x86 module itself differs: CPU builds pre-pack weights into panels)."""
    for gpu in ("cached_attention_gpu", "paged_attention_gpu"):
        if name.startswith(gpu):
            return cpu_funcs[name.replace(gpu, gpu[: -len("_gpu")])]
    return unscheduled[name]


@pytest.mark.parametrize("target", OPENCL_TARGETS)
@pytest.mark.parametrize("seq", [1, 3])
def test_every_kernel_on_pocl(target: str, seq: int, tiny_gguf: Path, launcher) -> None:
    from perfx_compiler.kernels.tir_queries import has_texture_params
    from perfx_compiler.targets_exec.kernels import compile_primfunc, random_inputs
    from perfx_compiler.targets_exec.reference import host_reference, lowered_module

    state, funcs = lowered_module(str(tiny_gguf), target, max_context=MAX_CONTEXT)
    _, cpu_funcs = lowered_module(str(tiny_gguf), "x86-avx2", max_context=MAX_CONTEXT, schedule=False)
    _, unscheduled = lowered_module(str(tiny_gguf), target, max_context=MAX_CONTEXT, schedule=False)
    tgt = state.target.tvm()
    checked = []
    for name, func in funcs.items():
        if has_texture_params(func):
            continue  # image-weight GEMVs (hand-scheduled, no host form): test_adreno_texture.py vs numpy
        cf = compile_primfunc(name, func, tgt)
        assert cf.launches, f"{name} has no device launch on {target}"
        ins = random_inputs(cf, {"seq": seq, "n": seq, "bsz": 1, "batch": 2, "pages": 8}, seed=len(checked))
        for i, (pname, _, _) in enumerate(cf.param_info()):
            if pname in ("PAST", "past_len") and isinstance(ins[i], np.ndarray):
                ins[i][:] = 7  # attention: 7 cached positions before the chunk
            if pname == "PT":  # paged attention: distinct pages per sequence, as the runtime allocates them
                ins[i][:] = np.random.default_rng(i).permutation(8)[: ins[i].size].reshape(ins[i].shape)
        got = launcher.run_numpy(cf, [a.copy() if isinstance(a, np.ndarray) else a for a in ins])
        ref = host_reference(
            _reference_func(name, cpu_funcs, unscheduled), [a.copy() if isinstance(a, np.ndarray) else a for a in ins]
        )
        for g, r in zip(got, ref, strict=True):
            if isinstance(g, np.ndarray) and g.size:
                tol = 1e-4 * max(1.0, float(np.abs(r).max()))
                assert np.abs(g.astype(np.float64) - r).max() <= tol, (
                    f"{target} {name}: max error {np.abs(g - r).max()}"
                )
        checked.append(name)
    assert any(re.match("cached_attention", n) for n in checked)
    assert any(re.match("paged_attention_gpu", n) for n in checked)
    print(f"{target} seq={seq}: {len(checked)} kernels match the host")


@pytest.mark.parametrize("target", OPENCL_TARGETS)
def test_decode_steps_through_launcher(target: str, tiny_gguf: Path, launcher, host_logits) -> None:
    from perfx_compiler.targets_exec.reference import lowered_module
    from perfx_compiler.targets_exec.relax_exec import run_decode_steps

    state, _ = lowered_module(str(tiny_gguf), target, max_context=MAX_CONTEXT)
    got = np.stack(run_decode_steps(state, launcher, TOKENS, state.weights))
    err = np.abs(got - host_logits).max()
    assert err < 1e-4, f"{target}: decode logits differ from x86 by {err}"
    assert (got.argmax(-1) == host_logits.argmax(-1)).all()


@pytest.mark.parametrize("target", ["adreno", "mali"])
def test_gemma3_decode_steps_through_launcher(target: str, gemma3_folder: Path, launcher, gemma3_host_logits) -> None:
    """A new family end to end on OpenCL: sliding-window attention kernels, QK-norm, GeGLU, sandwich norms."""
    from perfx_compiler.targets_exec.reference import lowered_module
    from perfx_compiler.targets_exec.relax_exec import run_decode_steps

    state, _ = lowered_module(str(gemma3_folder), target, max_context=MAX_CONTEXT)
    got = np.stack(run_decode_steps(state, launcher, TOKENS, state.weights))
    err = np.abs(got.reshape(gemma3_host_logits.shape) - gemma3_host_logits).max()
    assert err < 1e-4, f"{target}: Gemma 3 decode logits differ from x86 by {err}"
