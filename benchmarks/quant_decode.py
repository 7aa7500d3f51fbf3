"""Decode speed per quantization and kernel launches per decode step, for one model.

    python benchmarks/quant_decode.py [--model smollm2-135m] [--quant f32 q4_g128 ...] [--rounds 3]

Compiles the model once per quantization (artifacts cached under --work), then times greedy decode
with the same prompt in interleaved rounds (A B A B ...), so background load on a shared machine
hits every variant alike; reports the best round. Kernel counts come from the module after phase 2
(lowering), without and with the fusion passes. Results: benchmarks/results/quant_decode.csv.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _common import RESULTS, prefill_decode_rates, write_csv

PROMPT_IDS = [9, 1432, 2115, 253, 655, 28, 665, 436, 253, 1347, 2214]  # any 11 in-vocabulary ids


def compile_if_needed(model: str, quant: str, work: Path) -> Path:
    from perfx_compiler.pipeline import compile_model

    out = work / f"{Path(model).name}-{quant}"
    if not (out / "perfx-config.json").is_file():
        compile_model(model, "host", out, progress=False, quantization=quant)
    return out


def kernel_counts(model: str) -> dict[str, int]:
    """Kernels per decode step after phase 2, with only weight_layout vs the default passes."""
    from perfx_compiler import pipeline
    from perfx_compiler.model.loader import load_model
    from perfx_compiler.passes.report import kernel_counts as counts
    from perfx_compiler.targets import load_target

    desc = load_model(model)
    out = {}
    for label, passes in (("unfused", ["weight_layout"]), ("fused", None)):
        kw = {"batching": False} if "batching" in pipeline.CompileOptions.__dataclass_fields__ else {}
        opts = pipeline.CompileOptions(target="host", passes=passes, progress=False, **kw)
        st = pipeline.CompileState(desc=desc, target=load_target("host"), options=opts)
        for phase in (pipeline.phase_import, pipeline.phase_passes, pipeline.phase_lower):
            phase(st)
        out[label] = counts(st.mod)["decode"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quant", nargs="+", default=["f32", "gguf", "q8", "q4_g128", "q4_awq_g128", "q4_g64", "q4_g32", "q4_sym_g128"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--work", type=Path, default=Path("/tmp/perfx-bench-quant"))
    ap.add_argument("--no-counts", action="store_true")
    args = ap.parse_args()

    import tvm  # noqa: F401 - the full library first: the engine alone would load only the runtime

    from perfx_compiler.runtime.engine import Engine

    arts = {q: compile_if_needed(args.model, q, args.work) for q in args.quant}
    engines = {q: Engine(a) for q, a in arts.items()}
    best: dict[str, tuple[float, float]] = {q: (0.0, 0.0) for q in arts}
    for _ in range(args.rounds):
        for q, eng in engines.items():
            pre, dec = prefill_decode_rates(eng, PROMPT_IDS, args.steps)
            best[q] = (max(best[q][0], pre), max(best[q][1], dec))
    rows = []
    for q, art in arts.items():
        manifest = json.loads((art / "perfx-config.json").read_text())
        rows.append({
            "model": args.model, "quantization": q, "weight_bytes": manifest["weight_bytes"],
            "bytes_per_param": round(manifest["weight_bytes"] / manifest["parameters"], 4),
            "prefill_tok_s": round(best[q][0], 1), "decode_tok_s": round(best[q][1], 1),
        })
    for r in rows:
        print(r)
    write_csv(RESULTS / "quant_decode.csv", rows)
    if not args.no_counts:
        print("decode kernels per token:", kernel_counts(args.model))


if __name__ == "__main__":
    main()
