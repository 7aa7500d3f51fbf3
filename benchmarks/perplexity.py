"""Perplexity of the default model per weight format, over the whole shipped evaluation text.

Text: ``benchmarks/data/kjv_eval_mark_ruth.txt`` (KJV Gospel of Mark + Ruth, public domain; see
``benchmarks/data/README.md``; AWQ calibrates on Genesis 1-3, a different text), tokenized with the
model's tokenizer: every token of it is scored (the script refuses fewer than ``--min-tokens``).

Method (sliding window, each token scored exactly once): windows of ``--window`` tokens start every
``--stride`` tokens; each window runs one ``prefill_all`` from an empty KV cache, and only the tokens
that no earlier window scored are scored (all of them in the first window; the last ``stride`` in the
others, each with at least ``window - stride`` tokens of context). Perplexity = exp(mean negative
log-likelihood over all scored tokens).

Rows:
  * ``f32``: the compiled PerfX artifact on the dequantized GGUF weights in fp32: the baseline every
    check below is relative to.
  * ``reference_f32``: the float32 numpy reference forward pass (``perfx_compiler/model/reference.py``)
    on the same weights, over the first ``--reference-windows`` windows only (it is ~4x slower than
    the compiled model on this shared 2-core machine); it checks that the baseline is the model.
  * ``gguf`` (passthrough of the file's Q4_1/Q8_0 blocks), ``q4_g128`` (round-to-nearest), ``q4_awq_g128``,
    ``q8``, ``bf16`` (bf16 weights and bf16 matmul inputs, ``--precision bf16``; needs AVX-512 BF16) and
    ``gguf_a8`` (the passthrough weights with int8 activations, ``--activations int8``; needs VNNI):
    compiled PerfX artifacts, each compiled once. Weight-only rows use fp32 activations. int8
    activations are used only by decode's GEMVs (prefill multiplies float GEMMs), so ``gguf_a8`` is
    scored through ``decode``, one token at a time, over the first ``--decode-windows`` windows, and
    compared with ``gguf_decode`` (the gguf artifact, f32 activations, also through decode) on the same
    tokens. (Prefill dequantizes the GGUF blocks once and runs the float GEMM, so ``gguf`` equals ``f32``
    bit for bit there; ``gguf_decode`` is the check of the passthrough GEMV kernels.)

Checks the issue asks for (printed, and written to ``perplexity_checks.csv``): AWQ beats
round-to-nearest at group 128; q8, bf16 and the f16 / int8 KV caches (``kv_f16``, ``kv_int8``: f32 weights,
``--kv-cache``) within 1% of the baseline; passthrough equal to the
compiled f32 baseline within float rounding (perplexity within 0.01% and per-token log-probabilities
within 2e-3), and the compiled f32 artifact equal to the reference likewise (on the reference's tokens).

    python benchmarks/perplexity.py [--window 512 --stride 384] [--configs f32 gguf q4_g128 ...]
    python benchmarks/perplexity.py --vs-llamacpp gemma3-270m-q4_k_m,smollm2-q4_k_m [--tokens 640]

``--vs-llamacpp``: per GGUF model (run_peers.py's names; random-weight files are left out, their near-flat
logits make top-1 agreement noise) the first ``--tokens`` tokens of the text (BOS first), teacher-forced.
llama.cpp runs the file as it ships (fp16 KV cache), with an f32 KV cache, and on an F32 copy of its weights;
PerfX runs its default build (int8 activations on AVX-512 VNNI machines) with an f32 and with an f16 KV cache
(llama.cpp's), and ``--activations f32``, each as one ``prefill_all``; the int8 build also through decode, one
token at a time. Written to ``agreement.csv``: each (run, reference) pair's top-1 agreement, both perplexities
and the largest logit difference. Besides every run against llama.cpp, two pairs bound what agreement can
mean: PerfX's int8 decode against its own prefill (the same arithmetic summed in another order) and PerfX's f32
build against llama.cpp's F32 weights (neither engine's int8 / f16 rounding).

Writes ``benchmarks/results/perplexity.csv``, ``perplexity_checks.csv`` and ``perplexity.png``. Artifacts
and each config's per-token log-probabilities are cached in ``--work`` (a rerun only measures configs
not measured yet, e.g. one the compiler gained since; delete the folder after changing the compiler).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _common import figure, write_csv

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TEXT = REPO / "benchmarks" / "data" / "kjv_eval_mark_ruth.txt"
RESULTS = REPO / "benchmarks" / "results"
REFERENCE = "reference_f32"
BASELINE = "f32"
# name -> compile options. Weight-only rows pin activations to f32 (``auto`` picks int8 activations
# for quantized weights on VNNI CPUs); gguf_a8 is the same passthrough weights with int8 activations.
CONFIGS: dict[str, dict] = {
    "f32": {"quantization": "f32", "activations": "f32"},
    "gguf": {"quantization": "gguf", "activations": "f32"},
    "q4_g128": {"quantization": "q4_g128", "activations": "f32"},
    "q4_awq_g128": {"quantization": "q4_awq_g128", "activations": "f32"},
    "q8": {"quantization": "q8", "activations": "f32"},
    "bf16": {"quantization": "bf16", "precision": "bf16", "activations": "f32"},
    "gguf_decode": {"quantization": "gguf", "activations": "f32"},
    "gguf_a8": {"quantization": "gguf", "activations": "int8"},
    # the f32 weights over an f16 / int8 KV cache (--kv-cache; issue #26 asks int8 within 1% at 4k context:
    # --window 4096 --stride 3072 --configs f32 kv_int8)
    "kv_f16": {"quantization": "f32", "activations": "f32", "kv_cache": "f16"},
    "kv_int8": {"quantization": "f32", "activations": "f32", "kv_cache": "int8"},
}
ARTIFACT = {"gguf_decode": "gguf"}  # rows that score another row's artifact through decode
# int8 activations exist only in the decode GEMVs (<= 8 static rows); prefill runs float GEMMs. So this
# row is scored token by token through ``decode`` (over the first --decode-windows windows: ~30x slower).
# Prefill dequantizes GGUF blocks once and runs the float GEMM, so gguf's prefill equals f32's bit for bit;
# gguf_decode checks the passthrough GEMV kernels themselves, and is what gguf_a8 is compared with.
DECODE_PATH = {"gguf_decode", "gguf_a8"}


def eval_ids(desc: object) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(desc.tokenizer_json).encode(TEXT.read_text()).ids  # type: ignore[attr-defined]


def windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored position) per window; positions 1..n-1 are scored once each."""
    out, scored = [], 1  # token 0 has no context: never scored
    start = 0
    while scored < n:
        end = min(start + window, n)
        out.append((start, end, scored))
        scored = end
        start = end - (window - stride) if end < n else n
        start = max(start, 0)
    return out


