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

    from perfx_compiler.gpu_adapt import bind_host_kernels
    from perfx_compiler.kernels.rms_norm import rms_norm_kernel
    from perfx_compiler.kernels.tir_queries import has_device_launch
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

    from perfx_compiler.gpu_adapt import bind_host_kernels
    from perfx_compiler.kernels.tir_queries import has_device_launch
    from perfx_compiler.targets import load_target

    @T.prim_func(private=True)
    def scale_rows(a: T.Buffer((T.int64(4), T.int64(8)), "float32"), b: T.Buffer((T.int64(4), T.int64(8)), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for i in T.parallel(T.int64(4)):
            for j in T.vectorized(T.int64(8)):
                b[i, j] = a[i, j] * T.float32(2)

    mod, adapted = bind_host_kernels(tvm.IRModule({"scale_rows": scale_rows}), load_target("mali"))
    assert adapted == ["scale_rows"] and has_device_launch(mod["scale_rows"])


@pytest.fixture(scope="module")
def wgpu_launcher():
    from perfx_compiler.targets_exec.webgpu import WebGPULauncher, webgpu_available

    why = webgpu_available()
    if why is not None:
        pytest.skip(why)
    return WebGPULauncher()


@pytest.mark.parametrize(
    "bits,kind,rows", [(4, "matmul", (1, 1)), (4, "take", (1, None)), (4, "dequant", (None, None)),
                       (8, "matmul", (1, 1)), (8, "take", (1, None))],
)  # fmt: skip
def test_quantized_kernels_gpu_scheduled_on_lavapipe(bits: int, kind: str, rows: tuple, wgpu_launcher) -> None:
    """GGUF-style int4 (Q4_1: scale + min, groups of 32) and int8 (Q8_0, as uint32 words) kernels as the
    GPU templates schedule them for vulkan (the GEMV: rows over threadIdx.y, K over lanes, cross-lane
    reduction; int32 ids), on lavapipe vs the int64/int8 reference PrimFunc on the host. (PoCL cannot
    run them: the fp16 scales need cl_khr_fp16, which PoCL 3.1 lacks.)"""
    import tvm

    from perfx_compiler.formats.int4 import int4_matmul_compute
    from perfx_compiler.formats.int8 import int8_matmul_compute
    from perfx_compiler.gpu_adapt import bind_host_kernels
    from perfx_compiler.kernels.tir_queries import has_device_launch
    from perfx_compiler.narrow_index import narrow_to_int32
    from perfx_compiler.schedule import apply_schedules
    from perfx_compiler.targets import load_target
    from perfx_compiler.targets_exec.kernels import compile_primfunc, random_inputs
    from perfx_compiler.targets_exec.reference import host_reference

    n, k = 192, 576
    if bits == 4:
        gpu = int4_matmul_compute(n, k, 32, 1, False, kind=kind, rows=rows, offset=True, ids_dtype="int32")
        ref = int4_matmul_compute(n, k, 32, 1, False, kind=kind, rows=rows, offset=True)
    else:
        gpu = int8_matmul_compute(n, k, 32, kind=kind, rows=rows, ids_dtype="int32", words=True)
        ref = int8_matmul_compute(n, k, 32, kind=kind, rows=rows)
    target = load_target("vulkan")
    mod = apply_schedules(tvm.IRModule({"q": gpu}), target, None)
    mod, adapted = bind_host_kernels(mod, target)
    mod = narrow_to_int32(mod)
    assert has_device_launch(mod["q"]) and not adapted, f"q{bits} {kind}: no GPU schedule"
    cf = compile_primfunc("q", mod["q"], target.tvm())
    ins = random_inputs(cf, {"m": 3, "b": 1}, seed=bits * 10 + len(kind))
    rng = np.random.default_rng(bits)
    ref_ins = []
    for i, (pname, _, _) in enumerate(cf.param_info()):
        if pname == "ids":
            ins[i][:] = np.array([[0, n - 1, 77]])[:, : ins[i].shape[1]]
        if pname == "q":  # every nibble / byte value, not random_inputs' small integers
            ins[i][:] = rng.integers(0, 2**32, size=ins[i].shape, dtype=np.uint64).astype(np.uint32)
        a = ins[i]
        if pname == "ids":
            a = a.astype(np.int64)
        elif pname == "q" and bits == 8:
            a = a.view(np.int8)  # the same bytes as the int8 codes of the reference
        ref_ins.append(a.copy() if isinstance(a, np.ndarray) else a)
    got = wgpu_launcher.run_numpy(cf, [a.copy() if isinstance(a, np.ndarray) else a for a in ins])
    want = host_reference(ref, ref_ins)
    scale = max(1.0, float(np.abs(want[-1]).max()))
    assert np.isfinite(want[-1]).all() and np.abs(got[-1].astype(np.float64) - want[-1]).max() <= 1e-5 * scale
