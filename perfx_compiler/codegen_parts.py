"""CPU codegen in parts: each of the model's PrimFuncs goes through LLVM on its own (a few in threads) and
its object code is written to a file at once, so the compile holds a few kernels' ``llvm::Module`` instead of
the whole model's (Gemma 3 270M's build phase: 569 MB with one module, 404 MB one kernel at a time, 439 MB two
at a time in benchmarks/results/compile_memory.csv; the sweeps and time A/Bs are in
docs/decisions/gguf-superblocks.md). The
object files join the VM in ``model.so`` as static libraries (``tvm.runtime.load_static_library``), which
``export_library`` links as it links its own object.

Only CPU targets take this path; a GPU build keeps ``tvm.compile`` (its device modules hang
off the host module, which the VM link must hold).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import perfx_compiler.tvm_compiler  # noqa: F401, I001  (first: TVM without torch)

# isort: split
import tvm
from tvm import relax
from tvm.relax import vm_build

from perfx_compiler import heap

CODEGEN_THREADS = 4  # at most this many kernels' llvm::Modules at once, however many cores


def build_in_parts(
    mod: tvm.IRModule,
    target: tvm.target.Target,
    relax_pipeline: tvm.transform.Pass,
    tir_pipeline: str,
    object_dir: Path,
    progress: bool = False,
) -> Any:
    """What ``tvm.compile(mod, target, relax_pipeline=..., tir_pipeline=...)`` returns (a VM executable
    to export), with each PrimFunc compiled on its own into an object file under ``object_dir``, which
    must outlive the executable's ``export_library``. ``progress``: a bar over the kernels."""
    from tqdm import tqdm

    from perfx_compiler.progress import console

    # tvm.compile's own steps (relax/vm_build.py build and _vmlink); what differs is the TIR codegen.
    with target:
        mod = relax_pipeline(mod)
    module_attrs = mod.attrs
    attrs = dict(module_attrs) if module_attrs else {}
    params = dict(attrs.get("const_name_to_constant", {}))
    builder = relax.ExecBuilder()
    mod = vm_build._vmcodegen(builder, mod, "bytecode")
    kernels = [(gv, f) for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
    del mod  # the Relax side now lives in the builder
    libs = list(attrs.get("external_mods", []))
    object_dir.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(kernels), desc="codegen", unit="kernel", disable=not progress, leave=False, file=console())

    def build(i: int) -> Any:
        gvar, func = kernels[i]
        lib = tvm.tirx.build(tvm.IRModule({gvar: func}, attrs=module_attrs), target=target, pipeline=tir_pipeline)
        bar.update()
        if i == 0:
            # one LLVM module stays: export_library takes the target triple of the object that packs the VM
            # from it (with static libraries only, a cross build's would be the host's)
            return lib
        path = object_dir / f"kernel{i:04d}.o"
        lib.write_to_file(str(path))
        del lib  # frees this kernel's llvm::Module
        # (VM codegen's AttachGlobalSymbol gave every PrimFunc the symbol the VM calls it by)
        return tvm.runtime.load_static_library(str(path), [str(func.attrs["global_symbol"])])

    # Kernels build in threads: TVM releases the GIL in its LLVM codegen, and each build has its own
    # LLVMContext (Gemma 3 270M's build phase ~19 -> ~10 s on 2 cores, peak +18 MB: gguf-superblocks.md).
    with heap.one_arena(), ThreadPoolExecutor(min(CODEGEN_THREADS, len(os.sched_getaffinity(0)))) as pool:
        built = list(pool.map(build, range(len(kernels))))
    bar.close()
    libs += built[1:]
    return relax.VMExecutable(vm_build._ffi_api.VMLink(builder, target, built[0], libs, params))