def token_logprobs(forward: Callable[[list[int]], np.ndarray], reset: Callable[[], None], ids: list[int],
                   window: int, stride: int, max_windows: int | None = None) -> np.ndarray:
    """log p(ids[i] | context) for i = 1..len(ids)-1 (or the first ``max_windows`` windows' tokens),
    by the sliding-window method above."""
    spans = windows(len(ids), window, stride)[:max_windows]
    out = np.zeros(spans[-1][1] - 1, dtype=np.float64)
    for start, end, first in spans:
        reset()
        logits = np.asarray(forward(ids[start:end]), dtype=np.float64).reshape(end - start, -1)
        rows = logits[first - 1 - start : end - 1 - start]  # logits at position p predict token p + 1
        m = rows.max(axis=1, keepdims=True)
        logp = rows - m - np.log(np.exp(rows - m).sum(axis=1, keepdims=True))
        out[first - 1 : end - 1] = logp[np.arange(end - first), ids[first:end]]
    return out


def supported(name: str) -> str | None:
    """None when this compiler can build config ``name``, else why not."""
    from perfx_compiler.pipeline import CompileOptions

    missing = [k for k in CONFIGS[name] if k not in CompileOptions.__dataclass_fields__]
    return f"CompileOptions has no {', '.join(missing)}" if missing else None


