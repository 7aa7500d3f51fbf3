"""Executing non-host targets' code on this machine: kernel extraction and thin launchers.

``kernels``: device source + launch plan of one scheduled PrimFunc; ``opencl``: pyopencl launcher
(PoCL); ``webgpu``: wgpu launcher (lavapipe); ``relax_exec``: runs a compiled model's Relax function
kernel by kernel through a launcher; ``reference``: the same PrimFuncs on the x86 host for checks;
``toolchains``: nvcc cubins, ROCm code objects, qemu harnesses.
"""
