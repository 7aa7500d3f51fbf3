"""Constants shared by the target checks."""

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