def plot(rows: list[dict], path: Path) -> None:
    with figure(path, figsize=(9, 4), dpi=120) as (fig, ax):
        full = max(int(r["tokens"]) for r in rows)
        names = [r["config"] + ("" if int(r["tokens"]) == full else f"\n({r['tokens']} tok)") for r in rows]
        vals = [float(r["perplexity"]) for r in rows]
        colors = ["#777" if r["config"] in (REFERENCE, BASELINE) else "#3a7" for r in rows]
        bars = ax.bar(names, vals, color=colors)
        for b, r in zip(bars, rows, strict=True):
            if int(r["tokens"]) != full:  # first windows only: compare with the baseline's same-token value
                b.set_hatch("//")
                ax.plot([b.get_x(), b.get_x() + b.get_width()], [r["baseline_same_tokens"]] * 2, "k--", lw=1)
        for b, v in zip(bars, vals, strict=True):
            ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.3f}", ha="center", va="bottom", fontsize=8)
        ax.set_ylim(min(vals) * 0.95, max(vals) * 1.04)
        ax.set_ylabel("perplexity (lower is better)")
        r0 = rows[0]
        ax.set_title(f"{r0['model']}: {full} tokens of KJV Mark+Ruth, window {r0['window']} stride {r0['stride']} "
                     "(hatched: first windows only; dashed: f32 on those tokens)", fontsize=9)
        ax.tick_params(axis="x", labelsize=8)


def checks(rows: dict[str, dict], logp: dict[str, np.ndarray]) -> list[dict]:
    """The issue's quality checks, each a row with its numbers and pass/fail."""
    out = []
    base = rows[BASELINE]["perplexity"]

    def add(name: str, ok: bool, detail: str) -> None:
        out.append({"check": name, "passed": ok, "detail": detail})

    if "q4_awq_g128" in rows and "q4_g128" in rows:
        a, r = rows["q4_awq_g128"]["perplexity"], rows["q4_g128"]["perplexity"]
        add("awq_beats_rtn_g128", a < r, f"q4_awq_g128 {a:.4f} < q4_g128 {r:.4f}")
    for name in ("q8", "bf16", "kv_f16", "kv_int8"):
        if name in rows:
            d = rows[name]["perplexity"] / base - 1
            add(f"{name}_within_1pct_of_baseline", abs(d) < 0.01, f"{100 * d:+.4f}% vs {BASELINE} {base:.4f}")
    if "gguf_a8" in rows and "gguf_decode" in rows:
        n = min(len(logp["gguf_a8"]), len(logp["gguf_decode"]))
        d = float(np.exp(-logp["gguf_a8"][:n].mean()) / np.exp(-logp["gguf_decode"][:n].mean()) - 1)
        add("gguf_a8_within_1pct_of_gguf_decode", abs(d) < 0.01, f"{n} tokens, both through decode: {100 * d:+.4f}%")
    for name, ref in (("gguf", BASELINE), ("gguf_decode", BASELINE), (BASELINE, REFERENCE)):
        if name in rows and ref in rows:
            n = min(len(logp[name]), len(logp[ref]))  # the reference covers the first windows only
            a, b = logp[name][:n], logp[ref][:n]
            d = float(np.exp(-a.mean()) / np.exp(-b.mean()) - 1)
            dl = float(np.abs(a - b).max())
            add(f"{name}_equals_{ref}_within_rounding", abs(d) < 1e-4 and dl < 2e-3,
                f"{n} tokens: perplexity {100 * d:+.5f}%, max |d log p| per token {dl:.2e}")
    return out


# --- --vs-llamacpp: teacher-forced agreement with llama.cpp on the same GGUF file ------------------------
def perplexity_of(logits: np.ndarray, ids: list[int]) -> float:
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(-1, keepdims=True)
    lp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return float(np.exp(-lp[np.arange(len(ids) - 1), ids[1:]].mean()))


def top1(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(a.argmax(-1) == b.argmax(-1)))


