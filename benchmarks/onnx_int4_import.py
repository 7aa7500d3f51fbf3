"""An onnxruntime-genai int4 model imported by PerfX: weight bytes and decode speed with the file's
int4 blocks on PerfX's int4 kernels (quantization ``onnx``, the default for such a file) vs the
same weights dequantized to fp32 (``f32``: what the importer did before), and onnxruntime on the file.

    python benchmarks/onnx_int4_import.py [--hidden 1024 --ffn 2816 --layers 4] [--steps 48] [--rounds 5]

The model is made offline: a random-weight Llama GGUF (``write_tiny_gguf``) -> Hugging Face folder
-> ``python -m onnxruntime_genai.models.builder -p int4 -e cpu`` with ``accuracy_level=1`` (fp32
activations, like PerfX's). Decode runs in interleaved rounds (A B C A B C ...), 2 threads for
everyone; each row is the median over rounds, with the CPU placement measured before the round
(docs: shared machines move between "shared" and "split" placements). onnxruntime runs through
``OrtDecoder`` (past/present unshared: it also copies the KV cache each step).
Results: benchmarks/results/onnx_int4_import.csv + .png.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROMPT = [9, 143, 211, 253, 65, 28, 66, 43, 253, 134, 221]


def build_model(work: Path, hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, vocab: int) -> Path:
    from perfx_compiler.model.gguf import load_gguf
    from perfx_compiler.model.hf import write_hf_folder
    from perfx_compiler.model.testing import write_tiny_gguf

    out = work / "genai_int4"
    if (out / "model.onnx").is_file():
        return out / "model.onnx"
    gguf, _ = write_tiny_gguf(work / "model.gguf", arch="llama", hidden=hidden, ffn=ffn, layers=layers, heads=heads,
                              kv_heads=kv_heads, vocab=vocab, tied=False, context_length=1024, seed=7)
    folder = write_hf_folder(load_gguf(gguf), work / "hf")
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", str(folder), "-o", str(out), "-p", "int4",
           "-e", "cpu", "-c", str(work / "cache"), "--extra_options", "accuracy_level=1"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out / "model.onnx"


def compile_variant(graph: Path, quant: str, work: Path) -> Path:
    from perfx_compiler.pipeline import compile_model

    out = work / f"art-{quant}"
    if not (out / "perfx-config.json").is_file():
        compile_model(str(graph), "host", out, progress=False, quantization=quant, batching=False)
    return out


def decode_tok_s(step, reset, steps: int) -> float:
    import numpy as np

    reset()
    tok = int(np.argmax(step(PROMPT)))
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = int(np.argmax(step([tok])))
    return steps / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--work", type=Path, default=Path("/tmp/perfx_onnx_int4_bench"))
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "onnx_int4_import.csv")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)

    import perfx_compiler.pipeline  # noqa: F401  (the compiler's TVM first: the runtime alone loads a slimmer one)

    graph = build_model(args.work, args.hidden, args.ffn, args.layers, args.heads, args.kv_heads, args.vocab)
    arts = {q: compile_variant(graph, q, args.work) for q in ("onnx", "f32")}

    from perfx_compiler.bench.machine import pingpong_ns, placement
    from perfx_compiler.frontend.decoder_io import OrtDecoder
    from perfx_compiler.runtime.engine import Engine
    runners = {}
    for q, art in arts.items():
        eng = Engine(art)

        def step(ids, eng=eng):
            return eng.prefill(ids)[0] if len(ids) > 1 else eng.decode(ids[0])

        runners[f"perfx-{q}"] = (step, eng.reset)
    ort = OrtDecoder(graph, threads=2)
    runners["onnxruntime"] = (lambda ids: ort.step(ids)[-1], ort.reset)

    rates: dict[str, list[float]] = {k: [] for k in runners}
    places: list[str] = []
    for r in range(args.rounds):
        places.append(placement(pingpong_ns(settle_s=0.3)))
        for name, (step, reset) in runners.items():
            rates[name].append(decode_tok_s(step, reset, args.steps))
        print(f"round {r}: {places[-1]}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()), flush=True)

    weight_bytes = {f"perfx-{q}": json.loads((a / "perfx-config.json").read_text())["weight_bytes"] for q, a in arts.items()}
    weight_bytes["onnxruntime"] = sum(p.stat().st_size for p in graph.parent.glob("model.onnx*"))
    manifest = json.loads((arts["onnx"] / "perfx-config.json").read_text())
    # the artifacts' activation format (auto: int8 on AVX-512 VNNI for quantized weights)
    acts = {f"perfx-{q}": json.loads((a / "perfx-config.json").read_text()).get("activations", "f32")
            for q, a in arts.items()}
    dims = f"hidden {args.hidden}, ffn {args.ffn}, layers {args.layers}, vocab {args.vocab}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "activations", "model", "parameters", "weight_bytes", "decode_tok_s_median",
                    "decode_tok_s_all", "placements", "steps"])
        for name in runners:
            w.writerow([name, acts.get(name, "f32 (accuracy_level=1)"), dims, manifest["parameters"], weight_bytes[name],
                        round(statistics.median(rates[name]), 2), " ".join(f"{x:.2f}" for x in rates[name]),
                        " ".join(places), args.steps])
    print(f"wrote {args.out}")
    plot(args.out, rates, weight_bytes, dims)
    return 0


def plot(csv_path: Path, rates: dict[str, list[float]], weight_bytes: dict[str, int], dims: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rates)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar(names, [statistics.median(rates[n]) for n in names], color=["tab:blue", "tab:gray", "tab:orange"])
    a.set_ylabel("decode tok/s (median over rounds)")
    b.bar(names, [weight_bytes[n] / 1e6 for n in names], color=["tab:blue", "tab:gray", "tab:orange"])
    b.set_ylabel("weight MB (artifact / onnx file + data)")
    fig.suptitle(f"onnxruntime-genai int4 file imported by PerfX ({dims}), 2 threads")
    fig.tight_layout()
    fig.savefig(csv_path.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    sys.exit(main())
