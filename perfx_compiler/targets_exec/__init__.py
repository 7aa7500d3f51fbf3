"""Executing non-host targets' code on this machine: kernel extraction and thin launchers.

``kernels``: device source + launch plan of one scheduled PrimFunc; ``opencl``: pyopencl launcher
(PoCL); ``webgpu``: wgpu launcher for WGSL (lavapipe); ``relax_exec``: runs a compiled model's Relax
function kernel by kernel through a launcher; ``reference``: the same PrimFuncs on the x86 host for
checks; ``qemu``: aarch64 whole-model runs with the aarch64 TVM runtime; ``riscv``: riscv64 kernels
under qemu through a runtime-free C harness; ``toolchains``: nvcc cubins, ROCm code objects.
"""