def max_logit_diff(a: np.ndarray, ref: np.ndarray) -> float:
    """Largest |a - ref| over all positions, relative to the reference's largest |logit|."""
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def decode_all(engine: Any, ids: list[int]) -> np.ndarray:
    """Logits [len(ids), vocab] of ``ids`` fed one ``decode`` each, on the engine's current cache."""
    return np.stack([np.asarray(engine.decode(t), dtype=np.float32).reshape(-1) for t in ids])


def decode_logits(engine: Any, ids: list[int]) -> np.ndarray:
    """Teacher-forced logits through the decode path: the first token by prefill, then one ``decode`` each."""
    engine.reset()
    return np.concatenate([np.asarray(engine.prefill(ids[:1]), dtype=np.float32).reshape(1, -1),
                           decode_all(engine, ids[1:])])


def agreement_rows(name: str, work: Path, tokens: int) -> list[dict]:
    from run_peers import model_file

    from perfx_compiler.bench.llamacpp_logits import llamacpp_logits
    from perfx_compiler.model.loader import load_model
    from perfx_compiler.model.tokenizer import load_tokenizer
    from perfx_compiler.pipeline import compile_model
    from perfx_compiler.runtime.engine import Engine, read_manifest

    path = model_file(name, work / "models")
    desc = load_model(path, max_context=max(1024, tokens))
    ids = load_tokenizer(desc.tokenizer_json).encode(TEXT.read_text(encoding="utf-8")[: 12 * tokens]).ids
    if len(ids) < tokens - 1:
        raise SystemExit(f"{name}: the text gives {len(ids)} tokens, fewer than {tokens}")
    ids = [desc.config.bos_token_id, *ids[: tokens - 1]]
    logits = {"llama.cpp": llamacpp_logits(path, ids), "llama.cpp f32 KV": llamacpp_logits(path, ids, mode="f32-kv"),
              "llama.cpp F32 weights": llamacpp_logits(path, ids, mode="f32-weights")}
    int8 = None
    for act, kv in (("auto", "f32"), ("auto", "f16"), ("f32", "f32")):
        art = compile_model(desc, "host", work / f"agree-{name}-{act}-{kv}", progress=False, activations=act,
                            kv_cache=kv)
        used = read_manifest(art)["activations"]
        run = f"perfx ({used} activations{' + f16 KV' if kv == 'f16' else ''})"
        if run in logits:  # no int8 on this CPU: "auto" is the f32 build
            continue
        engine = Engine(art)
        logits[run] = np.asarray(engine.prefill_all(ids))
        if used != "f32" and kv == "f32":
            int8 = run
            logits[f"{run} via decode"] = decode_logits(engine, ids)
    # (run, reference): every run against llama.cpp as it runs the file; then the two pairs that bound what
    # agreement means: PerfX's int8 build against itself (prefill's GEMMs vs decode's GEMVs: the same
    # arithmetic summed in another order), and PerfX's f32 build against llama.cpp without its int8 / f16 rounding.
    pairs = [(run, "llama.cpp") for run in logits if run not in ("llama.cpp", "llama.cpp F32 weights")]
    if int8:
        pairs.append((f"{int8} via decode", int8))
    pairs.append(("perfx (f32 activations)", "llama.cpp F32 weights"))
    rows = []
    for run, ref in pairs:
        a, b = logits[run], logits[ref]
        ppl, ref_ppl = perplexity_of(a, ids), perplexity_of(b, ids)
        rows.append({"model": name, "run": run, "reference": ref, "tokens": len(ids), "top1": round(top1(a, b), 4),
                     "perplexity": round(ppl, 4), "reference_perplexity": round(ref_ppl, 4),
                     "perplexity_ratio": round(ppl / ref_ppl, 4), "max_logit_diff": f"{max_logit_diff(a, b):.2e}"})
    return rows


