"""The compile pipeline: numbered phases with a dump hook after each.

    0 import    ModelDescription -> ONNX (PerfX form) -> Relax: prefill / decode / prefill_all
    1 passes    graph passes (fusions, quantization, precision): GRAPH_PASSES, in order
    2 lower     legalize to TIR, fuse into PrimFuncs
    3 schedule  PerfX templates (schedules/) with tuning records, or TVM dlight defaults
    4 build     tvm.compile for the target (CPU: one LLVM module per kernel, codegen_parts.py)
    5 package   artifact directory (module, packed weights, manifest, tokenizer)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import perfx_compiler.tvm_compiler  # noqa: F401, I001  (first: TVM without torch, one line if runtime-only)

# isort: split
import tvm

from perfx_compiler.errors import PerfXError
from perfx_compiler.heap import trim_heap
from perfx_compiler.model.description import ModelDescription
from perfx_compiler.progress import pop_console, push_console
from perfx_compiler.targets import TargetDescription, index_dtype_of, load_target

relax = tvm.relax  # (after the runtime-only check above)

# Relax functions every artifact exports; the runtime calls them by these names.
FUNCTIONS = {
    "prefill": {"logits": "last", "seq_len": "seq"},
    "decode": {"logits": "last", "seq_len": 1},
    "prefill_all": {"logits": "all", "seq_len": "seq"},
    # batched serving over a paged KV pool (runtime/batch_engine.py)
    "paged_prefill": {"logits": "last", "seq_len": "seq", "kv": "paged", "batch": 1},
    "paged_decode": {"logits": "last", "seq_len": 1, "kv": "paged", "batch": "batch"},
}


# Phase 1, in the order the passes run: modules of perfx_compiler.passes, each run as one tvm.transform
# module pass (passes.graph_pass). ``--passes`` / CompileOptions.passes picks a subset, still in this order.
GRAPH_PASSES: list[str] = [
    "fuse_add_norm",  # residual add + RMSNorm -> one kernel
    "merge_projections",  # Q/K/V and gate/up -> one matmul each
    "fuse_swiglu",
    "precision",  # after the merges and fusions, before the weight formats (which see the rounded inputs)
    "awq",  # after the merges, instead of quantize_int4 (which ignores q4_awq_* names)
    "quantize_int4",  # after the merges (quantize the merged weights); acts for q4_*
    "quantize_kquant",  # acts only for quantization q4_k / q5_k / q6_k (GGUF K-quant blocks)
    "gguf_passthrough",  # acts only for quantization "gguf"
    "onnx_int4_passthrough",  # acts only for quantization "onnx"
    "quantize_int8",
    "cast_weights",  # acts only for quantization f16 / bf16
    "fuse_gemv_prologue",  # after the weight formats (which emit the VNNI GEMVs)
    "fuse_gemm_swiglu",  # after fuse_gemv_prologue (decode's GEMVs take swiglu there first)
    "texture_weights",  # after quantization; before weight_layout, whose FuseTransposeMatmul hides float linears
    "weight_layout",  # after fusions and quantization, right before lowering
]

def exported_functions(options: CompileOptions) -> list[str]:
    return [f for f in FUNCTIONS if options.batching or not f.startswith("paged_")]


def num_inputs(func: relax.Function) -> int:
    return int(func.attrs["num_input"])


@dataclass
class CompileOptions:
    target: str = "host"
    output_dir: Path | None = None
    dump_ir: Path | None = None
    tuning_log: Path | str | None = None  # records to build from; "none": template defaults only
    quantization: str = "auto"  # "auto": gguf (passthrough) for GGUF input with Q4_0/Q4_1/Q5_0/Q8_0, else f32
    max_context: int | None = None
    progress: bool = True
    schedule: str = "perfx"  # "perfx": templates from schedules/; "dlight": TVM's default rules
    passes: list[str] | None = None  # None: every pass of GRAPH_PASSES
    verbose: bool = False  # show TVM's native log lines (hidden by default: they are not user errors)
    batching: bool = True  # also export the paged, batched functions used for serving
    activations: str = "auto"  # quantized linears' inputs: auto | f32 | int8 (resolve_activations)
    precision: str = "f32"  # matmul inputs: f32 | bf16 | f16 | fp8 (passes/precision.py; checked per target)
    kv_cache: str = "f32"  # KV cache (and paged pool) storage: f32 | f16 | int8 (CPU targets; kernels/_kv_cache.py)
    best_effort: bool = False  # build kernels no template could schedule unscheduled (warning) instead of failing
    # --knob TEMPLATE.KEY=VALUE (knobs.py): ["t.key=value", ...] or {"t.key": value}; normalized to the dict
    knobs: dict[str, Any] | list[str] = field(default_factory=dict)
    cubin: bool = True  # CUDA targets: also export the nvcc-built cubin (--no-cubin: kernels.cu only)


@dataclass
class CompileState:
    """What flows between phases."""

    desc: ModelDescription
    target: TargetDescription
    options: CompileOptions
    mod: tvm.IRModule | None = None
    executable: Any = None
    weights: dict[str, Any] = field(default_factory=dict)  # name -> numpy array, in parameter order
    timings: dict[str, float] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)
    object_dir: Path | None = None  # CPU build: the kernels' object files until the package phase links them


def phase_import(state: CompileState) -> None:
    from perfx_compiler.frontend.onnx_import import import_onnx
    from perfx_compiler.frontend.perfx_ops import PERFX_CONVERTERS, add_kernels, set_target_family
    from perfx_compiler.model.onnx_emit import (
        emit_onnx,
        weight_arrays,
        weight_input_names,
    )

    set_target_family(state.target.family)  # kernels with a GPU variant (attention) pick it from this
    index_dtype = index_dtype_of(state.target)
    layers = state.desc.config.num_layers
    merged = tvm.IRModule()
    for name in exported_functions(state.options):
        spec = FUNCTIONS[name]
        # inputs before the weights: ids, past_len | (positions, page_table), then the KV tensors
        n_in = (3 if spec.get("kv") == "paged" else 2) + 2 * layers
        graph = emit_onnx(state.desc, weights="inputs", index_dtype=index_dtype, kv_cache=state.options.kv_cache,
                          metadata=False, **spec)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the importer warns about every sanitized name
            mod = import_onnx(graph, keep_params_in_input=True, extra_converters=PERFX_CONVERTERS)
        merged[name] = mod["main"].with_attrs({"global_symbol": name, "num_input": n_in})
    state.mod = add_kernels(merged)
    # Weights are the parameters after the inputs, in emission order; key them by Relax name.
    arrays = weight_arrays(state.desc)
    params = state.mod["decode"].params[num_inputs(state.mod["decode"]) :]
    names = weight_input_names(state.desc)
    assert len(params) == len(names), (len(params), len(names))
    state.weights = {p.name: arrays[n] for p, n in zip(params, names, strict=True)}


def resolve_quantization(
    quantization: str | None, desc: ModelDescription, target: TargetDescription | None = None
) -> str:
    """``auto`` (or None) -> ``gguf`` when the model carries GGUF Q4_0/Q4_1/Q5_0/Q8_0 blocks, ``onnx`` when it
    carries ONNX MatMulNBits int4 blocks, else ``f32``.

    Every target, WebGPU's int32-index one included: the quantized kernels take the graph's ids dtype.
    """
    if quantization in (None, "", "auto"):
        quantized = getattr(desc, "quantized", None) or {}
        if not quantized:
            return "f32"
        # ONNX MatMulNBits int4 tables: their own passthrough (passes/onnx_int4_passthrough.py)
        return "onnx" if all(v[0] == "MatMulNBits" for v in quantized.values()) else "gguf"
    return str(quantization)


def check_kv_cache(kv_cache: str, target: TargetDescription) -> None:
    """Refuse an unknown ``--kv-cache``, and f16/int8 on GPU targets (their attention kernels read f32 caches)."""
    if kv_cache not in ("f32", "f16", "int8"):
        raise PerfXError(f"unknown kv cache '{kv_cache}'; use f32, f16 or int8")
    if kv_cache != "f32" and target.family != "cpu":
        raise PerfXError(f"--kv-cache {kv_cache} is for CPU targets; {target.name}'s attention reads f32 caches")


def resolve_activations(activations: str | None, quantization: str, target: TargetDescription) -> str:
    """``auto`` -> ``int8`` where the target has AVX-512 VNNI and the weights are quantized (the
    VNNI kernels quantize x per group, as llama.cpp does), else ``f32``. ``int8`` elsewhere is an error."""
    from perfx_compiler.formats.vnni import has_avx512_vnni

    if activations in (None, "", "auto"):
        return "int8" if quantization != "f32" and has_avx512_vnni(target) else "f32"
    if activations not in ("f32", "int8"):
        raise PerfXError(f"unknown activations '{activations}'; use auto, f32 or int8")
    if activations == "int8" and not has_avx512_vnni(target):
        raise PerfXError(f"activations int8 needs an x86 target with AVX-512 VNNI; {target.name} has none (use f32)")
    return activations


def phase_passes(state: CompileState) -> None:
    from perfx_compiler.passes.precision import resolve_precision

    opts = state.options
    opts.precision, opts.quantization = resolve_precision(opts.precision, opts.quantization, state.target)
    state.options.quantization = resolve_quantization(state.options.quantization, state.desc, state.target)

    from perfx_compiler.passes._quantized_linears import use_activations, use_batch_gemv
    from perfx_compiler.schedule_template import is_cpu_target

    opts = state.options
    opts.activations = resolve_activations(opts.activations, opts.quantization, state.target)
    weight_file = _weight_file(state) if opts.output_dir is not None else None  # a compile, not lower_model
    try:
        with use_activations(opts.activations), use_batch_gemv(is_cpu_target(state.target)):
            state.mod, state.weights = run_graph_passes(state.mod, state.weights, state.target, opts, state.desc,
                                                         weight_file=weight_file)
        check_signatures(state)
        if weight_file is not None:  # the weights are final: all of them to disk before codegen, not under its peak
            state.weights = weight_file.finish(state.weights)
    except BaseException:
        if weight_file is not None:
            weight_file.discard()
        raise


def _weight_file(state: CompileState) -> Any:
    """The artifact's weights file, written beside it while the passes pack the weights (package.WeightFile);
    packaging moves it in as ``weights.bin``, and ``compile_model`` removes it if a later phase fails."""
    from perfx_compiler.package import WeightFile

    out = state.options.output_dir
    out.parent.mkdir(parents=True, exist_ok=True)
    return WeightFile(out.parent / f".{out.name}.weights-{os.getpid()}.bin")


def selected_passes(passes: list[str] | None) -> list[str]:
    """``passes`` (None: all of GRAPH_PASSES) in GRAPH_PASSES order; an unknown name is an error."""
    if passes is None:
        return list(GRAPH_PASSES)
    unknown = [n for n in passes if n not in GRAPH_PASSES]
    if unknown:
        raise PerfXError(f"unknown pass(es) {', '.join(unknown)}; available: {', '.join(GRAPH_PASSES)}")
    return [n for n in GRAPH_PASSES if n in passes]


def run_graph_passes(
    mod: tvm.IRModule, weights: dict[str, Any], target: TargetDescription, options: CompileOptions,
    desc: ModelDescription | None = None, weight_file: Any = None,
) -> tuple[tvm.IRModule, dict[str, Any]]:
    """Phase 1 on ``mod``: the selected GRAPH_PASSES as one ``tvm.transform.Sequential``; returns
    the rewritten module and weight table (``weight_file``: see ``PassContext.weight_file``)."""
    from perfx_compiler.passes import GraphState, PassContext, graph_pass

    state = GraphState(weights=weights, ctx=PassContext(target=target, options=options, desc=desc,
                                                        weight_file=weight_file))
    names = selected_passes(getattr(options, "passes", None))
    mod = tvm.transform.Sequential([graph_pass(n, state) for n in names], name="perfx_graph_passes")(mod)
    state.raise_error()
    return mod, state.weights


def phase_lower(state: CompileState) -> None:
    seq = tvm.transform.Sequential(
        [
            relax.transform.LegalizeOps(),
            relax.transform.AnnotateTIROpPattern(),
            relax.transform.FoldConstant(),
            relax.transform.FuseOps(),
            relax.transform.FuseTIR(),
            relax.transform.DeadCodeElimination(exported_functions(state.options)),
        ]
    )
    with state.target.tvm():
        state.mod = seq(state.mod)


def phase_schedule(state: CompileState) -> None:
    from perfx_compiler.schedule import KernelSchedule, schedule_module

    if state.options.schedule == "perfx":
        from perfx_compiler.tune.records import default_records

        records = default_records(state.target.name, state.options.tuning_log)
        state.notes["tuning_records"] = 0 if records is None else len(records)
        state.mod, outcomes = schedule_module(state.mod, state.target, records, state.options.best_effort)
    else:
        from tvm.s_tir import dlight as dl

        tgt = state.target.tvm()
        rules = (
            [dl.cpu.GEMV(), dl.cpu.Reduction()]
            if state.target.family == "cpu"
            else [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]
        )
        before = {gv.name_hint for gv, f in state.mod.functions.items() if _scheduled_prim(f)}
        with tgt:
            state.mod = dl.ApplyDefaultSchedule(*rules)(state.mod)
        # dlight is TVM's baseline (--schedule dlight): what it leaves is reported, never an error
        outcomes = [
            KernelSchedule(gv.name_hint, "hand-written", "pre-scheduled") if gv.name_hint in before
            else KernelSchedule(gv.name_hint, "dlight" if _scheduled_prim(f) else None,
                                "dlight" if _scheduled_prim(f) else "unmatched")
            for gv, f in state.mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)
        ]
    _bind_gpu_host_kernels(state)
    adapted = set(state.notes.get("gpu_host_kernels_adapted") or [])
    for o in outcomes:
        if o.kernel in adapted:  # moved to the device by gpu_adapt's generic net (see its docstring)
            o.source = f"{o.source}, gpu_adapt" if o.template else "gpu_adapt"
    state.notes["schedules"] = [o.to_json() for o in sorted(outcomes, key=lambda o: o.kernel)]


def _scheduled_prim(func: Any) -> bool:
    from perfx_compiler.schedule import SCHEDULED_ATTR

    return isinstance(func, tvm.tirx.PrimFunc) and func.attrs is not None and bool(func.attrs.get(SCHEDULED_ATTR, False))


def _bind_gpu_host_kernels(state: CompileState) -> None:
    """GPU targets: a PrimFunc without a device launch would run on the host (see gpu_adapt)."""
    from perfx_compiler.device_export import prepare_build_env
    from perfx_compiler.gpu_adapt import bind_host_kernels

    state.mod, state.notes["gpu_host_kernels_adapted"] = bind_host_kernels(state.mod, state.target)
    if index_dtype_of(state.target) == "int32":
        from perfx_compiler.narrow_index import narrow_to_int32

        # PrimFuncs only (WGSL has no 64-bit integers); the host's Relax functions keep int64 shapes
        state.mod = narrow_to_int32(state.mod)
    prepare_build_env(state.target)  # toolchain paths the build phase needs (ROCm)


def vm_lowering_passes(reuse_views: bool) -> list[tvm.transform.Pass]:
    """The Relax passes phase_build runs after scheduling (public so tests build what ships)."""
    from perfx_compiler.passes.reuse_storage_views import ReuseStorageViews

    return [
        relax.transform.RewriteDataflowReshape(),
        relax.transform.ToNonDataflow(),
        relax.transform.RemovePurityChecking(),
        relax.transform.CallTIRRewrite(),
        relax.transform.StaticPlanBlockMemory(),
        *([ReuseStorageViews()] if reuse_views else []),
        relax.transform.LowerAllocTensor(),
        relax.transform.KillAfterLastUse(),
        relax.transform.LowerRuntimeBuiltin(),
        relax.transform.ComputePrimValue(),
        relax.transform.VMShapeLower(),
        relax.transform.AttachGlobalSymbol(),
    ]


def phase_build(state: CompileState) -> None:
    tgt = state.target.tvm()
    # CPU: one tensor view per planned buffer instead of an alloc_tensor + kill per use (decode step:
    # ~300 VM builtin calls fewer; docs/decisions/quantized-linears.md); other targets keep TVM's
    # lowering as it was tested there.
    cpu = state.target.family == "cpu"
    # Phases 1-3 did legalization, fusion and scheduling; only VM lowering remains.
    finish = tvm.transform.Sequential(vm_lowering_passes(reuse_views=cpu))
    if not cpu:
        state.executable = tvm.compile(state.mod, target=tgt, relax_pipeline=finish, tir_pipeline=_tir_pipeline(state))
        return
    from perfx_compiler.codegen_parts import build_in_parts

    # the kernels' object files, linked into model.so by the package phase (compile_model removes them)
    state.object_dir = Path(tempfile.mkdtemp(prefix="perfx-objects-"))
    state.executable = build_in_parts(state.mod, tgt, finish, _tir_pipeline(state), state.object_dir,
                                      progress=state.options.progress)


def _tir_pipeline(state: CompileState) -> str:
    """``perfx_adreno`` (TextureFlatten) when a kernel reads an image (passes/texture_weights.py);
    ``perfx_cpu`` (stack_alloca.py) on CPU targets."""
    from perfx_compiler.kernels.tir_queries import has_texture_params

    if any(isinstance(f, tvm.tirx.PrimFunc) and has_texture_params(f) for f in state.mod.functions.values()):
        from perfx_compiler.kernels.gemv_texture import register_pipeline

        return register_pipeline()
    from perfx_compiler.stack_alloca import tir_pipeline_for

    return tir_pipeline_for(state.target.family)  # CPU: small kernel scratch on the stack, not the pool


def check_signatures(state: CompileState) -> None:
    """Every exported function takes (inputs..., weights in ``state.weights`` order): the runtime relies on it."""
    names = list(state.weights)
    for fn in exported_functions(state.options):
        got = [p.name for p in state.mod[fn].params[num_inputs(state.mod[fn]) :]]
        if got != names:
            raise PerfXError(f"internal: function {fn} takes weights {got[:3]}... but the weight table has {names[:3]}...")


def phase_package(state: CompileState) -> None:
    from perfx_compiler.package import write_artifact

    write_artifact(state, exported_functions(state.options))


PHASES: list[tuple[str, Callable[[CompileState], None]]] = [
    ("import", phase_import),
    ("passes", phase_passes),
    ("lower", phase_lower),
    ("schedule", phase_schedule),
    ("build", phase_build),
    ("package", phase_package),
]


@contextlib.contextmanager
def _native_log(state: CompileState) -> Iterator[None]:
    """Collect what TVM's C++ side prints on fd 2 during a phase (kept in the dump dir, if any)."""
    if state.options.verbose:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        push_console(os.fdopen(os.dup(saved), "w"))  # progress bars still reach the terminal
        try:
            yield
        finally:
            pop_console().close()
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            state.notes.setdefault("native_log", []).append(tmp.read().decode(errors="replace"))


