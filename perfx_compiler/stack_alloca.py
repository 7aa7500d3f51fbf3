"""Small fixed-size TIR scratch buffers on the stack instead of TVM's workspace pool (CPU targets).

TVM 0.27's ``LowerTVMBuiltin`` turns every ``AllocBuffer`` of a host function into a
``TVMBackendAllocWorkspace`` / ``TVMBackendFreeWorkspace`` pair, even a 64-byte accumulator. The
decode GEMV allocates five scratch buffers per call and three more per parallel task (16 tasks), so
a SmolLM2 decode step made thousands of pool calls (about 1.5% of its time under ``perf``). An
allocation annotated ``disable_lower_builtin`` is left to LLVM as an ``alloca`` in the function's
entry block; this pass annotates those with a static size up to ``MAX_STACK_BYTES``.

Used through the TIR pipeline ``"perfx_cpu"`` (the default ``s_tir`` pipeline plus this pass,
before the host finalization that runs ``LowerTVMBuiltin``), selected in the build phase for CPU
targets.
"""

from __future__ import annotations

from typing import Any

from perfx_compiler.kernels import POOL_SCRATCH_ATTR

# Per buffer. Worker threads of TVM's pool have the default 8 MiB stack; the largest kernel frame
# this allows stays far below it (a few buffers per kernel, none nested in a recursion).
MAX_STACK_BYTES = 8192
ANNOTATION = "disable_lower_builtin"
PIPELINE_NAME = "perfx_cpu"


def _static_bytes(buf: Any) -> int | None:
    import tvm

    n = 1
    for d in buf.shape:
        if not hasattr(d, "value"):
            return None  # symbolic extent: leave it to the pool
        n *= int(d.value)
    t = tvm.runtime.DataType(str(buf.dtype))
    return n * t.bits * t.lanes // 8


def _stack_scope(buf: Any) -> bool:
    scope = buf.scope() if callable(getattr(buf, "scope", None)) else "global"
    return scope in ("global", "local", "")


def stack_small_allocs_pass() -> Any:
    """A PrimFunc pass annotating small static ``AllocBuffer`` nodes to stay stack allocations."""
    import tvm
    from tvm import tirx

    from perfx_compiler.narrow_index import _map  # structural_map with no exception crossing C++

    pooled: set[str] = set()  # the function being rewritten's POOL_SCRATCH_ATTR

    def rewrite(stmt: Any) -> Any:
        ann = dict(stmt.annotations) if stmt.annotations is not None else {}
        if ANNOTATION in ann or not _stack_scope(stmt.buffer) or str(stmt.buffer.name) in pooled:
            return stmt
        size = _static_bytes(stmt.buffer)
        if size is None or size <= 0 or size > MAX_STACK_BYTES:
            return stmt
        ann[ANNOTATION] = tirx.IntImm("bool", 1)  # the C++ side reads a Bool (IntImm), not an ffi bool
        span = stmt.span if isinstance(stmt.span, tvm.ir.Span) else None  # parsed functions carry other spans
        return tirx.AllocBuffer(stmt.buffer, ann, span)

    def transform(func: Any, _mod: Any, _ctx: Any) -> Any:
        target = func.attrs.get("target") if func.attrs is not None else None
        if target is not None and target.get_target_device_type() != 1:  # host (kDLCPU) code only
            return func
        names = func.attrs.get(POOL_SCRATCH_ATTR, None) if func.attrs is not None else None
        pooled.clear()
        pooled.update(str(n) for n in (names or []))
        return func.with_body(_map(func.body, [(tirx.AllocBuffer, rewrite)]))

    return tvm.tirx.transform.prim_func_pass(transform, opt_level=0, name="perfx.StackSmallAllocs")


def register_pipeline() -> str:
    """Register (once) and return the name of the TIR pipeline ``default + StackSmallAllocs``."""
    import tvm
    from tvm.tirx import compilation_pipeline as cp

    if PIPELINE_NAME not in cp.PIPELINE_MAP:
        base = cp.PIPELINE_MAP["s_tir"]

        def make(**kwargs: Any) -> Any:
            pipeline, fin_host, fin_device = base(**kwargs)
            extra = stack_small_allocs_pass()

            @tvm.transform.module_pass(opt_level=0, name="perfx.cpu_tir_pipeline")
            def run(mod: Any, ctx: Any) -> Any:
                return extra(pipeline(mod))

            return run, fin_host, fin_device

        cp.PIPELINE_MAP[PIPELINE_NAME] = make
    return PIPELINE_NAME


def tir_pipeline_for(family: str) -> str:
    """The TIR pipeline a kernel of this target family is built with: ``perfx_cpu`` on CPU targets,
    TVM's default elsewhere. The tuner and the kernel benchmarks build with it too, so they time
    the code the artifact runs: without it a GEMV's accumulators live in the workspace pool and are
    stored to memory on every step, and configs were ranked on code the artifact never runs."""
    return register_pipeline() if family == "cpu" else "default"


def compile_kernel(func: Any, target: Any) -> Any:
    """``tvm.compile`` of one PrimFunc (as ``main``) for a :class:`TargetDescription`, with the TIR
    pipeline the artifact build uses for its family."""
    import tvm

    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    return tvm.compile(mod, target.tvm(), tir_pipeline=tir_pipeline_for(target.family))