def plot_agreement(rows: list[dict], out: Path) -> None:
    models = sorted({r["model"] for r in rows})
    with figure(out, 1, len(models), figsize=(6.5 * len(models), 3.6), squeeze=False) as (fig, axes):
        for ax, m in zip(axes[0], models, strict=True):
            rs = [r for r in rows if r["model"] == m]
            ax.barh([f"{r['run']}\nvs {r['reference']}" for r in rs], [100 * r["top1"] for r in rs],
                    color=["tab:gray" if r["run"].startswith("llama.cpp") else "tab:blue" for r in rs])
            for y, r in enumerate(rs):
                ax.text(80.5, y, f"{100 * r['top1']:.1f}%  ppl {r['perplexity_ratio']:.3f}x", va="center",
                        fontsize=7, color="white")
            ax.axvline(98, color="tab:red", ls="--", lw=1)
            ax.set_xlim(80, 100)
            ax.invert_yaxis()
            ax.tick_params(axis="y", labelsize=7)
            ax.set_xlabel("teacher-forced top-1 agreement (%); red: the issue's 98%")
            ax.set_title(m)


def vs_llamacpp(models: str, tokens: int, work: Path, out: Path) -> int:
    """The ``--vs-llamacpp`` mode: agreement.csv / agreement.png in ``out``."""
    rows: list[dict] = []
    for name in [m.strip() for m in models.split(",") if m.strip()]:
        new = agreement_rows(name, work, tokens)
        for r in new:
            print(f"{r['model']:20s} {r['run'] + ' vs ' + r['reference']:70s} top-1 {100 * r['top1']:5.1f}%  "
                  f"ppl {r['perplexity']:.3f} ({r['perplexity_ratio']:.4f}x)  max diff {r['max_logit_diff']}")
        rows += new
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "agreement.csv", rows)
    plot_agreement(rows, out / "agreement.png")
    print(f"wrote {out / 'agreement.csv'}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), help=f"subset of {', '.join(CONFIGS)}")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--stride", type=int, default=384)
    p.add_argument("--reference-windows", type=int, default=6, help="windows the numpy reference runs")
    p.add_argument("--decode-windows", type=int, default=3, help="windows the decode-path rows run")
    p.add_argument("--min-tokens", type=int, default=20000)
    p.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens (quick tries)")
    p.add_argument("--work", type=Path, default=Path("/tmp/perfx-perplexity"))
    p.add_argument("--out", type=Path, default=RESULTS / "perplexity.csv")
    p.add_argument("--vs-llamacpp", metavar="MODELS", default=None,
                   help="instead: top-1 agreement and perplexity against llama.cpp on these run_peers.py GGUF "
                        "models (e.g. gemma3-270m-q4_k_m,smollm2-q4_k_m), --tokens teacher-forced tokens; "
                        "agreement.csv in --agreement-out")
    p.add_argument("--tokens", type=int, default=640)
    p.add_argument("--agreement-out", type=Path, default=RESULTS)
    args = p.parse_args()
    if args.vs_llamacpp:
        return vs_llamacpp(args.vs_llamacpp, args.tokens, Path("/tmp/perfx-bench"), args.agreement_out)
    if not 0 < args.stride <= args.window:
        p.error("--stride must be in 1..--window")

    from perfx_compiler.errors import PerfXError
    from perfx_compiler.model.loader import load_model
    from perfx_compiler.model.reference import ReferenceModel
    from perfx_compiler.pipeline import compile_model
    from perfx_compiler.runtime.engine import Engine

    desc = load_model(args.model, max_context=args.window)
    ids = eval_ids(desc)[: args.max_tokens]
    if len(ids) < args.min_tokens:
        p.error(f"the text has {len(ids)} tokens, fewer than --min-tokens {args.min_tokens}")
    method = f"sliding window {args.window}, stride {args.stride}, each token scored once"
    print(f"{len(ids)} tokens, {len(windows(len(ids), args.window, args.stride))} windows ({method})", flush=True)

    rows: dict[str, dict] = {}
    logp: dict[str, np.ndarray] = {}

    def cached(name: str) -> Path:
        part = (f"-r{args.reference_windows}" if name == REFERENCE else
                f"-d{args.decode_windows}" if name in DECODE_PATH else "")
        return args.work / f"logp-{args.model}-{name}{part}-w{args.window}-s{args.stride}-n{len(ids)}.npz"

    def load(name: str) -> bool:
        if not cached(name).is_file():
            return False
        z = np.load(cached(name))
        record(name, z["logp"], float(z["seconds"]), int(z["weight_bytes"]), str(z["note"]), save=False)
        return True

    def record(name: str, lp: np.ndarray, secs: float, weight_bytes: int, note: str, save: bool = True) -> None:
        if save:
            args.work.mkdir(parents=True, exist_ok=True)
            np.savez(cached(name), logp=lp, seconds=secs, weight_bytes=weight_bytes, note=note)
        logp[name] = lp
        rows[name] = {"model": args.model, "config": name, "tokens": len(lp), "window": args.window,
                      "stride": args.stride, "perplexity": round(float(np.exp(-lp.mean())), 4),
                      "weight_bytes": weight_bytes, "seconds": round(secs, 1), "note": note}
        print(rows[name], flush=True)

    if not load(REFERENCE):
        ref = ReferenceModel(desc, dtype=np.float32)
        t = time.perf_counter()
        lp = token_logprobs(ref.forward, ref.reset, ids, args.window, args.stride, args.reference_windows)
        record(REFERENCE, lp, time.perf_counter() - t, sum(np.asarray(w).size * 4 for w in desc.weights.values()),
               f"numpy float32 reference on the dequantized GGUF weights, first {args.reference_windows} windows")

    skipped = {}
    for name in args.configs:
        if load(name):
            continue
        why = supported(name)
        art = args.work / f"{args.model}-{ARTIFACT.get(name, name)}-w{args.window}"
        if why is None and not (art / "perfx-config.json").is_file():
            t = time.perf_counter()
            try:
                compile_model(desc, "host", art, progress=False, batching=False, **CONFIGS[name])
            except PerfXError as err:
                why = str(err)
            else:
                print(f"{name}: compiled in {time.perf_counter() - t:.0f} s", flush=True)
        if why is not None:
            skipped[name] = why
            print(f"{name}: skipped ({why})", flush=True)
            continue
        eng = Engine(art)
        t = time.perf_counter()
        if name in DECODE_PATH:
            lp = token_logprobs(functools.partial(decode_all, eng), eng.reset, ids, args.window, args.stride,
                                args.decode_windows)
        else:
            lp = token_logprobs(eng.prefill_all, eng.reset, ids, args.window, args.stride)
        manifest = json.loads((art / "perfx-config.json").read_text())
        how = f", scored through decode over the first {args.decode_windows} windows" if name in DECODE_PATH else ""
        record(name, lp, time.perf_counter() - t, manifest["weight_bytes"],
               "compiled PerfX artifact, " + ", ".join(f"{k}={v}" for k, v in CONFIGS[name].items()) + how)

    if BASELINE not in rows:
        p.error(f"the baseline config {BASELINE} must be among --configs")
    for name, r in rows.items():
        # rows over the first windows only are compared with the baseline on the same tokens
        base = float(np.exp(-logp[BASELINE][: len(logp[name])].mean()))
        r["baseline_same_tokens"] = round(base, 4)
        r["delta_vs_baseline_pct"] = round(100 * (float(np.exp(-logp[name].mean())) / base - 1), 4)
        r["method"] = method
    table = list(rows.values())
    write_csv(args.out, table)
    plot(table, args.out.with_suffix(".png"))

    results = checks(rows, logp)
    results += [{"check": f"{n}_measured", "passed": "", "detail": f"skipped: {why}"} for n, why in skipped.items()]
    check_path = args.out.with_name(args.out.stem + "_checks.csv")
    write_csv(check_path, results, columns=["check", "passed", "detail"])
    for c in results:
        print(f"{'PASS' if c['passed'] is True else 'FAIL' if c['passed'] is False else 'SKIP'}  {c['check']}: {c['detail']}")
    print(f"wrote {args.out}, {check_path} and {args.out.with_suffix('.png')}")
    return 0 if all(c["passed"] is not False for c in results) else 1


if __name__ == "__main__":
    sys.exit(main())