def _dump(state: CompileState, index: int, name: str) -> None:
    if state.options.dump_ir is None or state.mod is None:
        return
    out = Path(state.options.dump_ir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{index:02d}_{name}.py").write_text(state.mod.script(show_meta=False))
    logs = state.notes.get("native_log") or [""]
    if logs[-1].strip():
        (out / f"{index:02d}_{name}.tvm.log").write_text(logs[-1])


def lower_model(
    model: str | ModelDescription, target: str = "host", **options: Any
) -> tuple[tvm.IRModule, CompileState]:
    """Run phases 0-2 (import, passes, lower): the unscheduled TIR module the tuner extracts
    workloads from, and the state (target, options, weights) that produced it."""
    opts = CompileOptions(target=target, progress=False, **options)
    tdesc = _with_knobs(load_target(target), opts)
    if isinstance(model, ModelDescription):
        desc = model
    else:
        from perfx_compiler.model.loader import load_model

        desc = load_model(model, max_context=opts.max_context)
    desc.validate()
    state = CompileState(desc=desc, target=tdesc, options=opts)
    for name, fn in PHASES[:3]:
        start = time.perf_counter()
        fn(state)
        state.timings[name] = time.perf_counter() - start
    return state.mod, state


def _with_knobs(target: TargetDescription, opts: CompileOptions) -> TargetDescription:
    """Check ``opts.knobs`` (an unknown name is an error before any work) and hand them to the
    schedule templates on the target they all receive."""
    from perfx_compiler.knobs import by_template, parse_knobs

    opts.knobs = parse_knobs(opts.knobs)
    return dataclasses.replace(target, knobs=by_template(opts.knobs)) if opts.knobs else target


def default_output_dir(model: str, target: str) -> Path:
    stem = Path(model).stem if model.endswith((".gguf", ".onnx")) else Path(model).name
    return Path(f"{stem}-{target}")


def compile_model(
    model: str | ModelDescription,
    target: str = "host",
    output_dir: str | Path | None = None,
    **options: Any,
) -> Path:
    """Compile ``model`` (name, GGUF, HF folder, or a ModelDescription) for ``target``; return the artifact dir."""
    opts = CompileOptions(target=target, **options)
    tdesc = _with_knobs(load_target(target), opts)
    from perfx_compiler.passes.precision import resolve_precision

    # before loading the model: a bad --precision for the target is refused without reading the weights
    opts.precision, opts.quantization = resolve_precision(opts.precision, opts.quantization, tdesc)
    check_kv_cache(opts.kv_cache, tdesc)
    if opts.quantization not in (None, "", "auto"):
        from perfx_compiler.passes.quantize_int4 import parse as parse_quantization

        parse_quantization(opts.quantization)  # an unknown name: one line before the weights are read
    if isinstance(model, ModelDescription):
        desc = model
        spec = desc.source or desc.config.name or "model"
    else:
        from perfx_compiler.model.loader import load_model

        spec = model
        desc = load_model(model, max_context=opts.max_context)
    desc.validate()
    opts.quantization = resolve_quantization(opts.quantization, desc, tdesc)  # the manifest records this name
    opts.activations = resolve_activations(opts.activations, opts.quantization, tdesc)
    opts.output_dir = Path(output_dir) if output_dir is not None else default_output_dir(str(spec), target)
    state = CompileState(desc=desc, target=tdesc, options=opts)
    state.notes["model_spec"] = str(spec)
    bar = None
    if opts.progress:
        from tqdm import tqdm

        bar = tqdm(total=len(PHASES), desc="compile", unit="phase", leave=True)
    try:
        for i, (name, fn) in enumerate(PHASES):
            if bar is not None:
                bar.set_description(f"compile [{i}] {name}")
            start = time.perf_counter()
            try:
                with _native_log(state):
                    fn(state)
            except PerfXError:
                raise
            except Exception as err:  # a TVM failure is our bug, but say where it happened
                raise PerfXError(
                    f"compile phase {i} ({name}) failed for target {tdesc.name}: "
                    f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''} "
                    "(rerun with --debug for the traceback)"
                ) from err
            state.timings[name] = time.perf_counter() - start
            trim_heap()  # what the phase freed leaves the process, not the next phase's peak
            _dump(state, i, name)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        path = getattr(state.weights, "path", None)
        if path is not None and path.exists():  # (packaging moved it in, unless a phase failed)
            path.unlink()
        if state.object_dir is not None:
            shutil.rmtree(state.object_dir, ignore_errors=True)
    return opts.output_dir
