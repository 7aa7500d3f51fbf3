"""The vulkan build of a real model, decoded through the WGSL launcher on lavapipe vs the x86 build and a float64 reference.

    XDG_RUNTIME_DIR=/tmp python benchmarks/vulkan_lavapipe_check.py [--model smollm2-135m] [--tokens 1 504 3458]
        [--quantization auto|f32|gguf|q8] [--host-build DIR] [--csv benchmarks/results/vulkan_lavapipe.csv]

Phases 0-3 of the pipeline for the vulkan target (int32 indices, WGSL kernels), then each token through
``decode`` kernel by kernel on the first wgpu adapter (Mesa's lavapipe on a CPU-only machine). The default
``auto`` quantization keeps a GGUF file's Q4_1/Q8_0 blocks (SmolLM2: int4 linears, int8 embedding and tied
lm_head read as uint32 words). The same tokens go through an x86 build of the same model and quantization
(``--host-build`` reuses one) and :class:`perfx_compiler.model.reference.ReferenceModel` (float64 on the
file's dequantized weights). Exits 1 when the logits differ from x86's by more than 1e-3 x scale or the
greedy tokens differ; appends one row to ``--csv``.

Other weights: ``--model /tmp/perfx-bench/models/SmolLM2-135M-Instruct.Q4_0.gguf`` (a GGUF path: its Q4_0
blocks, symmetric int4 with one scale per 32), ``--quantization q4_g128`` (asymmetric int4, a scale and
zero point per 128, quantized from the shipped file's dequantized weights), ``q8``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    from perfx_compiler import pipeline as P
    from perfx_compiler.model.loader import load_model
    from perfx_compiler.model.reference import ReferenceModel
    from perfx_compiler.targets import load_target
    from perfx_compiler.targets_exec.relax_exec import run_decode_steps
    from perfx_compiler.targets_exec.webgpu import WebGPULauncher, webgpu_available

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 504, 3458])
    ap.add_argument("--max-context", type=int, default=256)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--host-build", type=Path, default=None, help="an x86 artifact of the same model (else built)")
    ap.add_argument("--csv", type=Path, default=None)
    args = ap.parse_args(argv)
    why = webgpu_available()
    if why:
        print(f"skip: {why}")
        return 2
    start = time.perf_counter()
    desc = load_model(args.model, max_context=args.max_context)
    quant = P.resolve_quantization(args.quantization, desc, load_target("vulkan"))
    options = P.CompileOptions(target="vulkan", progress=False, quantization=quant, batching=False)
    state = P.CompileState(desc=desc, target=load_target("vulkan"), options=options)
    phases = dict(P.PHASES)
    for name in ("import", "passes", "lower", "schedule"):
        phases[name](state)
    print(f"vulkan module for {args.model} ({quant}): {time.perf_counter() - start:.1f} s")
    launcher = WebGPULauncher()
    start = time.perf_counter()
    got = np.stack(run_decode_steps(state, launcher, args.tokens, state.weights))
    print(f"{len(args.tokens)} decode steps on {launcher.adapter.info['device']}: "
          f"{time.perf_counter() - start:.1f} s, {launcher.launches} WGSL launches")  # fmt: skip
    host = x86_logits(args, quant)
    ref = ReferenceModel(desc)
    want = np.stack([ref.forward([t]).reshape(-1) for t in args.tokens])
    err_x86 = float(np.abs(got - host).max())
    err_ref = float(np.abs(got - want).max())
    scale = float(np.abs(host).max())
    same = bool((got.argmax(-1) == host.argmax(-1)).all())
    print(f"max |logit - x86 build| = {err_x86:.3g}, max |logit - float64 reference| = {err_ref:.3g} "
          f"(logit scale {scale:.3g}); greedy tokens equal x86's: {same}")  # fmt: skip
    ok = err_x86 <= 1e-3 * max(scale, 1.0) and same
    if args.csv is not None:
        new = not args.csv.exists()
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        with args.csv.open("a") as f:
            if new:
                f.write("model,quantization,device,tokens,max_err_vs_x86,max_err_vs_float64,logit_scale,greedy_equal,ok\n")
            f.write(f"{args.model},{quant},{launcher.adapter.info['device']},{' '.join(map(str, args.tokens))},"
                    f"{err_x86:.3g},{err_ref:.3g},{scale:.3g},{same},{ok}\n")  # fmt: skip
    return 0 if ok else 1


def x86_logits(args: argparse.Namespace, quant: str) -> np.ndarray:
    """Decode logits of ``args.tokens`` from an x86 build of the same model and quantization."""
    import tempfile

    from perfx_compiler.pipeline import compile_model
    from perfx_compiler.runtime.engine import Engine

    out = args.host_build
    if out is None or not (out / "perfx-config.json").exists():
        out = out or Path(tempfile.mkdtemp(prefix="perfx-x86-"))
        start = time.perf_counter()
        compile_model(args.model, "host", out, progress=False, max_context=args.max_context, quantization=quant,
                      activations="f32")  # fmt: skip  # float activations, as the WGSL kernels compute
        print(f"x86 build ({quant}): {time.perf_counter() - start:.1f} s -> {out}")
    engine = Engine(out)
    return np.stack([engine.decode(t) for t in args.tokens])


if __name__ == "__main__":
    sys.exit(main())
