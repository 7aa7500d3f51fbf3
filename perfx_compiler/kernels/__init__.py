"""Hand-written TIR kernels. Importing the package installs the TVMScript parse speedup
(perfx_compiler/tvmscript_speedups.py) that every kernel built here goes through."""

from perfx_compiler.tvmscript_speedups import install as _install_tvmscript_speedups

_install_tvmscript_speedups()

# A PrimFunc attribute a kernel sets for the CPU lowering (stack_alloca.py): names of scratch buffers that
# stay in TVM's workspace pool. As allocas, LLVM's SROA splits the attention rows/split bodies' accumulators
# (read as 16-lane vectors, written as 192-lane ones) into scalars rebuilt with vinsertps: SmolLM2's decode
# attention ran 5x slower (docs/decisions/attention-cpu.md).
POOL_SCRATCH_ATTR = "perfx.pool_scratch"
