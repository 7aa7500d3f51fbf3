"""``perfx-compile``: MODEL -> artifact directory for a target.

    perfx-compile smollm2-135m --target host -o out
    perfx-compile model.gguf --target x86-avx512 -o out --dump-ir ir/
    perfx-compile --list-targets

User errors print one line ``perfx-compile: error: ...`` and exit 2; ``--debug``
shows the traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from perfx_compiler.cli._errors import run_command
from perfx_compiler.errors import PerfXError

PROG = "perfx-compile"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Compile an LLM for a target with PerfX.")
    p.add_argument("model", nargs="?", help="a known model (smollm2-135m, gemma3-270m), a .gguf file, a Hugging Face folder or an .onnx file")
    p.add_argument("--target", default="host", help="a target from targets/ (see --list-targets); default host")
    p.add_argument("-o", "--output", default=None, help="artifact directory (default MODEL-TARGET)")
    p.add_argument("--dump-ir", default=None, metavar="DIR", help="write the module after each phase to DIR")
    p.add_argument("--tuning-log", default=None, metavar="DIR",
                   help="tuning records to build from (no new trials); 'none': template defaults only "
                        "(default: the repository's tuning_logs/<target>/)")
    p.add_argument("--knob", action="append", default=[], metavar="TEMPLATE.KEY=VALUE",
                   help="override one schedule template setting for an experiment (repeatable), e.g. "
                        "gemv_qvnni_cpu.prefetch=0; recorded in perfx-config.json")
    p.add_argument("--max-context", type=int, default=None, help="KV cache length (default: min(model's, 2048))")
    p.add_argument("--schedule", choices=["perfx", "dlight"], default="perfx", help="schedule templates to use")
    p.add_argument(
        "--quantization", default="auto",
        help="weight format: auto (gguf for a GGUF model with Q4_0/Q4_1/Q5_0/Q8_0 weights, onnx for an ONNX model "
             "with int4 MatMulNBits weights, else f32), f32, f16, bf16, gguf, onnx, "
             "q8, q8_g64, q8_g128, q4_g128/g64/g32, q4_sym_g*, q4_awq_g128/g64/g32, "
             "q4_k, q5_k, q6_k (GGUF Q4_K / Q5_K / Q6_K blocks made by llama.cpp's quantizer, ported), "
             "q4_k_m, q5_k_m (llama.cpp's mixes: Q6_K for the head and some layers' attn_v / ffn_down)",
    )
    p.add_argument(
        "--precision", default="f32", choices=["f32", "bf16", "f16", "fp8"],
        help="matmul inputs (and weights): bf16 on x86-avx512 (avx512bf16), f16 on GPU targets; norms, softmax, "
             "RoPE and accumulations stay f32 (default f32)",
    )
    p.add_argument(
        "--kv-cache", default="f32", choices=["f32", "f16", "int8"],
        help="KV cache storage (CPU targets): f16, or int8 rows with one float32 scale each (~3.8x smaller than "
             "f32 at head_dim 64), for the single-sequence cache and perfx-serve's paged pool alike; attention "
             "computes in f32 (default f32)",
    )
    p.add_argument(
        "--activations", default="auto", choices=["auto", "f32", "int8"],
        help="inputs of quantized linears: int8 (quantized per group, integer dot products; x86 AVX-512 VNNI), "
             "f32, or auto (int8 where the target has VNNI and the weights are quantized)",
    )
    p.add_argument("--batching", action=argparse.BooleanOptionalAction, default=None,
                   help="also export the paged, batched functions perfx-serve uses")
    p.add_argument("--best-effort", action="store_true",
                   help="build kernels that no schedule template could schedule unscheduled (a warning) "
                        "instead of failing")
    p.add_argument("--no-cubin", dest="cubin", action="store_false",
                   help="CUDA targets: export kernels.cu without the nvcc-built cubin")
    p.add_argument("--emit-onnx", default=None, metavar="FILE", help="also write the model as a runnable ONNX graph")
    p.add_argument("--report", action="store_true",
                   help="print every kernel with the template that scheduled it, kernel launches per decode step "
                        "before/after each fusion pass and the decode time")
    p.add_argument("--list-targets", action="store_true", help="list the known targets and exit")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def _list_targets() -> int:
    from perfx_compiler.targets import list_targets, load_target

    print(f"{'target':<14} {'family':<6} description")
    for name in ["host", *list_targets()]:
        t = load_target(name)
        label = f"{t.description} (detected: {t.name})" if name == "host" else t.description
        print(f"{name:<14} {t.family:<6} {label}")
    return 0


def _prebuild_runtime(target: str) -> None:
    """An artifact that runs on this machine gets the runtime's C++ decode loop built now (once per
    machine, cached), so the first ``perfx-run`` neither waits for a compiler nor times one."""
    from perfx_compiler.targets import load_target

    t = load_target(target)
    if t.family == "cpu" and t.runnable_here:
        from perfx_compiler.runtime import decode_replay

        if decode_replay.enabled():
            decode_replay.prebuild()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(PROG, lambda: _run(args), debug=args.debug)


def _run(args: argparse.Namespace) -> int:
    if args.list_targets:
        return _list_targets()
    if not args.model:
        raise PerfXError("no MODEL given; pass smollm2-135m, gemma3-270m, a .gguf file, a Hugging Face folder or an .onnx file")
    from perfx_compiler.pipeline import compile_model

    if args.emit_onnx:
        from perfx_compiler.model.loader import load_model
        from perfx_compiler.model.onnx_emit import save_onnx

        print(f"wrote {save_onnx(load_model(args.model, args.max_context), args.emit_onnx)}")
    start = time.perf_counter()
    out = compile_model(
        args.model,
        args.target,
        args.output,
        dump_ir=args.dump_ir,
        tuning_log=args.tuning_log,
        max_context=args.max_context,
        schedule=args.schedule,
        quantization=args.quantization,
        activations=args.activations,
        precision=args.precision,
        kv_cache=args.kv_cache,
        best_effort=args.best_effort,
        knobs=args.knob,
        cubin=args.cubin,
        progress=not args.quiet,
        verbose=args.debug,
        **({} if args.batching is None else {"batching": args.batching}),
    )
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s")
    _prebuild_runtime(args.target)
    if args.report:
        from perfx_compiler.compile_report import compile_report

        print(compile_report(args.model, args.target, out, max_context=args.max_context, schedule=args.schedule,
                             quantization=args.quantization, activations=args.activations, precision=args.precision))
    return 0


if __name__ == "__main__":
    sys.exit(main())
