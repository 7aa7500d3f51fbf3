"""GPU variants of the hand-scheduled CPU kernels (``gpu_adapt.gpu_variant``): real thread-bound kernels,
run on PoCL (OpenCL) against the CPU kernel they replace, on fresh random rows."""

from __future__ import annotations

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


@pytest.mark.parametrize("hidden", [576, 100])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_gpu_variant_on_pocl(hidden: int, residual: bool, launcher) -> None:
    import tvm

    from perfx_compiler.gpu_adapt import bind_host_kernels, has_device_launch
    from perfx_compiler.passes._kernels import rms_norm_kernel
    from perfx_compiler.targets import load_target
    from perfx_compiler.targets_exec.kernels import compile_primfunc, random_inputs
    from perfx_compiler.targets_exec.reference import host_reference

    cpu = rms_norm_kernel(hidden, 1e-5, residual)
    name = f"{'add_' if residual else ''}rms_norm_{hidden}_1em05"
    target = load_target("mali")
    mod, adapted = bind_host_kernels(tvm.IRModule({name: cpu}), target)
    assert adapted == [], "RMSNorm must get its GPU variant, not the single-thread fallback"
    gpu = mod[name]
    assert has_device_launch(gpu) and "shared" in gpu.script()
    cf = compile_primfunc(name, gpu, target.tvm())
    for bsz, n in ((1, 1), (1, 7), (2, 3)):
        ins = random_inputs(cf, {"bsz": bsz, "n": n}, seed=hidden * 10 + n)
        plan = cf.plan(ins)
        assert plan[0].block[0] > 1 and plan[0].grid[0] * plan[0].grid[1] == bsz * n  # one block per row
        got = launcher.run_numpy(cf, [a.copy() if isinstance(a, np.ndarray) else a for a in ins])
        ref = host_reference(cpu, [a.copy() if isinstance(a, np.ndarray) else a for a in ins])
        outs = [(g, r) for g, r in zip(got, ref, strict=True) if isinstance(g, np.ndarray)]
        for g, r in outs:
            assert np.abs(g.astype(np.float64) - r).max() <= 1e-5 * max(1.0, float(np.abs(r).max()))


def test_unknown_cpu_kernel_still_falls_back() -> None:
    """A CPU kernel without a GPU variant keeps the single-thread fallback (and is reported)."""
    import tvm
    from tvm.script import tirx as T

    from perfx_compiler.gpu_adapt import bind_host_kernels, has_device_launch
    from perfx_compiler.targets import load_target

    @T.prim_func(private=True)
    def scale_rows(a: T.Buffer((T.int64(4), T.int64(8)), "float32"), b: T.Buffer((T.int64(4), T.int64(8)), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for i in T.parallel(T.int64(4)):
            for j in T.vectorized(T.int64(8)):
                b[i, j] = a[i, j] * T.float32(2)

    mod, adapted = bind_host_kernels(tvm.IRModule({"scale_rows": scale_rows}), load_target("mali"))
    assert adapted == ["scale_rows"] and has_device_launch(mod["scale_rows"])
