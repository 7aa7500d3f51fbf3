"""The vulkan build of a real model, decoded through the WGSL launcher on lavapipe vs a float64 numpy reference.

    XDG_RUNTIME_DIR=/tmp python benchmarks/vulkan_lavapipe_check.py [--model smollm2-135m] [--tokens 1 504 3458]

Phases 0-3 of the pipeline for the vulkan target (int32 indices, WGSL kernels), then each token through
``decode`` kernel by kernel on the first wgpu adapter (Mesa's lavapipe on a CPU-only machine). fp32 weights
(``--quantization f32``): the GGUF passthrough kernels do not build for WebGPU yet. Prints the max logit
error against :class:`perfx_compiler.model.reference.ReferenceModel` and exits 1 when it exceeds 1e-3 x scale
or the greedy tokens differ.
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
    args = ap.parse_args(argv)
    why = webgpu_available()
    if why:
        print(f"skip: {why}")
        return 2
    start = time.perf_counter()
    desc = load_model(args.model, max_context=args.max_context)
    options = P.CompileOptions(target="vulkan", progress=False, quantization="f32", batching=False)
    state = P.CompileState(desc=desc, target=load_target("vulkan"), options=options)
    phases = dict(P.PHASES)
    for name in ("import", "passes", "lower", "schedule"):
        phases[name](state)
    print(f"vulkan module for {args.model}: {time.perf_counter() - start:.1f} s")
    launcher = WebGPULauncher()
    start = time.perf_counter()
    got = np.stack(run_decode_steps(state, launcher, args.tokens, state.weights))
    print(f"{len(args.tokens)} decode steps on {launcher.adapter.info['device']}: "
          f"{time.perf_counter() - start:.1f} s, {launcher.launches} WGSL launches")  # fmt: skip
    ref = ReferenceModel(desc)
    want = np.stack([ref.forward([t]).reshape(-1) for t in args.tokens])
    err = float(np.abs(got - want).max())
    scale = float(np.abs(want).max())
    same = bool((got.argmax(-1) == want.argmax(-1)).all())
    print(f"max |logit - float64 reference| = {err:.3g} (logit scale {scale:.3g}); greedy tokens equal: {same}")
    return 0 if err <= 1e-3 * max(scale, 1.0) and same else 1


if __name__ == "__main__":
    sys.exit(main())
